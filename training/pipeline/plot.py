"""A run's training curves as one PNG (`metrics.png` in every export): loss, throughput, MoE drops over steps.

Drawn with matplotlib's Agg canvas on a `Figure` of its own (no pyplot, so never a display or a GUI backend,
and nothing global). Made from the JSON lines the training job writes, the last record of each step (a
resumed run logs the steps after its checkpoint again): training loss with the validation loss as points;
tokens/s with MFU (percent of the workers' peak) on a second axis; the fraction of MoE expert choices dropped
when the run logged it. The file is replaced in one rename, as every output here.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from training import outputs
from training.train.metrics import read_metrics

WIDTH, HEIGHT, DPI = 10.0, 7.0, 100  # inches and dots per inch: 1000 x 700 pixels


def plot_metrics(metrics_jsonl: Path, png: Path, *, run_id: str | None = None) -> Path:
    """Draw `metrics_jsonl` into `png`; the title names `run_id` (default: the run directory's name, the
    parent of the `checkpoints` folder the file is in). A UserError for a missing, empty or malformed file.
    A file that already holds the same picture is left as it is."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    records = read_metrics(metrics_jsonl)
    if run_id is None:
        run_dir = metrics_jsonl.absolute().parent
        run_id = (run_dir.parent if run_dir.name == "checkpoints" else run_dir).name
    steps = [int(r["step"]) for r in records]
    moe = [r for r in records if r.get("moe_dropped") is not None]
    figure = Figure(figsize=(WIDTH, HEIGHT), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(3 if moe else 2, 1, sharex=True, squeeze=False)[:, 0]
    figure.suptitle(f"{run_id}: {len(records)} steps logged, last step {steps[-1]}")

    loss_axis = axes[0]
    loss_axis.plot(steps, [float(r["loss"]) for r in records], label="training loss", color="tab:blue")
    validation = [r for r in records if r.get("validation_loss") is not None]
    if validation:
        loss_axis.plot(
            [r["step"] for r in validation],
            [float(r["validation_loss"]) for r in validation],
            "o",
            label="validation loss",
            color="tab:orange",
        )
    loss_axis.set_ylabel("loss")
    loss_axis.legend(loc="upper right")
    loss_axis.grid(alpha=0.3)

    throughput_axis = axes[1]
    throughput = _series(records, "tokens_per_second")
    throughput_axis.plot(*throughput, color="tab:green", label="tokens/s")
    throughput_axis.set_ylabel("tokens/s")
    throughput_axis.grid(alpha=0.3)
    if not throughput[0]:
        throughput_axis.text(0.5, 0.5, "no throughput logged", ha="center", transform=throughput_axis.transAxes)
    mfu_steps, mfu = _series(records, "mfu")
    if mfu_steps:
        mfu_axis = throughput_axis.twinx()
        mfu_axis.plot(mfu_steps, [100 * v for v in mfu], color="tab:red", linestyle="--", label="MFU")
        mfu_axis.set_ylabel("MFU (% of peak)")
        lines = throughput_axis.get_lines() + mfu_axis.get_lines()
        throughput_axis.legend(lines, [line.get_label() for line in lines], loc="lower right")

    if moe:
        moe_axis = axes[2]
        moe_axis.plot([r["step"] for r in moe], [100 * float(r["moe_dropped"]) for r in moe], color="tab:purple")
        moe_axis.set_ylabel("MoE dropped (%)")
        moe_axis.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")  # the same records give the same bytes (PNG has no time stamp)
    data = buffer.getvalue()
    if not png.is_file() or png.read_bytes() != data:  # unchanged, the file keeps its mtime (export's fingerprint)
        outputs.write_file(png, data, kill_at="plot-before-rename")  # export's kill tests stop at its own renames
    return png


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    present = [r for r in records if r.get(key) is not None]
    return [int(r["step"]) for r in present], [float(r[key]) for r in present]
