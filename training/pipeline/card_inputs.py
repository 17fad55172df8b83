"""The model card's inputs, read from a run directory (and the base model directory its recipe names): what the
card says, as typed values. Any input may be missing (a stage that has not run, a base model fetched by hand) or
damaged: its value is then None or a one-line reason, with a warning, and training.pipeline.card says so in its
section."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from training import outputs, software
from training.config.recipe import Recipe, load_recipe
from training.errors import UserError
from training.pipeline.hub import FETCH_MANIFEST  # written into the base model directory by the fetch stage

log = logging.getLogger(__name__)
CARD = "README.md"  # a model directory's card, the base model's as the run's
UNKNOWN_LICENSE = "unknown"  # the Hub's identifier for a licence nobody recorded
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# The files in which a base model's repository states its licence and its terms of use; copied beside the card,
# as licences such as Llama 3.1's ask of a redistribution.
LICENCE_FILES = ("LICENSE", "LICENSE.txt", "LICENSE.md", "LICENCE", "NOTICE", "USE_POLICY.md")


@dataclass(frozen=True)
class BaseModel:
    """The model the run started from: a Hub repository when the fetch stage recorded one, else a directory."""

    name: str
    license: str
    hub_id: str | None = None
    revision: str | None = None
    model_type: str | None = None
    note: str | None = None  # why the licence or the origin is not known
    licence_files: tuple[str, ...] = ()  # of LICENCE_FILES, those the base model directory has
    directory: Path | None = field(default=None, compare=False)  # where they are (not shown: a path of this site)


@dataclass(frozen=True)
class DataSource:
    source: str
    weight: float | None = None
    token_share: float | None = None

    @property
    def hub_id(self) -> str | None:
        """The Hub dataset of a `NAME[:CONFIG]` source (training.data.sources' rule); None for a local path."""
        if self.source.startswith(("/", "./", "../", "~")) or Path(self.source).suffix:
            return None
        name = self.source.partition(":")[0]
        return name if name and " " not in name else None


@dataclass(frozen=True)
class Data:
    kind: str | None
    sources: tuple[DataSource, ...]
    tokenizer_name: str | None = None
    tokenizer_sha256: str | None = None
    data_sha256: str | None = None
    counts: tuple[tuple[str, int], ...] = ()  # documents, tokens, blocks... as the manifest has them


@dataclass(frozen=True)
class TaskResult:
    task: str
    metric: str
    trained: float | None
    base: float | None
    delta_points: float | None
    limit: int | None


@dataclass(frozen=True)
class Evaluation:
    tasks: tuple[TaskResult, ...]
    max_drop: float | None
    passed: bool | None
    failures: tuple[str, ...]


@dataclass(frozen=True)
class Sample:
    prompt: str
    greedy: str
    top_k: str


@dataclass(frozen=True)
class Samples:
    top_k: int | None
    samples: tuple[Sample, ...]


@dataclass(frozen=True)
class CardInputs:
    """Everything the card says; a section's input is None when its stage has not run, or a string saying why
    it could not be read."""

    run_id: str
    recipe_name: str | None
    base: BaseModel
    recipe_yaml: str | None = None
    overrides: tuple[str, ...] = ()
    data: Data | str | None = None
    pins: software.Pins | None = None
    packages: tuple[tuple[str, str], ...] = ()
    plot: bool = False
    evaluation: Evaluation | str | None = None
    samples: Samples | str | None = None
    tags: tuple[str, ...] = field(default=("trainium", "neuronx-distributed"))


# --- reading the run -------------------------------------------------------------------------------------------


def read_inputs(run_dir: Path, *, plot: bool) -> CardInputs:
    """The card's inputs from a run directory (and the base model directory its recipe names)."""
    run = _json_object(run_dir / "run.json")
    run = run if isinstance(run, dict) else {}
    recipe_yaml = _text(run_dir / "recipe.yaml")
    recipe = _recipe(run_dir / "recipe.yaml") if recipe_yaml else None
    data_path = recipe.data.path if recipe else None  # the run's data/ when its prepare stage made it
    overrides = run.get("overrides")
    return CardInputs(
        run_id=str(run.get("run_id") or run_dir.name),
        recipe_name=_str(run.get("recipe")) or (recipe.name if recipe else None),
        base=read_base_model(Path(recipe.model.config) if recipe else None),
        recipe_yaml=recipe_yaml,
        overrides=tuple(str(o) for o in overrides) if isinstance(overrides, list) else (),
        data=_parsed((Path(data_path) if data_path else run_dir / "data") / outputs.MANIFEST, data_from_manifest),
        pins=software.running_pins(backend=recipe.backend if recipe else "neuron"),
        packages=software.package_versions(),
        plot=plot,
        evaluation=_parsed(run_dir / "evaluation.json", evaluation_from_json),
        samples=_parsed(run_dir / "samples.json", samples_from_json),
    )


def read_base_model(directory: Path | None) -> BaseModel:
    """From the fetch stage's record if there is one, else from the directory's own files."""
    if directory is None:
        return BaseModel(name="not recorded", license=UNKNOWN_LICENSE, note=_unknown_note("the run records no model"))
    config = _json_object(directory / "config.json")
    model_type = _str(config.get("model_type")) if isinstance(config, dict) else None
    licence_files = tuple(name for name in LICENCE_FILES if (directory / name).is_file())
    fetched = _json_object(directory / FETCH_MANIFEST)
    if isinstance(fetched, str):
        log.warning(f"model card: {directory}/{fetched} (the base model is then named by its own files)")
    if isinstance(fetched, dict) and _str(fetched.get("repo_id")):
        repo_id = str(fetched["repo_id"])
        license_id = _str(fetched.get("license"))
        return BaseModel(
            name=repo_id,
            hub_id=repo_id,
            revision=_str(fetched.get("revision")),
            license=license_id or UNKNOWN_LICENSE,
            model_type=model_type,
            note=None if license_id else _unknown_note(f"{FETCH_MANIFEST} records none"),
            licence_files=licence_files,
            directory=directory,
        )
    recorded = _str(config.get("_name_or_path")) if isinstance(config, dict) else None
    hub_id = recorded if recorded and HUB_ID.match(recorded) and not Path(recorded).exists() else None
    license_id = readme_license(directory / CARD)
    return BaseModel(
        name=hub_id or directory.name,
        hub_id=hub_id,
        license=license_id or UNKNOWN_LICENSE,
        model_type=model_type,
        note=(
            f"The base model directory `{directory.name}` has no `{FETCH_MANIFEST}`: its origin is taken from its "
            "own files." + ("" if license_id else " " + _unknown_note("its README.md names none"))
        ),
        licence_files=licence_files,
        directory=directory,
    )


def readme_license(readme: Path) -> str | None:
    """The `license:` of a model card's front matter, if it has one."""
    text = _text(readme)
    if text is None or not text.startswith("---"):
        return None
    header = text.split("\n---", 1)[0].removeprefix("---")
    value = _yaml_mapping(header).get("license")
    return value if isinstance(value, str) and value else None


def data_from_manifest(manifest: dict[str, Any]) -> Data:
    """The prepare manifest (training.data.pretrain, training.data.sft): one `source`, or a mix's `sources`."""
    mix = manifest.get("sources")
    if isinstance(mix, list) and mix:
        sources = tuple(
            DataSource(str(s.get("source")), _float(s.get("weight")), _float(s.get("token_share")))
            for s in mix
            if isinstance(s, dict)
        )
    else:
        sources = (DataSource(str(manifest.get("source", "not recorded"))),)
    tokenizer = _dict(manifest.get("tokenizer"))
    counts = tuple(
        (key, int(manifest[key]))
        for key in ("documents", "tokens", "blocks")
        if isinstance(manifest.get(key), int) and not isinstance(manifest.get(key), bool)
    )
    splits = manifest.get("splits")
    if isinstance(splits, dict):  # sft: per split
        for split, numbers in sorted(splits.items()):
            if isinstance(numbers, dict):
                counts += tuple(
                    (f"{split} {key}", int(numbers[key]))
                    for key in ("examples", "blocks", "trained_tokens")
                    if isinstance(numbers.get(key), int) and not isinstance(numbers.get(key), bool)
                )
    return Data(
        kind=_str(manifest.get("kind")),
        sources=sources,
        tokenizer_name=_str(tokenizer.get("name")),
        tokenizer_sha256=_str(tokenizer.get("sha256")),
        data_sha256=_str(manifest.get("data_sha256")),
        counts=counts,
    )


def evaluation_from_json(report: dict[str, Any]) -> Evaluation:
    """The evaluation stage's `evaluation.json`: `tasks` by name, then the `gate`."""
    tasks = _dict(report.get("tasks"))
    gate = _dict(report.get("gate"))
    failures = _list(gate.get("failures"))
    return Evaluation(
        tasks=tuple(
            TaskResult(
                task=str(name),
                metric=str(result.get("metric", "")),
                trained=_float(result.get("trained")),
                base=_float(result.get("base")),
                delta_points=_float(result.get("delta_points")),
                limit=result.get("limit") if isinstance(result.get("limit"), int) else None,
            )
            for name, result in tasks.items()  # in the order the evaluation stage wrote them
            if isinstance(result, dict)
        ),
        max_drop=_float(gate.get("max_drop")),
        passed=gate.get("passed") if isinstance(gate.get("passed"), bool) else None,
        failures=tuple(str(f) for f in failures),
    )


def samples_from_json(record: dict[str, Any]) -> Samples:
    """The sample stage's `samples.json` (training.pipeline.sample)."""
    samples = _list(record.get("samples"))
    return Samples(
        top_k=record.get("top_k") if isinstance(record.get("top_k"), int) else None,
        samples=tuple(
            Sample(str(s.get("prompt", "")), str(s.get("greedy", "")), str(s.get("top_k", "")))
            for s in samples
            if isinstance(s, dict)
        ),
    )


def _parsed(path: Path, parse: Any) -> Any:
    """parse(the JSON object in `path`); None when the file is missing, a one-line reason when it is damaged."""
    found = _json_object(path)
    if found is None:
        return None
    if isinstance(found, str):
        log.warning(f"model card: {found}")
        return found
    return parse(found)


def _json_object(path: Path) -> dict[str, Any] | str | None:
    """The object in a JSON file; None when missing, a reason when unreadable or not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"{path.name}: {error.__class__.__name__}: {error}"
    return value if isinstance(value, dict) else f"{path.name}: not a JSON object"


def _text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _yaml_mapping(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return {}
    return value if isinstance(value, dict) else {}


def _recipe(path: Path) -> Recipe | None:
    """The run's recipe, typed; a card is still written (naming less) when it no longer loads."""
    try:
        return load_recipe(str(path))
    except UserError as error:
        log.warning(f"model card: {path} does not load ({error}); the card names no recipe or base model")
        return None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _unknown_note(why: str) -> str:
    return (
        f"The base model's licence is not recorded ({why}), so the card says `{UNKNOWN_LICENSE}`: find the licence "
        "of the base model before sharing this model; it applies to this model too."
    )
