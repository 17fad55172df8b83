"""`make test-neuron`: the neuron test tier, in its own environment with the cluster's locked requirement set.

The environment (torch 2.9.1 and torch-xla 2.9.0 from PyPI, several GB) is built once per lock file content
under the cache directory and reused; neuronx-distributed's source is unpacked there from the archive
NXD_SOURCE names (default: the vendored v2.28.0 archive beside this checkout). Then pytest runs, in that
environment, the tier's own tests and the training tests whose outcome depends on the package versions (so
the package is tested with the cluster's versions too), on torch-xla's CPU device, with only the Neuron binaries
replaced by `tests/neuron/standins`.

Which training tests are rerun (VERSIONED): the lock and the main environment differ in torch (2.9.1 / 2.13),
transformers (4.57 / 5.23), tokenizers, datasets, numpy, pyarrow and protobuf, and pin pydantic, PyYAML, Jinja2,
boto3, safetensors, matplotlib, lm-eval, mlflow, wandb and tensorboard alike. So the folders whose code runs on the
cluster over torch, transformers, tokenizers or datasets are rerun whole: the formats (torch pickles, transformers
checkpoints), the model (transformers as the reference, autograd), the data preparation (tokenizers, datasets,
pyarrow), the refusal of planted pickles (torch's unpickler) and the evaluation (lm-eval over transformers). Of the
training job only the tests not marked `slow` are rerun (the loader, the precision regimes): the slow ones run the
training job with torchrun on the CPU backend, which the cluster never runs (it trains on the neuron backend, and
this tier's own tests train that one, and the CPU backend beside it as their reference, under the lock's versions).
The configuration, monitoring, Slurm pipeline rendering, CLI, logging and bad-input suites test our code over
libraries pinned alike: the main suite's run is their verdict. The folders' reruns use two xdist workers (their
tests use no local Slurm), the training job's few quick tests one process (a second worker would cost more to
start than they take); the tier's own tests run in one process (one XLA runtime). The three pytest runs go side by
side, each one's output printed whole when it ends.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "assets" / "node" / "cluster-requirements.txt"
STANDINS = Path(__file__).resolve().parent / "standins"
DEFAULT_NXD_SOURCE = ROOT.parent / "shared" / "vendor" / "neuronx-distributed-2.28.0.tar.gz"
CACHE = Path(os.environ.get("NEURON_TIER_CACHE", Path.home() / ".cache" / "trainium-training"))
# pytest, and moto's standalone server (moto, flask, flask-cors) for the S3 export tests; pinned as in
# pyproject.toml's dev extra, constrained by the lock.
TEST_TOOLS = ("pytest==9.2.0", "pytest-xdist==3.8.0", "moto==5.2.5", "flask==3.1.3", "flask-cors==6.0.5")
# The training tests whose outcome depends on the package versions (the docstring says why these).
VERSIONED = (
    "tests/training/formats",
    "tests/training/model",
    "tests/training/data",
    "tests/training/properties/test_untrusted_files.py",
    "tests/training/pipeline/test_evaluate.py",
)
VERSIONED_UNLESS_SLOW = ("tests/training/train",)
# One pytest process each: the training tests check that reading xser files never imports torch_xla, which the
# neuron tests have imported by then.
RUNS = (("tests/neuron",), ("-n", "2", *VERSIONED), ("-m", "not slow", *VERSIONED_UNLESS_SLOW))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def environment(cache: Path = CACHE) -> Path:
    """The tier's virtual environment for the current lock (built on first use; a half-built one is redone)."""
    target = cache / f"neuron-venv-{digest(LOCK)}"
    python = target / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    if not (target / ".complete").exists():
        print(f"neuron tier: building {target} from {LOCK.relative_to(ROOT)} (several GB, once)", flush=True)
        venv.EnvBuilder(clear=True, with_pip=True).create(target)
        # The lock as it is (no resolution); then the test tools below.
        subprocess.run([*pip, "--no-deps", "-r", str(LOCK)], check=True)
        (target / ".complete").touch()
    # The test tools constrained by the lock, on every run (nothing to do once they are there, and a cached
    # environment gets tools added since), then pip's own check that the installed set is consistent.
    subprocess.run([*pip, "-c", str(LOCK), *TEST_TOOLS], check=True)
    subprocess.run([str(python), "-m", "pip", "check"], check=True)
    # The project itself, without dependencies: the lock is the whole environment.
    subprocess.run([*pip, "--no-deps", "--no-build-isolation", "-e", str(ROOT)], check=True)
    return target


def neuronx_distributed_source(cache: Path = CACHE) -> Path:
    """The `src` directory of the NxD archive, unpacked once per archive content."""
    archive = Path(os.environ.get("NXD_SOURCE", DEFAULT_NXD_SOURCE))
    if not archive.is_file():
        raise SystemExit(
            f"error: NXD_SOURCE: {str(archive)!r} is not a file; allowed: the neuronx-distributed v2.28.0 source "
            "archive (docs/neuron-tier.md)"
        )
    target = cache / f"neuronx-distributed-{digest(archive)}"
    if not (target / ".complete").exists():
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as bundle:
            bundle.extractall(target, filter="data")
        (target / ".complete").touch()
    (source,) = target.glob("*/src")
    return source


def main(arguments: list[str]) -> int:
    venv_dir = environment()
    python = str(venv_dir / "bin" / "python")
    nxd_source = neuronx_distributed_source()
    # Its bytecode once (up-to-date files are skipped): where PYTHONDONTWRITEBYTECODE is set, each of the tier's
    # hundred-odd processes that imports NxD would compile its source again.
    subprocess.run(
        [python, "-m", "compileall", "-q", "-j", "0", str(nxd_source)], check=True, stdout=subprocess.DEVNULL
    )
    environ = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(STANDINS), str(nxd_source), str(ROOT)]),
        "PJRT_DEVICE": "CPU",
        "NEURON_TIER": "1",
    }
    if arguments:
        return subprocess.run([python, "-m", "pytest", *arguments], cwd=ROOT, env=environ, check=False).returncode
    return run_side_by_side([[python, "-m", "pytest", *run] for run in RUNS], environ)


def run_side_by_side(commands: list[list[str]], environ: dict[str, str]) -> int:
    """The pytest runs at once (the tier's own tests keep about one core busy, the reruns fill the other), each
    one's output printed whole when it ends, in order; the highest exit status."""
    with tempfile.TemporaryDirectory() as scratch:
        logs = [Path(scratch) / f"run-{index}.log" for index in range(len(commands))]
        processes = []
        for command, log in zip(commands, logs, strict=True):
            with log.open("wb") as output:
                processes.append(
                    subprocess.Popen(command, cwd=ROOT, env=environ, stdout=output, stderr=subprocess.STDOUT)
                )
        statuses = []
        for process, log in zip(processes, logs, strict=True):
            statuses.append(process.wait())
            sys.stdout.write(log.read_text(errors="replace"))
            sys.stdout.flush()
    return max(statuses)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
