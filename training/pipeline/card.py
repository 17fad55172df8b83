"""The model card: `hf/README.md`, what a reader of the exported model (or of its Hub repository) needs to
know where it came from.

The Hub's model-card format: YAML front matter (licence, base model, datasets, tags, evaluation results as
`model-index`), made by huggingface_hub's `ModelCardData`, then Markdown: the base model and its licence (its
licence files, such as Llama's LICENSE and USE_POLICY.md, copied beside the card), the
data with the SHA-256 of the prepared data and of the tokenizer, the recipe and the overrides it was submitted
with, the software, the loss plot (copied into `hf/` so the card renders after a push of `hf/` alone), the
evaluation against the base model with the gate's verdict, and the samples.

Export writes it (training.pipeline.export), just before fingerprinting the files it copies. The text is a
pure function of the run's files (no clock, no host), and a file is rewritten only when its bytes change, so a
rerun of export from the same run still reuses its output, while a changed input changes the card and so the
export's fingerprint. Any input may be missing (a stage that has not run, a base model fetched by hand): its
section says so. A damaged one is reported in its section too, with a warning: the card never stops an export.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from training import outputs, software

log = logging.getLogger(__name__)
CARD = "README.md"
PLOT = "metrics.png"
FETCH_MANIFEST = "fetch-manifest.json"  # written into the base model directory by the fetch stage
UNKNOWN_LICENSE = "unknown"  # the Hub's identifier for a licence nobody recorded
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# The files in which a base model's repository states its licence and its terms of use; copied beside the card,
# as licences such as Llama 3.1's ask of a redistribution.
LICENCE_FILES = ("LICENSE", "LICENSE.txt", "LICENSE.md", "LICENCE", "NOTICE", "USE_POLICY.md")
KIND_TAGS = {"pretrain": "continued-pretraining", "sft": "supervised-fine-tuning"}
KIND_WORDS = {"pretrain": "continued pretraining", "sft": "supervised chat fine-tuning"}


# --- inputs ----------------------------------------------------------------------------------------------------


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


# --- the text --------------------------------------------------------------------------------------------------


def card_text(inputs: CardInputs) -> str:
    """The whole README.md: front matter, then one section per input."""
    kind = inputs.data.kind if isinstance(inputs.data, Data) else None
    sections = [
        _title(inputs, kind),
        _base_section(inputs.base),
        _data_section(inputs.data),
        _recipe_section(inputs),
        _software_section(inputs.pins, inputs.packages),
        _plot_section(inputs.plot),
        _evaluation_section(inputs.evaluation),
        _samples_section(inputs.samples),
    ]
    return f"---\n{front_matter(inputs)}\n---\n\n" + "\n\n".join(s.strip("\n") for s in sections) + "\n"


def front_matter(inputs: CardInputs) -> str:
    """The YAML header the Hub reads, as huggingface_hub writes it (0.36 and later take the same arguments)."""
    from huggingface_hub import EvalResult, ModelCardData

    kind = inputs.data.kind if isinstance(inputs.data, Data) else None
    tags = [*inputs.tags, *([KIND_TAGS[kind]] if kind in KIND_TAGS else [])]
    if inputs.base.model_type:
        tags.append(inputs.base.model_type)
    datasets = sorted({s.hub_id for s in inputs.data.sources if s.hub_id}) if isinstance(inputs.data, Data) else []
    results = []
    if isinstance(inputs.evaluation, Evaluation):
        for task in inputs.evaluation.tasks:
            if task.trained is not None:
                results.append(
                    EvalResult(
                        task_type="text-generation",
                        dataset_type=task.task,
                        dataset_name=task.task,
                        metric_type=task.metric,
                        metric_value=task.trained,
                    )
                )
    data = ModelCardData(
        license=inputs.base.license,
        base_model=inputs.base.hub_id,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=tags,
        datasets=datasets or None,
        model_name=inputs.run_id if results else None,
        eval_results=results or None,
    )
    return str(data.to_yaml())


def _title(inputs: CardInputs, kind: str | None) -> str:
    what = KIND_WORDS.get(kind or "", "training")
    recipe = f" with the recipe `{inputs.recipe_name}`" if inputs.recipe_name else ""
    return (
        f"# {inputs.run_id}\n\n"
        f"{what[0].upper()}{what[1:]} of {_base_words(inputs.base)} on AWS Trainium{recipe} "
        f"(run `{inputs.run_id}`). The licence of the base model applies to this model: **{inputs.base.license}**."
    )


def _base_words(base: BaseModel) -> str:
    return f"[{base.hub_id}](https://huggingface.co/{base.hub_id})" if base.hub_id else f"`{base.name}`"


def _base_section(base: BaseModel) -> str:
    rows = [("Model", _base_words(base))]
    if base.revision:
        rows.append(("Revision", f"`{base.revision}`"))
    if base.model_type:
        rows.append(("Architecture", f"`{base.model_type}`"))
    rows.append(("Licence", f"`{base.license}`"))
    note = f"\n\n{base.note}" if base.note else ""
    if base.licence_files:
        links = ", ".join(f"[{name}]({name})" for name in base.licence_files)
        note += f"\n\nThe base model's licence files, copied beside this card: {links}. Read them before sharing."
    return "## Base model\n\n" + _table(("", ""), rows) + note


def _data_section(data: Data | str | None) -> str:
    if data is None:
        return "## Training data\n\nNot run: the run's data has no `manifest.json` (`prepare` did not make it)."
    if isinstance(data, str):
        return f"## Training data\n\nNot available: {data}"
    weighted = any(s.weight is not None or s.token_share is not None for s in data.sources)
    if weighted:
        sources = _table(
            ("Source", "Weight", "Share of tokens"),
            [(_code(s.source), _number(s.weight), _number(s.token_share)) for s in data.sources],
        )
    else:
        sources = _table(("Source",), [(_code(s.source),) for s in data.sources])
    rows = []
    if data.kind:
        rows.append(("Kind", f"`{data.kind}`"))
    if data.tokenizer_name:
        rows.append(("Tokenizer", _code(data.tokenizer_name)))
    rows.append(("Tokenizer SHA-256", _code(data.tokenizer_sha256) if data.tokenizer_sha256 else "not recorded"))
    rows.append(("Prepared data SHA-256", _code(data.data_sha256) if data.data_sha256 else "not recorded"))
    rows.extend((name.replace("_", " ").capitalize(), f"{value:,}") for name, value in data.counts)
    return "## Training data\n\n" + sources + "\n\n" + _table(("", ""), rows)


def _recipe_section(inputs: CardInputs) -> str:
    overrides = "\n".join(f"- `{o}`" for o in inputs.overrides) if inputs.overrides else "None."
    settings = (
        f"The settings it ran with (`recipe.yaml`):\n\n{_fenced(inputs.recipe_yaml, 'yaml')}"
        if inputs.recipe_yaml is not None
        else "The run has no `recipe.yaml`."
    )
    name = f"`{inputs.recipe_name}`" if inputs.recipe_name else "not recorded"
    return f"## Recipe\n\nRecipe: {name}. Overrides given to `submit`:\n\n{overrides}\n\n{settings}"


def _software_section(pins: software.Pins | None, packages: tuple[tuple[str, str], ...]) -> str:
    rows = []
    if pins is not None:
        rows.append(("Neuron SDK release", f"`{pins.neuron_release}`" if pins.neuron_release else "not recorded"))
        rows.append(("Cluster lock SHA-256", _code(pins.lock_sha256) if pins.lock_sha256 else "not recorded"))
    rows.extend((_code(name), f"`{version}`") for name, version in packages)
    if not rows:
        return "## Software\n\nNot recorded."
    origin = f" The Neuron release and the lock digest are those of {pins.origin}." if pins else ""
    where = (
        "\n\nThe packages are those of the Python environment that exported the run (in the pipeline the site's "
        f"interpreter, which ran its training too).{origin}"
    )
    return "## Software\n\n" + _table(("", "Version"), rows) + where


def _plot_section(plot: bool) -> str:
    if not plot:
        return "## Training loss\n\nNot run: the run logged no metrics that could be drawn."
    return f"## Training loss\n\n![Training loss, learning rate and throughput by step]({PLOT})"


def _evaluation_section(evaluation: Evaluation | str | None) -> str:
    if evaluation is None:
        return "## Evaluation\n\nNot run: the run has no `evaluation.json`."
    if isinstance(evaluation, str):
        return f"## Evaluation\n\nNot available: {evaluation}"
    table = _table(
        ("Task", "Metric", "Base", "Trained", "Change (points)", "Examples"),
        [
            (
                _code(t.task),
                _code(t.metric),
                _number(t.base),
                _number(t.trained),
                _number(t.delta_points, signed=True),
                "all" if t.limit is None else str(t.limit),
            )
            for t in evaluation.tasks
        ],
    )
    if evaluation.passed is None:
        verdict = "The gate's verdict is not recorded."
    else:
        allowed = evaluation.max_drop
        limit = f" (largest drop allowed: {_number(allowed)} points)" if allowed is not None else ""
        verdict = f"Gate{limit}: **{'passed' if evaluation.passed else 'failed'}**."
        if evaluation.failures:
            verdict += "\n\n" + "\n".join(f"- {_inline(f)}" for f in evaluation.failures)
    return f"## Evaluation\n\nThe trained model against the base model:\n\n{table}\n\n{verdict}"


def _samples_section(samples: Samples | str | None) -> str:
    if samples is None:
        return "## Samples\n\nNot run: the run has no `samples.json`."
    if isinstance(samples, str):
        return f"## Samples\n\nNot available: {samples}"
    if not samples.samples:
        return "## Samples\n\nNone: the recipe has no prompts."
    top_k = f"top-{samples.top_k} sampling" if samples.top_k else "top-k sampling"
    parts = [f"## Samples\n\nContinuations of the recipe's prompts by the trained model, greedy and with {top_k}."]
    for number, sample in enumerate(samples.samples, start=1):
        parts.append(
            f"### Prompt {number}\n\n{_fenced(sample.prompt)}\n\nGreedy:\n\n{_fenced(sample.greedy)}\n\n"
            f"{top_k[0].upper()}{top_k[1:]}:\n\n{_fenced(sample.top_k)}"
        )
    return "\n\n".join(parts)


def _table(header: tuple[str, ...], rows: Iterable[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines.extend("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows)
    return "\n".join(lines)


def _code(text: str) -> str:
    """Inline code that survives any backticks in `text` (CommonMark: a longer run of backticks delimits)."""
    text = " ".join(text.splitlines())
    ticks = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    padded = f" {text} " if text.startswith("`") or text.endswith("`") else text
    return f"{ticks}{padded}{ticks}"


def _inline(text: str) -> str:
    return _code(text) if any(c in text for c in "*_`<>[]|#") else " ".join(text.splitlines())


def _fenced(text: str, language: str = "text") -> str:
    """A fenced code block longer than any run of backticks in `text`, so model output cannot end it."""
    fence = "`" * max(3, max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    return f"{fence}{language}\n{text.rstrip(chr(10))}\n{fence}"


def _number(value: float | None, *, signed: bool = False) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int):
        return f"{value:+d}" if signed else str(value)
    return f"{value:+.4g}" if signed else f"{value:.4g}"


# --- reading the run -------------------------------------------------------------------------------------------


def read_inputs(run_dir: Path, *, plot: bool) -> CardInputs:
    """The card's inputs from a run directory (and the base model directory its recipe names)."""
    run = _json_object(run_dir / "run.json")
    run = run if isinstance(run, dict) else {}
    recipe_yaml = _text(run_dir / "recipe.yaml")
    settings = _yaml_mapping(recipe_yaml)
    model_config = _setting(settings, "model", "config")
    data_path = _setting(settings, "data", "path")  # the run's data/ when its prepare stage made it
    overrides = run.get("overrides")
    return CardInputs(
        run_id=str(run.get("run_id") or run_dir.name),
        recipe_name=_str(run.get("recipe")) or _str(settings.get("name")),
        base=read_base_model(Path(model_config) if isinstance(model_config, str) else None),
        recipe_yaml=recipe_yaml,
        overrides=tuple(str(o) for o in overrides) if isinstance(overrides, list) else (),
        data=_parsed((Path(data_path) if data_path else run_dir / "data") / outputs.MANIFEST, data_from_manifest),
        pins=software.running_pins(),
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


def write_card(run_dir: Path, *, plot: bool) -> Path | None:
    """`hf/README.md` (and beside it `metrics.png` and the base model's licence files), each rewritten only when it
    changes; None when the run
    has no exported model yet. OSError (a read-only run directory) is the caller's to report."""
    model = run_dir / "hf"
    if not model.is_dir():
        return None
    drawn = run_dir / PLOT
    copied = model / PLOT
    if plot and drawn.is_file():
        _write_if_changed(copied, drawn.read_bytes())
    else:
        plot = False
        copied.unlink(missing_ok=True)  # never a stale picture the card no longer shows
    inputs = read_inputs(run_dir, plot=plot)
    for name in inputs.base.licence_files:
        assert inputs.base.directory is not None  # read from there
        _write_if_changed(model / name, (inputs.base.directory / name).read_bytes())
    card = model / CARD
    _write_if_changed(card, card_text(inputs).encode())
    return card


def _write_if_changed(path: Path, content: bytes) -> None:
    """Same bytes: untouched, so its modification time, part of export's fingerprint, stays."""
    try:
        if path.read_bytes() == content:
            return
    except OSError:
        pass
    outputs.write_file(path, content, kill_at="card-before-rename")  # export's kill tests stop at its own renames


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


def _setting(settings: dict[str, Any], section: str, key: str) -> str | None:
    values = settings.get(section)
    return _str(values.get(key)) if isinstance(values, dict) else None


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
