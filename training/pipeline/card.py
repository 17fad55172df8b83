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
The inputs are read by training.pipeline.card_inputs; this module writes the text and the files beside it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from training import outputs, software
from training.pipeline.card_inputs import CARD, BaseModel, CardInputs, Data, Evaluation, Samples, read_inputs

PLOT = "metrics.png"
KIND_TAGS = {"pretrain": "continued-pretraining", "sft": "supervised-fine-tuning"}
KIND_WORDS = {"pretrain": "continued pretraining", "sft": "supervised chat fine-tuning"}


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
