"""The exported plot of a run's metrics (training.pipeline.plot) and what `export` does with it and with the
TensorBoard event files: real PNGs read back, duplicated steps of a resumed run, bad files in one line."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib import colors
from matplotlib.image import imread

from training.errors import UserError
from training.pipeline.export import export
from training.pipeline.plot import DPI, HEIGHT, WIDTH, plot_metrics

ROOT = Path(__file__).resolve().parents[3]
SIZE = (round(HEIGHT * DPI), round(WIDTH * DPI))
BLUE, ORANGE, GREEN, RED, PURPLE = "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"


def record(step: int, loss: float, **extra: Any) -> dict[str, Any]:
    return {
        "step": step,
        "loss": loss,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "seq_per_second": 2.0 + step % 3,
        "tokens_per_second": 128.0 * (2 + step % 3),
        "time": 1_700_000_000.0 + 2 * step,
        "mfu": 0.3 + 0.01 * (step % 3),
        **extra,
    }


def write_records(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def pixels_of(png: Path, color: str) -> int:
    """How many pixels have exactly this colour (the lines are drawn in the named colours)."""
    image = imread(png)
    wanted = np.array(colors.to_rgba(color))
    return int(np.all(np.abs(image - wanted) < 1 / 255, axis=-1).sum())


def run_records() -> list[dict[str, Any]]:
    records = [record(step, 5.0 - 0.1 * step) for step in range(1, 21)]
    for r in records:
        if r["step"] % 5 == 0:
            r["validation_loss"] = r["loss"] + 0.2
    return records


def test_the_plot_shows_loss_validation_throughput_and_mfu(tmp_path: Path) -> None:
    metrics = write_records(tmp_path / "run-7" / "checkpoints" / "metrics.jsonl", run_records())
    png = plot_metrics(metrics, tmp_path / "out" / "metrics.png")
    image = imread(png)
    assert image.shape[:2] == SIZE
    assert float(np.mean(np.all(image[..., :3] > 0.99, axis=-1))) < 0.97  # not a blank canvas
    for color in (BLUE, ORANGE, GREEN, RED):  # loss, validation points, tokens/s, MFU
        assert pixels_of(png, color) > 50, color
    assert pixels_of(png, PURPLE) == 0  # no MoE panel without MoE values
    assert sorted(p.name for p in png.parent.iterdir()) == ["metrics.png"]  # no temporary sibling left


def test_moe_drops_get_a_panel_of_their_own(tmp_path: Path) -> None:
    records = [record(step, 3.0, moe_dropped=0.01 * step) for step in range(1, 6)]
    png = plot_metrics(write_records(tmp_path / "metrics.jsonl", records), tmp_path / "metrics.png", run_id="moe")
    assert imread(png).shape[:2] == SIZE and pixels_of(png, PURPLE) > 50


def test_a_resumed_run_is_drawn_with_the_last_value_of_each_step(tmp_path: Path) -> None:
    """Steps 11-15 logged twice (killed after 15, resumed from the checkpoint of step 10): the picture is the
    one of the file holding only the resumed attempt's values for them."""
    records = run_records()
    first_attempt = [record(step, 9.0) for step in range(11, 16)]
    duplicated = records[:10] + first_attempt + records[10:]
    with_duplicates = plot_metrics(
        write_records(tmp_path / "a" / "metrics.jsonl", duplicated), tmp_path / "a.png", run_id="r"
    )
    last_values = plot_metrics(write_records(tmp_path / "b" / "metrics.jsonl", records), tmp_path / "b.png", run_id="r")
    first_values = plot_metrics(
        write_records(tmp_path / "c" / "metrics.jsonl", records[:10] + first_attempt + records[15:]),
        tmp_path / "c.png",
        run_id="r",
    )
    assert with_duplicates.read_bytes() == last_values.read_bytes() != first_values.read_bytes()


def test_an_unchanged_picture_keeps_its_file(tmp_path: Path) -> None:
    metrics = write_records(tmp_path / "metrics.jsonl", run_records())
    png = plot_metrics(metrics, tmp_path / "metrics.png", run_id="r")
    os.utime(png, ns=(1_000_000_000, 1_000_000_000))
    plot_metrics(metrics, png, run_id="r")
    assert png.stat().st_mtime_ns == 1_000_000_000  # export's fingerprint stays the same
    write_records(metrics, run_records()[:-1])
    plot_metrics(metrics, png, run_id="r")
    assert png.stat().st_mtime_ns != 1_000_000_000


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "no metrics in it"),
        ("\n\n", "no metrics in it"),
        ('{"step": 1, "loss": 2.0}\nnot json\n{"step": 2, "loss": 1.0}\n', "line 2: not JSON"),
        ('{"step": 1, "loss": 2.0}\n[1, 2]\n', "line 2: a list; allowed: one JSON object a line"),
        ('{"step": 1}\n', "line 1: loss None; allowed: a number"),
        ('{"step": "one", "loss": 2.0}\n', "line 1: step 'one'; allowed: a number"),
    ],
    ids=["empty", "blank-lines", "not-json", "not-an-object", "no-loss", "text-step"],
)
def test_bad_metrics_give_one_line_naming_the_file(content: str, message: str, tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(content)
    with pytest.raises(UserError) as raised:
        plot_metrics(metrics, tmp_path / "out" / "metrics.png")
    text = str(raised.value)
    assert "\n" not in text and text.startswith(str(metrics)) and message in text, text
    assert not (tmp_path / "out").exists()


def test_a_line_still_being_written_is_left_out(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps(record(1, 2.0)) + "\n" + '{"step": 2, "lo')
    png = plot_metrics(metrics, tmp_path / "metrics.png", run_id="r")
    assert imread(png).shape[:2] == SIZE


def test_no_display_is_ever_opened(tmp_path: Path) -> None:
    """With a GUI backend asked for and no display, the plot is still drawn (Agg, no pyplot)."""
    metrics = write_records(tmp_path / "metrics.jsonl", run_records())
    code = (
        "import sys\nfrom pathlib import Path\nfrom training.pipeline.plot import plot_metrics\n"
        f"plot_metrics(Path({str(metrics)!r}), Path({str(tmp_path / 'metrics.png')!r}))\n"
        "assert 'matplotlib.pyplot' not in sys.modules\n"
    )
    environment = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**environment, "MPLBACKEND": "TkAgg"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert imread(tmp_path / "metrics.png").shape[:2] == SIZE


# --- export -----------------------------------------------------------------------------------------------


def finished_run(run_dir: Path, metrics: str) -> Path:
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "metrics.jsonl").write_text(metrics)
    (run_dir / "tensorboard").mkdir()
    (run_dir / "tensorboard" / "events.out.tfevents.1.host.1.0").write_bytes(b"\x00events")
    (run_dir / "run.json").write_text(json.dumps({"run_id": run_dir.name}) + "\n")
    return run_dir


def test_an_export_holds_the_plot_and_the_event_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = finished_run(tmp_path / "run-1", "".join(json.dumps(r) + "\n" for r in run_records()))
    export(run_dir, str(tmp_path / "results"))
    manifest = json.loads((tmp_path / "results" / "manifest.json").read_text())
    assert {"metrics.png", "tensorboard/events.out.tfevents.1.host.1.0", "checkpoints/metrics.jsonl"} <= set(
        manifest["files"]
    )
    exported = tmp_path / "results" / "metrics.png"
    assert exported.read_bytes() == (run_dir / "metrics.png").read_bytes()
    assert imread(exported).shape[:2] == SIZE and pixels_of(exported, BLUE) > 50
    redrawn = plot_metrics(run_dir / "checkpoints" / "metrics.jsonl", tmp_path / "again.png", run_id="run-1")
    assert redrawn.read_bytes() == exported.read_bytes()
    capsys.readouterr()
    export(run_dir, str(tmp_path / "results"))  # the same run again: the plot is unchanged, the export reused
    assert json.loads(capsys.readouterr().out)["reused"] is True


def test_a_run_without_drawable_metrics_is_exported_without_a_plot(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = finished_run(tmp_path / "run-2", "")
    (run_dir / "metrics.png").write_bytes(b"a stale picture")
    with caplog.at_level(logging.WARNING, logger="training"):
        export(run_dir, str(tmp_path / "results"))
    manifest = json.loads((tmp_path / "results" / "manifest.json").read_text())
    assert "metrics.png" not in manifest["files"] and not (tmp_path / "results" / "metrics.png").exists()
    assert "tensorboard/events.out.tfevents.1.host.1.0" in manifest["files"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "exporting without metrics.png" in warnings[0] and "no metrics" in warnings[0]
