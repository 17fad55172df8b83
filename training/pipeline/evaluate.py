"""`python -m training evaluate`: the trained model against the base model on lm-evaluation-harness tasks.

Runs after convert-out, on the CPU queue: each task of the recipe's `evaluate` section on its first `limit`
documents, for the trained model and (with `base: true`) the base model, each loaded by the harness's own Hugging
Face model class (`HFLM`: as `lm_eval --model hf` runs it), with one metric per task compared in points
(hundredths of the metric: percentage points of an accuracy). The gate `max_drop` fails the stage when a task is
worse than the base by more than that; the results are written first, so export still copies them, and whoever
publishes to the Hub reads `evaluation.json` (`publish_blocker`) and refuses.

Written into the run directory, each in one rename: `evaluation.json` (the numbers, the gate, the
harness's version, the time taken) and `evaluation.md` (the table).
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training import outputs
from training.config.recipe import EvaluateSection, EvaluationTask
from training.errors import UserError

log = logging.getLogger(__name__)
EVALUATION_JSON = "evaluation.json"
EVALUATION_MD = "evaluation.md"
# Task YAML files shipped with the package (their documents beside them): no download, for the tiny recipes.
LOCAL_TASKS = Path(__file__).resolve().parent / "tasks"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
# What a forward pass and the Python process need beyond the weights (activations of a batch, the harness).
MEMORY_HEADROOM_BYTES = 8 * 2**30
# The CPU queue's nodes run the shared Neuron environment, which has torch-xla: accelerate (under lm-eval's HFLM)
# would import it and take an XLA device for the models. The evaluation is a CPU job; set before the harness is
# imported (accelerate, transformers and torch read it once, at import).
os.environ["USE_TORCH_XLA"] = "0"


@dataclass(frozen=True)
class TaskScore:
    """One task's chosen metric for one model."""

    metric: str
    value: float
    higher_is_better: bool


# --- pure parts -------------------------------------------------------------------------------------------


def pick_score(task: EvaluationTask, results: Mapping[str, Any]) -> TaskScore:
    """The task's metric from `simple_evaluate`'s results: the recipe's `metric`, else the task's first one
    (lm-eval keys them `metric,filter`, e.g. `acc,none`)."""
    reported = results["results"].get(task.name, {})
    values = {
        key.partition(",")[0]: value
        for key, value in reported.items()
        if "," in key and "_stderr" not in key and isinstance(value, int | float) and not isinstance(value, bool)
    }
    if not values:
        raise UserError(f"evaluate task {task.name}: the harness reported no metric")
    metric = task.metric or next(iter(values))
    if metric not in values:
        raise UserError(f"evaluate.tasks {task.name} metric: {metric!r} is not reported; allowed: {', '.join(values)}")
    direction = results.get("higher_is_better", {}).get(task.name, {}).get(metric)
    return TaskScore(metric, float(values[metric]), direction is not False)


def delta_points(trained: float, base: float) -> float:
    """trained - base in points (hundredths of the metric), rounded to what a table shows."""
    return round(100.0 * (trained - base), 4)


def gate(
    tasks: tuple[EvaluationTask, ...], rows: Mapping[str, Mapping[str, Any]], max_drop: float | None
) -> dict[str, Any]:
    """`{max_drop, passed, failures}`: each failure one line naming the task, the drop and the limit."""
    failures = []
    if max_drop is not None:
        for task in tasks:
            row = rows[task.name]
            if row["delta_points"] is None:
                continue
            drop = -row["delta_points"] if row["higher_is_better"] else row["delta_points"]
            if drop > max_drop:
                failures.append(
                    f"{task.name}: {row['metric']} {drop:.2f} points worse than the base "
                    f"({100 * row['base']:.2f} -> {100 * row['trained']:.2f}) on {task.limit} documents "
                    f"(limit), more than max_drop {max_drop:g}"
                )
    return {"max_drop": max_drop, "passed": not failures, "failures": failures}


def task_rows(
    tasks: tuple[EvaluationTask, ...], trained: Mapping[str, TaskScore], base: Mapping[str, TaskScore] | None
) -> dict[str, dict[str, Any]]:
    rows = {}
    for task in tasks:
        mine = trained[task.name]
        theirs = base[task.name] if base is not None else None
        rows[task.name] = {
            "metric": mine.metric,
            "trained": mine.value,
            "base": theirs.value if theirs else None,
            "delta_points": delta_points(mine.value, theirs.value) if theirs else None,
            "limit": task.limit,
            "higher_is_better": mine.higher_is_better,
        }
    return rows


def markdown_table(report: Mapping[str, Any]) -> str:
    """The report as a Markdown table (values in points), then the gate's verdict."""

    def points(value: float | None) -> str:
        return "" if value is None else f"{100 * value:.2f}"

    lines = [
        "| task | metric | base | trained | difference |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for name, row in report["tasks"].items():
        difference = "" if row["delta_points"] is None else f"{row['delta_points']:+.2f}"
        lines.append(f"| {name} | {row['metric']} | {points(row['base'])} | {points(row['trained'])} | {difference} |")
    verdict = report["gate"]
    limits = ", ".join(f"{name} {row['limit']}" for name, row in report["tasks"].items())
    lines += ["", f"Points: hundredths of each metric (percentage points of an accuracy); documents: {limits}."]
    if verdict["max_drop"] is None:
        lines.append("Gate: none.")
    elif verdict["passed"]:
        lines.append(f"Gate passed: no task worse than the base by more than {verdict['max_drop']:g} points.")
    else:
        lines.append("Gate failed:")
        lines += [f"- {failure}" for failure in verdict["failures"]]
    return "\n".join(lines) + "\n"


def weight_bytes(model_directory: Path, dtype: str) -> int:
    """Bytes of the model's weights in `dtype`, counted from the safetensors headers (nothing loaded)."""
    elements = 0
    for path in sorted(model_directory.glob("*.safetensors")):
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                elements += math.prod(entry["shape"])
    return elements * DTYPE_BYTES[dtype]


def memory_refusal(model_directory: Path, dtype: str, node_bytes: int, option: str) -> str | None:
    """One line when the model in `dtype` cannot fit this node's memory; None when it can."""
    needed = weight_bytes(model_directory, dtype) + MEMORY_HEADROOM_BYTES
    if needed <= node_bytes:
        return None
    return (
        f"{option} {model_directory}: needs {needed / 2**30:.0f} GiB in {dtype} (weights + "
        f"{MEMORY_HEADROOM_BYTES // 2**30} GiB), the node has {node_bytes / 2**30:.0f} GiB; allowed: a node with more "
        "memory (cpu_queue.instance_type), or evaluate.dtype bfloat16"
    )


def node_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_model_directory(directory: Path, option: str) -> None:
    if not (directory / "config.json").is_file():
        raise UserError(f"{option} {directory}: not a Hugging Face model directory (no config.json)")
    if not any(directory.glob("*.safetensors")):
        raise UserError(f"{option} {directory}: no *.safetensors weights (a model directory of `convert --to hf`)")


# --- the harness ------------------------------------------------------------------------------------------


def task_manager(settings: EvaluateSection) -> Any:
    """lm-eval's task index over the package's local tasks and the recipe's `include` directories; its
    built-in tasks (a scan of some seconds) only when a task is not found there. Unknown names: one line."""
    from lm_eval.tasks import TaskManager  # type: ignore[import-untyped]

    directories = [str(LOCAL_TASKS), *settings.include]
    for directory in settings.include:
        if not Path(directory).is_dir():
            raise UserError(f"evaluate.include {directory}: not a directory of task YAML files")
    names = [task.name for task in settings.tasks]
    manager = TaskManager(include_path=directories, include_defaults=False)
    if all(name in manager.all_tasks for name in names):
        return manager
    manager = TaskManager(include_path=directories)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        import lm_eval  # type: ignore[import-untyped]

        raise UserError(
            f"evaluate.tasks: {', '.join(map(repr, unknown))} not known; allowed: a task of lm-eval "
            f"{lm_eval.__version__} (`lm_eval ls tasks`), or one in {', '.join(directories)}"
        )
    return manager


def load_model(model_directory: Path, settings: EvaluateSection) -> Any:
    """The model as lm-eval's `HFLM`. A tokenizer without a chat template (Mixtral's base model) gets the format
    `prepare sft` renders chats in, when the recipe asks for chat prompts. The path is absolute so that HFLM's
    look-up of the model's Hub revision (for its report) never takes a directory for a repository id."""
    import transformers
    from lm_eval.models.huggingface import HFLM  # type: ignore[import-untyped]

    tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(model_directory))
    if settings.apply_chat_template and not tokenizer.chat_template:
        from training.data.chat import MIXTRAL_FALLBACK_TEMPLATE

        tokenizer.chat_template = MIXTRAL_FALLBACK_TEMPLATE
    return HFLM(
        pretrained=str(model_directory.resolve()),
        tokenizer=tokenizer,
        dtype=settings.dtype,
        device=settings.device,
        batch_size=settings.batch_size,
        trust_remote_code=False,
    )


def evaluate_model(model_directory: Path, settings: EvaluateSection, manager: Any) -> dict[str, TaskScore]:
    """Every task on one model, loaded once; each task with its own limit and few-shot count."""
    import lm_eval

    model = load_model(model_directory, settings)
    scores = {}
    try:
        for task in settings.tasks:
            started = time.monotonic()
            results = lm_eval.simple_evaluate(
                model=model,
                tasks=[task.name],
                num_fewshot=task.num_fewshot,
                limit=task.limit,
                task_manager=manager,
                apply_chat_template=settings.apply_chat_template,
                log_samples=False,
                bootstrap_iters=0,
            )
            if results is None:  # only a non-zero rank of a distributed harness gets none; this is one process
                raise RuntimeError("lm-eval returned no results")
            scores[task.name] = pick_score(task, results)
            log.info(
                f"{model_directory}: {task.name} {scores[task.name].metric} {scores[task.name].value:.4f} "
                f"({task.limit} documents, {time.monotonic() - started:.1f}s)"
            )
    finally:
        del model
        gc.collect()
    return scores


def evaluate(
    settings: EvaluateSection, trained: Path, base: Path | None, output: Path, *, node_bytes: int | None = None
) -> dict[str, Any]:
    """Evaluate, write `evaluation.json` and `evaluation.md` into `output`, return the report (the gate's
    verdict in `report["gate"]`; the caller decides the exit status)."""
    import lm_eval

    started = time.monotonic()
    check_model_directory(trained, "--input")
    if base is not None:
        check_model_directory(base, "--base")
    memory = node_bytes if node_bytes is not None else node_memory_bytes()
    for directory, option in ((trained, "--input"), (base, "--base")):
        if directory is not None and (problem := memory_refusal(directory, settings.dtype, memory, option)):
            raise UserError(problem)
    if settings.max_drop is not None and base is None:
        raise UserError(f"evaluate.max_drop {settings.max_drop:g} needs a base model: pass --base DIR")
    manager = task_manager(settings)
    trained_scores = evaluate_model(trained, settings, manager)
    base_scores = evaluate_model(base, settings, manager) if base is not None else None
    rows = task_rows(settings.tasks, trained_scores, base_scores)
    report = {
        "tasks": rows,
        "gate": gate(settings.tasks, rows, settings.max_drop),
        "lm_eval_version": lm_eval.__version__,
        "elapsed_seconds": round(time.monotonic() - started, 3),
        "trained_model": str(trained),
        "base_model": str(base) if base is not None else None,
    }
    output.mkdir(parents=True, exist_ok=True)
    outputs.write_file(output / EVALUATION_MD, markdown_table(report))
    outputs.write_file(output / EVALUATION_JSON, json.dumps(report, indent=2) + "\n")  # last: marks it complete
    log.info(f"evaluation written to {output / EVALUATION_JSON} in {report['elapsed_seconds']:.1f}s")
    return report


def local_documents(file: str, **_: Any) -> Any:
    """lm-eval `custom_dataset` of the package's local tasks: a JSON lines file beside the task YAML files,
    as the task's `test` split (read from disk, never downloaded)."""
    import datasets

    path = LOCAL_TASKS / file
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(records)})


def publish_blocker(run_dir: Path, evaluated: bool) -> str | None:
    """Why the run's model must not be published (one line), or None: its gate failed, or the recipe has an
    evaluate stage that wrote no complete `evaluation.json`."""
    path = run_dir / EVALUATION_JSON
    if not path.is_file():
        return f"{path}: no evaluation (the evaluate stage did not finish)" if evaluated else None
    try:
        verdict = json.loads(path.read_text())["gate"]
        passed, failures = bool(verdict["passed"]), list(verdict["failures"])
    except (ValueError, KeyError, TypeError):
        return f"{path}: not an evaluation report"
    return None if passed else f"evaluation gate failed: {'; '.join(failures)}"
