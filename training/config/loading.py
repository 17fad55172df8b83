"""Reading a reviewed YAML file into a frozen, strict settings model, every problem as one line.

The environment file, the recipe and the site settings all load through here, so they reject the same
mistakes the same way: unknown keys, wrong types, duplicate keys, values outside their constraints. A
problem reads `file: key: value is not allowed; allowed: ...` (or `file: key: unknown key; allowed keys
here: ...`, `file: key: required key is missing`), and all of a file's problems are reported at once.
"""

from __future__ import annotations

import json
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails, PydanticCustomError

from training.errors import UserError


class ConfigError(UserError):
    """One or more problems in a settings file; `problems` holds one line each, `str()` all of them."""

    def __init__(self, problems: Sequence[str]):
        super().__init__("\n".join(problems))
        self.problems = list(problems)


class YamlSyntaxError(ConfigError):
    """Text that is not YAML at all (a recipe override's value then stays a plain string)."""


class StrictModel(BaseModel):
    """A section of a settings file: frozen, no unknown keys, no silent type conversions."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True, validate_default=True)


@dataclass(frozen=True)
class Allowed:
    """What a constrained field allows, in words; shown instead of the generic text when a constraint fails."""

    text: str


def _yaml_number(value: Any) -> Any:
    # YAML 1.1 (PyYAML) reads `1e-5` (no dot) as a string; a number is what the author meant.
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


# C0 control characters and DEL: a newline in a value would start a new line of a job script (or of an
# error message), a carriage return or an escape would hide text on a terminal; no setting needs one.
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]")
CONTROL_CHARACTERS_ERROR = "control_characters"
ONE_LINE = "one line of text without control characters (newline, carriage return, tab, NUL, escape)"


def has_control_characters(text: str) -> bool:
    return CONTROL_CHARACTERS.search(text) is not None


def printable(text: str) -> str:
    """`text` with its control characters escaped, so a key read from a file cannot split a problem line."""
    return CONTROL_CHARACTERS.sub(lambda match: f"\\x{ord(match.group()):02x}", text)


def _one_line(value: str) -> str:
    if has_control_characters(value):
        raise PydanticCustomError(CONTROL_CHARACTERS_ERROR, "contains a control character")
    return value


# Scalars as a reviewed file spells them: no "4" for 4, no `yes` for a count, no 1 for true. Every string of a
# settings file may reach a job script or a command line, so `Str` is one line; free text (a prompt the model
# answers, which only Python reads) is `Text`.
Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict(), AfterValidator(_one_line)]
Text = Annotated[str, Strict()]
# The YAML-number conversion is listed last so that it runs first and the constraints stay plain JSON Schema
# keywords (minimum, exclusiveMaximum, ...) that an editor checks.
Float = Annotated[
    float, Strict(), Field(allow_inf_nan=False), BeforeValidator(_yaml_number), Allowed("a finite number")
]
PositiveInt = Annotated[int, Strict(), Field(gt=0), Allowed("an integer above 0")]
NonNegativeInt = Annotated[int, Strict(), Field(ge=0), Allowed("0 or more")]
PositiveFloat = Annotated[
    float,
    Strict(),
    Field(gt=0, allow_inf_nan=False),
    BeforeValidator(_yaml_number),
    Allowed("a finite number above 0"),
]
NonNegativeFloat = Annotated[
    float,
    Strict(),
    Field(ge=0, allow_inf_nan=False),
    BeforeValidator(_yaml_number),
    Allowed("a finite number, 0 or more"),
]
# A coefficient such as an Adam beta: 1 would never forget, so it is excluded.
Fraction = Annotated[
    float,
    Strict(),
    Field(ge=0, lt=1, allow_inf_nan=False),
    BeforeValidator(_yaml_number),
    Allowed("a number from 0 up to, not including, 1"),
]

Model = TypeVar("Model", bound=BaseModel)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys silently; a reviewed file must not say one thing twice."""

    duplicates: list[str]

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                self.duplicates.append(
                    f"{printable(str(key))}: appears twice (lines {seen[key]} and {line}); allowed: each key once"
                )
            else:
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's several-line report as one line: what it expected, and where (line and column, 1-based)."""
    problem = getattr(error, "problem", None)
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    if problem is None:
        return " ".join(str(error).split())
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(error, "context", None)
    return f"{problem}{where}" + (f" ({context})" if context else "")


# A reviewed settings file spells its values out; anchors and aliases that multiply them (the "billion
# laughs" of YAML) would make every later walk of the data (validation, JSON for a template) explode.
MAX_YAML_VALUES = 10_000


def expanded_values(node: yaml.Node, limit: int = MAX_YAML_VALUES) -> int:
    """How many values `node` stands for once every alias is expanded, counted up to `limit + 1`.

    Aliases share the anchored node, so sizes are memoised per node: linear in the file, not in the
    expansion. A node that contains itself expands without end and counts as over the limit."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(current: yaml.Node) -> int:
        key = id(current)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            return limit + 1
        open_nodes.add(key)
        total = 1
        if isinstance(current, yaml.SequenceNode):
            children: list[yaml.Node] = list(current.value)
        elif isinstance(current, yaml.MappingNode):
            children = [part for pair in current.value for part in pair]
        else:
            children = []
        for child in children:
            total = min(total + size(child), limit + 1)
        open_nodes.discard(key)
        sizes[key] = total
        return total

    return size(node)


def parse_yaml(text: str, label: str) -> Any:
    """`text` parsed as one YAML document; malformed YAML, duplicate keys and aliases that expand past
    MAX_YAML_VALUES are ConfigErrors naming `label`."""
    loader = _UniqueKeyLoader(text)
    loader.duplicates = []
    try:
        node = loader.get_single_node()
        if node is not None and expanded_values(node) > MAX_YAML_VALUES:
            raise ConfigError(
                [
                    f"{label}: anchors and aliases expand to more than {MAX_YAML_VALUES:,} values; "
                    f"allowed: at most {MAX_YAML_VALUES:,} values once aliases are expanded"
                ]
            )
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as error:
        raise YamlSyntaxError([f"{label}: not valid YAML: {yaml_problem(error)}"]) from None
    finally:
        loader.dispose()
    if loader.duplicates:
        raise ConfigError([f"{label}: {problem}" for problem in loader.duplicates])
    return data


def read_yaml(path: Path, label: str) -> Any:
    """The parsed file; unreadable, malformed or exploding YAML and duplicate keys are ConfigErrors naming `label`."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError([f"{label}: cannot read ({error.strerror})"]) from None
    except UnicodeDecodeError as error:
        raise ConfigError(
            [f"{label}: not UTF-8 text ({error.reason} at byte {error.start}); allowed: a UTF-8 YAML file"]
        ) from None
    return parse_yaml(text, label)


def read_mapping(path: Path, label: str) -> dict[str, Any]:
    """`read_yaml` for a file whose top level must be a mapping of keys (an empty file is an empty mapping)."""
    data = read_yaml(path, label)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{label}: top level must be a mapping of keys, got {type(data).__name__}"])
    return data


def build(model: type[Model], raw: Mapping[str, Any], label: str) -> Model:
    """`model` from a parsed file, or a ConfigError with one line per problem (all of them)."""
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        raise ConfigError([f"{label}: {problem}" for problem in problems_of(model, error)]) from None


def check(label: str, rules: Callable[[Any], list[str]], settings: Any) -> None:
    """The domain rules types cannot express: `rules(settings)` returns one line per violation."""
    problems = rules(settings)
    if problems:
        raise ConfigError([f"{label}: {problem}" for problem in problems])


def not_allowed(key: str, value: Any, allowed: str) -> str:
    """The one form of a problem line (after the file name)."""
    return f"{key}: {value!r} is not allowed; allowed: {allowed}"


def problems_of(model: type[BaseModel], error: ValidationError) -> list[str]:
    """pydantic's errors as this project's lines, in the file's order."""
    lines: list[str] = []
    details = error.errors()
    locations = [tuple(part for part in d["loc"] if not _is_validator_tag(part)) for d in details]
    for detail, location in zip(details, locations, strict=True):
        if any(len(other) > len(location) and other[: len(location)] == location for other in locations):
            continue  # a union's other branch (`or omit it`) when a value inside it is what is wrong
        line = _problem(model, detail)
        if line not in lines:
            lines.append(line)
    return lines


def _problem(model: type[BaseModel], detail: ErrorDetails) -> str:
    location = [part for part in detail["loc"] if not _is_validator_tag(part)]
    indices = [part for part in location if isinstance(part, int)]
    keys = [str(part) for part in location if not isinstance(part, int)]
    key = printable(".".join(keys) + "".join(f"[{index}]" for index in indices)) or "top level"
    # An item of a list of sections (evaluate.tasks[0].name): the problem is the nested section's key's.
    nested = bool(indices) and not isinstance(location[-1], int)
    if nested:
        key = printable("".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in location)[1:])
        indices = []
    kind = detail["type"]
    if kind == CONTROL_CHARACTERS_ERROR:
        return not_allowed(key, detail["input"], ONE_LINE)
    if kind == "extra_forbidden":
        owner = _model_at(model, keys[:-1])
        allowed = ", ".join(_public_names(owner)) if owner else "none"
        return f"{key}: unknown key; allowed keys here: {allowed}"
    field = _field_at(model, keys)
    annotation = field.annotation if field is not None else None
    if kind == "missing" and indices:  # a list shorter than its fixed length
        return not_allowed(".".join(keys), detail["input"], _describe(annotation, detail))
    if kind == "missing":
        return f"{key}: required key is missing"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return not_allowed(key, detail["input"], "a mapping of keys")
    wrong_kind = kind.endswith(("_type", "_parsing"))  # the wrong kind of value: name the kind that is allowed
    if indices:
        element = _element(annotation, indices[-1])
        return not_allowed(key, detail["input"], _describe(element, detail, words=not wrong_kind))
    if wrong_kind:
        return not_allowed(key, detail["input"], _describe(annotation, detail, words=False))
    words = [item.text for item in (field.metadata if field is not None else []) if isinstance(item, Allowed)]
    return not_allowed(key, detail["input"], words[0] if words else _describe(annotation, detail))


def _element(annotation: Any, index: int) -> Any:
    """The type of item `index` of a tuple annotation (through Optional)."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(candidate) is tuple:
            args = typing.get_args(candidate)
            return args[0] if len(args) == 2 and args[1] is Ellipsis else args[min(index, len(args) - 1)]
    return annotation


def _describe(annotation: Any, detail: ErrorDetails, words: bool = True) -> str:
    """The allowed values of a type, in words (`cpu, neuron`; `an integer`; `a list of strings`)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        texts = [item.text for item in args[1:] if isinstance(item, Allowed)] if words else []
        return texts[0] if texts else _describe(args[0], detail, words)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return " or ".join(_describe(a, detail, words) for a in inner) + (
            " (or omit it)" if len(inner) < len(args) else ""
        )
    if origin is typing.Literal:
        return ", ".join(str(a) for a in args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"a list of {_plural(args[0])}"
    if origin is tuple:
        return f"a list of {len(args)} {_plural(args[0])}"
    if origin is dict:
        return f"a mapping of {_plural(args[0])} to {_plural(args[1])}"
    context = detail.get("ctx") or {}
    if "gt" in context:
        return f"a number above {context['gt']}"
    if "ge" in context:
        return f"{context['ge']} or more"
    if "le" in context:
        return f"at most {context['le']}"
    return {int: "an integer", bool: "true or false", str: "a string", float: "a number"}.get(
        annotation, str(annotation)
    )


def _plural(annotation: Any) -> str:
    base = typing.get_args(annotation)[0] if typing.get_origin(annotation) is Annotated else annotation
    return {int: "integers", str: "strings", float: "numbers", bool: "booleans"}.get(base, "values")


def _is_validator_tag(part: Any) -> bool:
    # pydantic adds the branch of a union or a function validator to the location ("int", "function-before[...]").
    return isinstance(part, str) and (part.startswith("function-") or part in {"int", "str", "float", "bool"})


def _field_at(model: type[BaseModel], location: Sequence[Any]) -> FieldInfo | None:
    owner = _model_at(model, location[:-1])
    if owner is None or not location:
        return None
    return _fields_by_key(owner).get(str(location[-1]))


def _model_at(model: type[BaseModel], location: Sequence[Any]) -> type[BaseModel] | None:
    current: type[BaseModel] | None = model
    for part in location:
        if current is None:
            return None
        field = _fields_by_key(current).get(str(part))
        current = _model_in(field.annotation) if field is not None else None
    return current


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _fields_by_key(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """Fields by the key a file spells (the alias where there is one)."""
    return {field.alias or name: field for name, field in model.model_fields.items()}


def _public_names(model: type[BaseModel]) -> list[str]:
    return [field.alias or name for name, field in model.model_fields.items() if not field.exclude]


def schema_text(model: type[BaseModel], title: str) -> str:
    """The JSON Schema of `model` (what an editor's YAML language server checks), stable text."""
    schema = model.model_json_schema(by_alias=True)
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema, "title": title}
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"
