"""The preflight stage's decisions (training/pipeline/preflight.py): nccom-test's report read into a bus
bandwidth, the floors per instance type, the checkpoint's write time against its interval, and the one line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from training.config.hardware import HARDWARE
from training.config.recipe import load_recipe
from training.errors import UserError
from training.pipeline import preflight, preflight_checks
from training.pipeline.plan import STAGES, Stage
from training.pipeline.submit import stages_to_submit
from training.train.memory import model_config

STANDIN = Path(__file__).resolve().parents[3] / "tests" / "support" / "neuron_tools" / "nccom-test"

# nccom-test's JSON report as the Neuron guide shows it (`--report-to-json-file`, an all-gather sweep)
GUIDE_REPORT = {
    "results": [
        {"size(B)": 1024, "count(elems)": 256, "type": "fp32", "algbw(GB/s)": 0.1655, "busbw(GB/s)": 0.1604},
        {"size(B)": 524288, "count(elems)": 131072, "type": "fp32", "algbw(GB/s)": 22.69, "busbw(GB/s)": 21.98},
        {"size(B)": 65536, "count(elems)": 16384, "type": "fp32", "algbw(GB/s)": 8.009, "busbw(GB/s)": 7.759},
    ]
}


def test_the_bus_bandwidth_is_the_largest_sizes_not_the_sweeps_average() -> None:
    assert preflight_checks.bus_bandwidth(json.dumps(GUIDE_REPORT)) == 21.98
    with pytest.raises(UserError, match="nccom-test report without results"):
        preflight_checks.bus_bandwidth('{"results": []}')
    with pytest.raises(UserError, match="without results"):
        preflight_checks.bus_bandwidth("Failure running neuron-bench")


def test_the_standin_writes_the_real_tools_report_format(tmp_path: Path) -> None:
    """What the local-Slurm test's stand-in reports is read by the same parser as the real tool's."""
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "neuron0").touch()
    report = tmp_path / "report.json"
    command = [str(STANDIN), "-r", "32", "-N", "1", "-b", "1GB", "-e", "1GB", "-d", "fp32", "--non-interactive"]
    command += ["--report-to-json-file", str(report), "allr"]
    environment = {"PATH": "/usr/bin:/bin", "DEVICE_ROOT": str(tmp_path), "SLURM_NODEID": "1"}
    done = subprocess.run(
        command, env={**environment, "NCCOM_TEST_STANDIN_BUSBW": "1:7.25"}, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert preflight_checks.bus_bandwidth(report.read_text()) == 7.25
    assert done.stdout.splitlines()[0].split() == [
        "size(B)",
        "count(elems)",
        "type",
        "time:avg(us)",
        "algbw(GB/s)",
        "busbw(GB/s)",
    ]
    assert done.stdout.splitlines()[-1] == "Avg bus bandwidth:\t7.2500GB/s"
    (tmp_path / "dev" / "neuron0").unlink()
    missing = subprocess.run(command, env=environment, capture_output=True, text=True, check=False)
    assert missing.returncode == 1 and "Neuron DKMS Driver is not running!" in missing.stdout


def test_floors_are_a_stated_fraction_of_the_published_figures() -> None:
    # 800 Gbps = 93.1 GiB/s of EFA on trn1.32xlarge, twice that on trn1n; a quarter of it
    assert preflight_checks.efa_floor(HARDWARE["trn1.32xlarge"]) == 23.3
    assert preflight_checks.efa_floor(HARDWARE["trn1n.32xlarge"]) == 46.6
    assert preflight_checks.efa_floor(HARDWARE["trn1.2xlarge"]) is None  # no EFA: a single node, nothing across nodes
    assert preflight_checks.intra_node_floor() == 21.1  # 40 % of the guide's 52.83 GiB/s single-instance all-reduce


def test_a_slow_all_reduce_is_one_line_naming_the_node_the_number_and_the_floor() -> None:
    hardware = HARDWARE["trn1.32xlarge"]
    problem = preflight_checks.bandwidth_problem(12.04, 23.3, "all-reduce across 2 nodes", hardware)
    assert preflight_checks.failure_line("compute1-st-trn1-2", problem or "") == (
        "preflight: node compute1-st-trn1-2: all-reduce across 2 nodes bus bandwidth 12.0 GB/s below the floor "
        "23.3 GB/s of trn1.32xlarge"
    )
    assert preflight_checks.bandwidth_problem(23.3, 23.3, "all-reduce", hardware) is None


def test_missing_devices_are_named_in_the_prologs_words() -> None:
    assert preflight_checks.device_problem(15, 16, 7, 8) == "15 of 16 Neuron devices, 7 of 8 EFA devices"
    assert preflight_checks.device_problem(16, 16, 0, 8) == "0 of 8 EFA devices"
    assert preflight_checks.device_problem(16, 16, 8, 8) is None
    assert preflight_checks.device_problem(1, 1, 0, 0) is None  # trn1.2xlarge: no EFA expected


def test_device_counts_read_the_same_tree_as_the_prolog(tmp_path: Path) -> None:
    for index in range(3):
        (tmp_path / "dev").mkdir(exist_ok=True)
        (tmp_path / "dev" / f"neuron{index}").touch()
    (tmp_path / "dev" / "neuron-other").touch()  # not a device: neuron[0-9]* only
    (tmp_path / "sys" / "class" / "infiniband" / "rdmap16s27").mkdir(parents=True)
    assert preflight.count_devices(str(tmp_path)) == (3, 1)


def test_the_checkpoint_must_be_written_within_a_tenth_of_its_interval() -> None:
    # 10 steps of 60 s between checkpoints: 60 s allowed; 32 GB at 400 MB/s take 80 s
    interval = preflight_checks.checkpoint_interval(10, 60.0)
    assert interval == 600.0
    assert preflight_checks.write_problem(400e6, 32 * 10**9, interval) == (
        "shared storage writes 400 MB/s: its 32.0 GB of a checkpoint take 80 s, more than 10% of the 600 s between "
        "checkpoints"
    )
    assert preflight_checks.write_problem(600e6, 32 * 10**9, interval) is None  # 53 s
    # no forecast (the CPU backend) or checkpoints only at the end: measured, not judged
    assert (
        preflight_checks.checkpoint_interval(10, None) is None and preflight_checks.checkpoint_interval(0, 60.0) is None
    )
    assert preflight_checks.write_problem(1.0, 32 * 10**9, None) is None


def test_a_nodes_checkpoint_share_is_its_ranks_weights_and_optimizer_state() -> None:
    """Llama 3.1 8B at TP 32 on 4 x trn1.32xlarge (DP 4, ZeRO-1, bf16-mixed): per rank about 8.0e9 / 32
    parameters at 2 bytes of weights and 16 / 4 of optimizer state: about 1.5 GB, 32 ranks a node."""
    recipe = load_recipe("llama31-8b-cpt")
    config = model_config(recipe)
    per_node = preflight_checks.checkpoint_bytes_per_node(recipe, config, HARDWARE["trn1.32xlarge"], 32)
    assert per_node is not None and 40e9 < per_node < 56e9


def test_a_node_without_a_result_fails_and_the_first_problem_of_each_is_named() -> None:
    results = {"a": {"problems": []}, "b": {"problems": ["15 of 16 Neuron devices", "later"]}}
    assert preflight_checks.failed_nodes(["a", "b", "c"], results) == {
        "b": "15 of 16 Neuron devices",
        "c": "no result (the node's check did not finish; see the job's log)",
    }


def test_the_preflight_runs_again_whenever_training_does() -> None:
    """A resubmitted training job may get other nodes: its preflight runs again even when it passed before."""
    stages = [stage for stage in STAGES if stage.name in ("compile", "preflight", "train", "convert-out")]
    names = [s.name for s in stages_to_submit(stages, {"compile", "preflight"})]
    assert names == ["preflight", "train", "convert-out"]
    assert [s.name for s in stages_to_submit(stages, {"compile", "preflight", "train"})] == ["convert-out"]
    assert next(s for s in STAGES if s.name == "train") == Stage("train", ("compile", "preflight"), distributed=True)
    # a training job still queued keeps the nodes its preflight pinned: nothing to check again
    assert [s.name for s in stages_to_submit(stages, {"compile", "preflight"}, {"train"})] == ["train", "convert-out"]


def slurm_standin(directory: Path, script: str) -> Path:
    """A `scontrol` that answers as written (the Slurm client's side of a refusal), recording its arguments."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> "{directory}/calls"\n{script}\n')
    (directory / "scontrol").chmod(0o755)
    return directory


def test_a_node_is_drained_by_a_slurm_operator_else_with_sudo_else_the_line_says_how(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ParallelCluster's cluster user is no Slurm operator: scontrol refuses, `sudo -n` may do it; without
    either the result says so and how to drain it."""
    from training.config.site import Site

    refusing = slurm_standin(tmp_path / "slurm", 'echo "slurm_update error: Access/permission denied" >&2; exit 1')
    site = Site(slurm_bin=str(refusing))
    monkeypatch.setenv("PATH", "/nonexistent")  # no sudo
    assert preflight.drain(site, "trn-st-1", "preflight: node trn-st-1: 15 of 16 Neuron devices") == (
        "not drained: slurm_update error: Access/permission denied (drain it as an operator: scontrol update "
        "NodeName=trn-st-1 State=DRAIN Reason=preflight: node trn-st-1: 15 of 16 Neuron devices)"
    )
    sudo = tmp_path / "sudo-bin"
    sudo.mkdir()
    (sudo / "sudo").write_text(f'#!/bin/bash\necho "sudo $*" >> "{refusing}/calls"\n')
    (sudo / "sudo").chmod(0o755)
    monkeypatch.setenv("PATH", str(sudo))
    assert preflight.drain(site, "trn-st-1", "preflight: node trn-st-1: 15 of 16 Neuron devices") == "drained (sudo)"
    calls = (refusing / "calls").read_text().splitlines()
    assert calls[-2:] == [
        "update NodeName=trn-st-1 State=DRAIN Reason=preflight: node trn-st-1: 15 of 16 Neuron devices",
        f"sudo -n {refusing}/scontrol update NodeName=trn-st-1 State=DRAIN Reason=preflight: node trn-st-1: 15 of 16 "
        "Neuron devices",
    ]


def test_the_status_note_is_the_failure_else_the_nodes_that_passed(tmp_path: Path) -> None:
    result = tmp_path / "preflight.json"
    result.write_text(json.dumps({"nodelist": "node[1-2]", "failure": None}))
    assert preflight.note(result) == "passed on node[1-2]"
    line = "preflight: node node2: 15 of 16 Neuron devices"
    result.write_text(json.dumps({"nodelist": "node[1-2]", "failure": line}))
    assert preflight.note(result) == line
    result.write_text("[]")
    assert preflight.note(result) == f"{result}: not a preflight result"


def test_a_site_may_skip_the_preflight_and_training_then_waits_for_compile(tmp_path: Path) -> None:
    from training.config.site import Site
    from training.pipeline.plan import plan_run
    from training.pipeline.submit import dependency_option

    recipe = load_recipe("tiny-llama-cpt")
    jobs = {"compile": "11", "preflight": "12"}
    checked = plan_run(recipe, Site(runs_root=str(tmp_path)), "run")
    train = next(stage for stage in checked.stages if stage.name == "train")
    assert [s.name for s in checked.stages].index("preflight") == [s.name for s in checked.stages].index("train") - 1
    assert dependency_option(train, jobs) == "--dependency=afterok:11:12"
    skipped = plan_run(recipe, Site(runs_root=str(tmp_path), preflight=False), "run")
    assert "preflight" not in [s.name for s in skipped.stages]
    unchecked = next(stage for stage in skipped.stages if stage.name == "train")
    assert dependency_option(unchecked, {"compile": "11"}) == "--dependency=afterok:11"  # no preflight job: compile


# --- the canary: the compiled graphs' device memory -------------------------------------------------------

MONITOR_STANDIN = STANDIN.parent / "neuron-monitor"


def monitor_report(core_bytes: dict[str, list[int]], *, error: str = "") -> str:
    """One neuron-monitor report line (the Neuron Monitor User Guide's format): per Neuron application (one a
    rank) its NeuronCore's memory by category."""
    runtimes = []
    for pid, (core, parts) in enumerate(core_bytes.items()):
        categories = dict(zip(("constants", "model_code", "runtime_memory", "tensors"), parts, strict=False))
        used = {"neuron_device": sum(parts), "usage_breakdown": {"neuroncore_memory_usage": {core: categories}}}
        runtimes.append(
            {
                "pid": 1000 + pid,
                "error": "",
                "report": {"memory_used": {"neuron_runtime_used_bytes": used, "error": error}},
            }
        )
    return json.dumps({"neuron_runtime_data": runtimes, "instance_info": {"instance_id": "i-0011223344556677a"}})


def test_the_peak_is_the_fullest_neuroncore_over_the_canarys_reports() -> None:
    gib = 2**30
    lines = [
        json.dumps({"neuron_runtime_data": []}),  # before the ranks load anything: no figure, not a 0
        monitor_report({"0": [2 * gib, gib], "1": [2 * gib, 3 * gib]}),
        "not a report",
        monitor_report({"0": [2 * gib, 6 * gib], "1": [2 * gib, 3 * gib]}),
        monitor_report({"0": [gib]}, error="runtime gone"),  # unreadable memory: skipped, not a smaller figure
    ]
    assert preflight_checks.peak_core_bytes(lines) == (8 * gib, 2)
    assert preflight_checks.peak_core_bytes([json.dumps({"neuron_runtime_data": []}), "garbage"]) == (None, 0)


def test_memory_above_the_plan_by_more_than_its_headroom_or_above_the_hbm_fails_in_one_line() -> None:
    hardware = HARDWARE["trn1.32xlarge"]
    assert preflight_checks.MEMORY_TOLERANCE == 0.10  # the headroom submit demands of the plan
    over = preflight_checks.memory_problem(15.2 * 2**30, 12.1, hardware)
    assert preflight_checks.failure_line("trn-st-2", over or "") == (
        "preflight: node trn-st-2: the compiled graphs hold 15.2 GiB on a NeuronCore, above the plan's 12.1 GiB "
        "(+10% allowed)"
    )
    assert preflight_checks.memory_problem(13.3 * 2**30, 12.1, hardware) is None  # within 10 % of the plan
    assert preflight_checks.memory_problem(9.0 * 2**30, 12.1, hardware) is None  # under the plan
    assert preflight_checks.memory_problem(16.4 * 2**30, 15.0, hardware) == (
        "the compiled graphs hold 16.4 GiB on a NeuronCore, more than its 16 GiB of HBM on trn1.32xlarge"
    )
    assert (
        preflight_checks.memory_problem(16.4 * 2**30, None, hardware) is not None
    )  # no plan (unknown model): HBM only
    assert preflight_checks.memory_problem(14.0 * 2**30, None, hardware) is None
    # no report with memory: the graphs ran, which is all that is known; not judged
    assert preflight_checks.memory_problem(None, 12.1, hardware) is None


def test_a_canary_that_did_not_run_is_one_line_naming_the_nodes_and_the_log() -> None:
    log = "/fsx/runs/r/logs/preflight-12.out"
    passed = {"a": {"status": 0}, "b": {"status": 0}}
    assert preflight_checks.canary_problem(["a", "b"], passed, 0, log) is None
    assert preflight_checks.canary_problem(["a", "b"], {"a": {"status": 0}, "b": {"status": 1}}, 1, log) == (
        f"the compiled graphs did not run: b exited with status 1 (see {log})"
    )
    assert preflight_checks.canary_problem(["a", "b"], {"a": {"status": 0}}, 137, log) == (
        f"the compiled graphs did not run: b left no result (see {log})"
    )
    assert preflight_checks.canary_problem(["a"], {"a": {"status": 0}}, 1, log) == (
        f"the compiled graphs did not run: the canary's srun exited with status 1 (see {log})"
    )


def test_the_canary_watch_records_the_monitors_peak_and_the_commands_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node's wrapper around the canary's torchrun: the neuron-monitor stand-in (the real tool's report
    format, its config checked) samples every second while the command runs; the command's status is returned
    and recorded with the node's peak."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "neuron-monitor").symlink_to(MONITOR_STANDIN)
    monkeypatch.setenv("PATH", f"{tools}:/usr/bin:/bin")
    monkeypatch.setenv("SLURMD_NODENAME", "trn-st-1")
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("NEURON_MONITOR_STANDIN_CORE_GIB", "0:3.0,1:12.5")
    status = preflight.watch_canary(tmp_path, ["/bin/bash", "-c", "sleep 2.5; exit 3"])
    assert status == 3
    result = json.loads((tmp_path / "preflight" / "canary" / "trn-st-1.json").read_text())
    assert result["status"] == 3 and result["memory_reports"] >= 2 and "monitor_error" not in result
    assert abs(result["peak_core_bytes"] - 12.5 * 2**30) < 2
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "neuron-monitor").write_text("#!/bin/bash\necho 'cannot open the driver' >&2\nexit 1\n")
    (broken / "neuron-monitor").chmod(0o755)
    monkeypatch.setenv("PATH", f"{broken}:/usr/bin:/bin")  # a monitor that gives up: said so, memory not read
    assert preflight.watch_canary(tmp_path, ["/bin/bash", "-c", "sleep 1"]) == 0
    result = json.loads((tmp_path / "preflight" / "canary" / "trn-st-1.json").read_text())
    assert result["peak_core_bytes"] is None and result["monitor_error"] == "neuron-monitor exited with status 1 early"
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no neuron-monitor: the command still runs, memory not read
    assert preflight.watch_canary(tmp_path, ["/bin/true"]) == 0
    result = json.loads((tmp_path / "preflight" / "canary" / "trn-st-1.json").read_text())
    assert result["peak_core_bytes"] is None and "neuron-monitor: not found" in result["monitor_error"]


def test_a_wrapped_command_goes_with_canary_or_watch_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from training.cli import main

    assert main(["preflight", "--run-dir", str(tmp_path), "--canary"]) == 2
    assert main(["preflight", "--run-dir", str(tmp_path), "--", "/bin/true"]) == 2
    assert capsys.readouterr().err.count("a COMMAND after `--` goes with --canary or --watch, and only with them") == 2
    assert not (tmp_path / "preflight").exists()


def test_an_earlier_preflights_node_file_is_no_result_of_this_job(tmp_path: Path) -> None:
    (tmp_path / "node1.json").write_text(json.dumps({"node": "node1", "job": "41", "problems": []}))
    (tmp_path / "node2.json").write_text(json.dumps({"node": "node2", "job": "42", "problems": []}))
    results = preflight.this_jobs_results(tmp_path, ["node1", "node2", "node3"], "42")
    assert list(results) == ["node2"]
    failed = preflight_checks.failed_nodes(["node1", "node2", "node3"], results)
    assert sorted(failed) == ["node1", "node3"] and failed["node1"].startswith("no result")
