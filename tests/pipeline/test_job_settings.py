"""The settings a job gets from its recipe and from the site's instance type, as the rendered job scripts carry
them and as the compute nodes are prepared for them.

- Per recipe (its `neuron` section): NEURON_CC_FLAGS, NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS and
  `neuron_parallel_compile --retry_failed_compilation`, NxD's Llama values for Llama and NxD's Mixtral run's for
  Mixtral.
- Per instance type: one process per NeuronCore, the instance's vCPUs as --cpus-per-task (ParallelCluster's own
  reading of the EC2 records says how many CPUs the Slurm node has).
- torchrun's port: outside Linux's ephemeral range, reserved by the compute nodes' bootstrap (the real script, run
  with a recording `sysctl`), one range for both.
- A site whose processes cannot run the recipe is refused at submit, in one line.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from pcluster.aws.aws_resources import InstanceTypeInfo

from tests.pipeline.test_templates import CLUSTER_RECIPES, default_site, rendered
from tests.support.pcluster_offline import INSTANCE_TYPES
from training.cli import main
from training.config.hardware import HARDWARE
from training.config.recipe import load_recipe
from training.config.site import Site
from training.errors import UserError
from training.pipeline.plan import plan_run, processes_per_node
from training.pipeline.scripts import RENDEZVOUS_PORTS, render
from training.pipeline.submit import submit

ROOT = Path(__file__).resolve().parents[2]
NODE_SCRIPT = ROOT / "assets" / "node" / "on_node_configured.sh"
# Linux's default net.ipv4.ip_local_port_range (Documentation/networking/ip-sysctl.rst): the ports the kernel
# hands to outgoing connections, one of which could hold torchrun's port when a job starts.
EPHEMERAL_PORTS = range(32768, 61000)
CPU_STAGES = ("prepare", "convert-in", "convert-out", "evaluate", "sample", "export")
RESERVED = "net.ipv4.ip_local_reserved_ports"
PORT_RANGE = f"{RENDEZVOUS_PORTS.start}-{RENDEZVOUS_PORTS.stop - 1}"

# NxD's Llama example (REFERENCE.md section 7) and NxD's Mixtral run (REFERENCE.md, "NxD's own runs").
# The generation's target and logical core size come first (trn1: LNC 1).
NEURON_SETTINGS = {
    "llama31-8b-cpt": ("--target=trn1 --lnc=1 --model-type=transformer --cache_dir=/fsx/neuron-cache", 3),
    "mixtral-8x7b-sft": (
        "--target=trn1 --lnc=1 --model-type=transformer --enable-saturate-infinity --cache_dir=/fsx/neuron-cache",
        7,
    ),
}


# --- per recipe ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", CLUSTER_RECIPES)
def test_every_cluster_job_carries_its_recipes_neuron_settings(recipe: str) -> None:
    flags, inflight = NEURON_SETTINGS[recipe]
    scripts = rendered(recipe, default_site())
    for stage, text in scripts.items():
        assert f"export NEURON_CC_FLAGS={shlex.quote(flags)}\n" in text, stage
        assert f"export NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS={inflight}\n" in text, stage
    neuron = "/fsx/envs/neuron-2.28.1/bin"
    assert (
        f"'{neuron}/neuron_parallel_compile --retry_failed_compilation {neuron}/python -m torch" in (scripts["compile"])
    )
    assert "neuron_parallel_compile --" not in scripts["train"] and "--retry_failed_compilation" not in scripts["train"]


def test_a_recipe_may_turn_the_compile_retry_off() -> None:
    recipe = load_recipe("mixtral-8x7b-sft", ["neuron.retry_failed_compilation=false"])
    compile_job = render(plan_run(recipe, default_site(), "RUN-ID"))["compile"]
    assert "/bin/neuron_parallel_compile /fsx/envs/neuron-2.28.1/bin/python -m torch" in compile_job
    assert "--retry_failed_compilation" not in compile_job


# --- per instance type --------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", CLUSTER_RECIPES)
def test_cluster_jobs_run_a_process_per_neuroncore_with_the_instances_vcpus(recipe: str) -> None:
    site = default_site().model_copy(update={"processes_per_node": None})  # the instance type alone decides
    assert site.instance_type == "trn1.32xlarge"
    scripts = rendered(recipe, site)
    assert scripts == rendered(recipe, default_site())  # the deployed site's explicit 32 says the same
    for stage in ("compile", "train"):
        text = scripts[stage]
        assert "--nproc_per_node 32 " in text and "nodes x 32 processes" in text
        assert "#SBATCH --cpus-per-task=128\n" in text
        assert "/opt/slurm/bin/srun --kill-on-bad-exit=1 --cpus-per-task=128 bash -c " in text
    for stage in CPU_STAGES:  # one task on a CPU node: no Trainium vCPU count there
        assert "--cpus-per-task" not in scripts[stage]


def test_processes_per_node_follow_the_instance_type_else_the_recipe() -> None:
    llama = load_recipe("llama31-8b-cpt")
    assert processes_per_node(llama, Site(instance_type="trn1.32xlarge")) == 32
    assert processes_per_node(llama, Site(instance_type="trn1n.32xlarge")) == 32
    assert processes_per_node(llama, Site(instance_type="trn1.2xlarge")) == 2
    assert processes_per_node(llama, Site(instance_type="trn1.32xlarge", processes_per_node=16)) == 16
    # No instance type (the local demo): TP x PP spread over the nodes, else one TP group a node.
    assert processes_per_node(llama, Site()) == 8
    assert processes_per_node(load_recipe("tiny-mixtral-sft"), Site()) == 1
    assert processes_per_node(load_recipe("tiny-llama-cpt", ["nodes=3"]), Site()) == 2


def test_the_vcpus_per_task_are_the_cpus_parallelcluster_gives_the_slurm_node() -> None:
    for instance_type, hardware in HARDWARE.items():
        info = InstanceTypeInfo(copy.deepcopy(INSTANCE_TYPES[instance_type]))
        assert info.vcpus_count() == hardware.vcpus, instance_type
        (devices,) = INSTANCE_TYPES[instance_type]["NeuronInfo"]["NeuronDevices"]
        assert (hardware.neuron_devices, hardware.chip.physical_cores) == (
            devices["Count"],
            devices["CoreInfo"]["Count"],
        )
        assert hardware.chip.hbm_gib * 1024 == devices["MemoryInfo"]["SizeInMiB"], instance_type
        # one process per logical NeuronCore: LNC physical cores each (trn2's default 2)
        assert hardware.cores_per_node * hardware.logical_core_size == devices["Count"] * devices["CoreInfo"]["Count"]


def test_a_trn2_site_runs_each_recipes_trn2_settings_at_lnc_2() -> None:
    """environments/trn2.yaml's site: the recipes' trn2 sections (1 node, TP 16), a process per logical core (64),
    the runtime's and the compiler's logical core size and target, the converter's trn2 K/V layout."""
    site = default_site("trn2")
    assert site.instance_type == "trn2.48xlarge" and site.processes_per_node == 64 and site.backend == "neuron"
    for recipe, layout, precision in (
        ("llama31-8b-cpt", "--tp 16", "bf16-mixed"),
        ("mixtral-8x7b-sft", "--tp 16 --pp 4", "bf16-sr"),
    ):
        # as `submit` loads it there, on the NxD software environments/trn2.yaml installs (compute.backend neuron)
        overrides = ["backend=neuron", f"precision={precision}"]
        plan = plan_run(load_recipe(recipe, overrides, generation="trn2"), site, "RUN-ID")
        assert (plan.resolved.generation, plan.resolved.nodes) == ("trn2", 1)
        scripts = render(plan)
        for stage in ("compile", "train"):
            text = scripts[stage]
            assert "--nproc_per_node 64 " in text and "#SBATCH --cpus-per-task=192\n" in text, stage
            assert "export NEURON_LOGICAL_NC_CONFIG=2\n" in text, stage
            assert "export NEURON_CC_FLAGS='--target=trn2 --lnc=2 --model-type=transformer" in text, stage
        convert_in = " ".join(scripts["convert-in"].split())
        assert f"{layout} --kv-size-multiplier 2 --target trn2" in convert_in.replace(" \\ ", " "), convert_in
    trn1 = rendered("llama31-8b-cpt", default_site())["train"]
    assert "export NEURON_LOGICAL_NC_CONFIG=1\n" in trn1 and "NEURON_CC_FLAGS='--target=trn1 --lnc=1 " in trn1


def test_on_trn2_the_recipes_train_on_torch_native_without_neuron_parallel_compile() -> None:
    """The recipes' trn2 sections choose the torch-native backend: on a site with TorchNeuron's software the
    compile stage runs the two steps eagerly as a canary (neuron_parallel_compile is PyTorch/XLA's) and keeps no
    XLA compile cache, while the Neuron runtime's settings stay."""
    site = default_site("trn2").model_copy(update={"backend": "torch-native"})
    for recipe in CLUSTER_RECIPES:
        loaded = load_recipe(recipe, generation="trn2")
        assert loaded.backend == "torch-native"
        scripts = render(plan_run(loaded, site, "RUN-ID"))
        assert "bin/neuron_parallel_compile" not in scripts["compile"] and "compile-cache" not in scripts["compile"]
        assert "-m training train --recipe" in scripts["compile"] and " --compile" in scripts["compile"]
        assert "export NEURON_LOGICAL_NC_CONFIG=2\n" in scripts["train"]


def test_a_recipe_on_another_backend_than_the_sites_software_is_refused_at_submit() -> None:
    with pytest.raises(UserError) as refused:
        submit("llama31-8b-cpt", [], run_id="RUN-ID", site=default_site("trn2"), dry_run=True)
    assert str(refused.value) == (
        "backend: 'torch-native' is not allowed; allowed: neuron, the backend the site's nodes have software for "
        "(its recipes pick it by generation; a cluster for torch-native is an environment with compute.backend: "
        "torch-native)"
    )


def test_a_recipe_for_another_generation_than_the_sites_is_refused_at_submit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    site = default_site("trn2")
    with pytest.raises(UserError) as refused:
        submit("llama31-8b-cpt", ["generation=trn1"], run_id="RUN-ID", site=site, dry_run=True)
    assert str(refused.value) == (
        "generation: 'trn1' is not allowed; allowed: trn2, the generation of the site's trn2.48xlarge (or omit it: "
        "submit takes it from the site)"
    )


@pytest.mark.parametrize("recipe", ["tiny-llama-cpt", "tiny-mixtral-sft"])
def test_a_local_site_without_an_instance_type_keeps_its_launch(recipe: str, tmp_path: Path) -> None:
    loaded = load_recipe(recipe)
    scripts = render(plan_run(loaded, Site(runs_root=str(tmp_path / "runs")), "RUN-ID"))
    model_parallel = loaded.parallelism.tp * loaded.parallelism.pp
    for stage in ("compile", "train"):
        assert f"--nproc_per_node {model_parallel // loaded.nodes} " in scripts[stage]
    for text in scripts.values():
        assert "--cpus-per-task" not in text and "NEURON_" not in text


# --- the rendezvous port ------------------------------------------------------------------------------------


def master_port(job_script: str, job_id: int) -> int:
    """MASTER_PORT as the job script's own line computes it, run by bash."""
    line = next(line for line in job_script.splitlines() if line.startswith("MASTER_PORT="))
    result = subprocess.run(
        ["bash", "-c", f'{line}\necho "${{MASTER_PORT}}"'],
        env={"PATH": os.environ["PATH"], "SLURM_JOB_ID": str(job_id)},
        capture_output=True,
        text=True,
        check=True,
    )
    return int(result.stdout)


def test_the_rendezvous_port_is_below_the_ephemeral_range_and_differs_between_neighbouring_jobs() -> None:
    assert RENDEZVOUS_PORTS.start >= 1024 and RENDEZVOUS_PORTS.stop <= EPHEMERAL_PORTS.start  # unprivileged
    scripts = rendered("llama31-8b-cpt", default_site())
    for stage in ("compile", "train"):
        ports = [master_port(scripts[stage], job) for job in range(1000, 1000 + len(RENDEZVOUS_PORTS))]
        assert sorted(ports) == list(RENDEZVOUS_PORTS), stage  # neighbouring jobs never share a port
        assert master_port(scripts[stage], 2**31 - 1) in RENDEZVOUS_PORTS  # Slurm's largest job id
    assert f"one of {PORT_RANGE} by job id" in scripts["train"]


def reserve_ports(tmp_path: Path, current: str) -> tuple[str, list[list[str]], str]:
    """The bootstrap's reserve_rendezvous_ports, run for real with a `sysctl` that reports `current` as the
    reserved ports and records its other calls: the drop-in file written, the sysctl calls, and the script's
    RENDEZVOUS_PORTS."""
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    calls = tmp_path / "sysctl-calls.jsonl"
    calls.unlink(missing_ok=True)
    (stub / "sysctl").write_text(
        "#!/bin/bash\n"
        f'if [ "$1" = -n ]; then printf "%s\\n" "${{CURRENT}}"; exit 0; fi\n'
        f"python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\" >> {shlex.quote(str(calls))}\n"
    )
    (stub / "sysctl").chmod(0o755)
    sysctl_dir = tmp_path / "sysctl.d"
    result = subprocess.run(
        ["bash", "-c", 'source "$1"\nreserve_rendezvous_ports\necho "${RENDEZVOUS_PORTS}"', "bash", str(NODE_SCRIPT)],
        env={
            "PATH": f"{stub}:{os.environ['PATH']}",
            "HOME": str(tmp_path),
            "SYSCTL_DIR": str(sysctl_dir),
            "CURRENT": current,
        },
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    files = list(sysctl_dir.iterdir())
    assert [f.name for f in files] == ["90-trainium-rendezvous-ports.conf"]
    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    return files[0].read_text(), recorded, result.stdout.strip()


@pytest.mark.parametrize(
    ("current", "reserved"),
    [
        ("", PORT_RANGE),
        ("44000,48620", f"44000,48620,{PORT_RANGE}"),  # NxD's own launchers' reservation is kept
        (PORT_RANGE, PORT_RANGE),  # a second run adds nothing
    ],
)
def test_compute_nodes_reserve_the_ports_the_jobs_use(tmp_path: Path, current: str, reserved: str) -> None:
    drop_in, calls, script_range = reserve_ports(tmp_path, current)
    assert script_range == PORT_RANGE  # the bootstrap's range is the job scripts' range
    assert drop_in == f"{RESERVED} = {reserved}\n"  # applied again at every boot by systemd-sysctl
    assert calls == [["-q", "-w", f"{RESERVED}={reserved}"]]  # and now


def test_the_compute_bootstrap_reserves_the_ports_and_the_head_node_does_not(tmp_path: Path) -> None:
    os_release = tmp_path / "os-release"
    os_release.write_text('ID=ubuntu\nVERSION_ID="22.04"\nVERSION_CODENAME=jammy\n')
    arguments = ["--neuron-release", "2.28.1", "--shared-env", "/fsx/envs/neuron-2.28.1", "--dry-run"]
    outputs = {}
    for node_type in ("compute", "head"):
        result = subprocess.run(
            ["bash", str(NODE_SCRIPT), *arguments, "--node-type", node_type, "--skip-hosts-fix"],
            env={**os.environ, "OS_RELEASE_FILE": str(os_release), "HOME": str(tmp_path)},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        outputs[node_type] = result.stdout
    written = [line for line in outputs["compute"].splitlines() if "90-trainium-rendezvous-ports.conf" in line]
    assert len(written) == 1 and written[0].startswith("DRY-RUN: write /etc/sysctl.d/90-trainium-rendezvous-ports")
    assert written[0].endswith(PORT_RANGE)
    assert "DRY-RUN: sysctl -q -w net.ipv4.ip_local_reserved_ports=" in outputs["compute"]
    assert "ip_local_reserved_ports" not in outputs["head"]


# --- refused at submit --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "site", "problem"),
    [
        (
            "mixtral-8x7b-sft",
            {"instance_type": "trn1.32xlarge", "processes_per_node": 16},
            "parallelism.tp 32 x parallelism.pp 2 does not divide the 32 processes of 2 node(s) x 16 "
            "(site processes_per_node)",
        ),
        (
            "llama31-8b-cpt",
            {"instance_type": "trn1.2xlarge"},
            "parallelism.tp 32 x parallelism.pp 1 does not divide the 8 processes of 4 node(s) x 2 "
            "(site processes_per_node, by default)",
        ),
        (
            "llama31-8b-cpt",
            {"instance_type": "trn1.32xlarge", "processes_per_node": 64},
            "site processes_per_node 64 is more than the 32 NeuronCores of trn1.32xlarge (one process a "
            "NeuronCore); omit it to use all of them",
        ),
        (
            "llama31-8b-cpt",
            {"instance_type": "trn1.32xlarge", "processes_per_node": 24},
            "batch.global 1024 is not a multiple of batch.micro 1 x the 3 data-parallel ranks of 96 processes "
            "(= 3); change batch.global or batch.micro",
        ),
    ],
)
def test_a_site_whose_processes_cannot_run_the_recipe_is_refused_at_submit_in_one_line(
    recipe: str, site: dict[str, object], problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    site_file = tmp_path / "site.yaml"
    site_file.write_text(json.dumps({"runs_root": str(tmp_path / "runs"), "neuron": True, **site}))
    assert main(["submit", "--recipe", recipe, "--dry-run", "--run-id", "r", "--site", str(site_file)]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: {problem}\n" and captured.out == ""
    assert not (tmp_path / "runs").exists()


def test_a_bad_compiler_flag_is_refused_at_submit_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    site_file = tmp_path / "site.yaml"
    site_file.write_text(json.dumps({"runs_root": str(tmp_path / "runs"), "neuron": True}))
    command = ["submit", "--recipe", "mixtral-8x7b-sft", "--dry-run", "--site", str(site_file)]
    assert main([*command, "neuron.compiler_flags=[--enable-saturate-infinity, --cache_dir=/tmp/c]"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "mixtral-8x7b-sft.yaml: " in err
    assert "neuron.compiler_flags[1]: '--cache_dir=/tmp/c' is not allowed; allowed: one compiler flag" in err
