"""Tests of the ParallelCluster OnNodeConfigured script, run for real with bash on this machine.

Nothing here installs anything: the script runs with --dry-run, or its functions are called after
`source` with the system-changing steps replaced by stubs. The OS, node type and hosts files are
temporary files passed through OS_RELEASE_FILE, PCLUSTER_CFNCONFIG and HOSTS_FILE.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.pinned_script import TEST_VERSIONS, pinned_copy
from tests.support.system_tools import require_tool
from training.software import NODE_SOFTWARE

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "assets" / "node" / "on_node_configured.sh"
BASH = shutil.which("bash") or "/bin/bash"

RELEASE = "2.28.1"
APT_PINS = {
    "aws-neuronx-dkms": "2.26.10.0",
    "aws-neuronx-collectives": "2.30.59.0",
    "aws-neuronx-runtime-lib": "2.30.51.0",
    "aws-neuronx-tools": "2.28.23.0",
}
PIP_PINS = {
    "torch-neuronx": "2.9.0.2.12.22436",
    "neuronx-cc": "2.23.6484.0",
    "neuronx-distributed": "0.17.26814",
}
SHARED_ENV = f"/fsx/envs/neuron-{RELEASE}"
# The torch-native backend's release (TorchNeuron): its block is not pinned yet, so the tests of what it installs
# run a copy pinned with made-up test versions (tests/support/pinned_script.py).
TORCHNEURON_RELEASE = "2.34.0"
TORCHNEURON_APT_PINS = {
    "aws-neuronx-dkms": TEST_VERSIONS["TORCHNEURON_DKMS_VERSION"],
    "aws-neuronx-collectives": TEST_VERSIONS["TORCHNEURON_COLLECTIVES_VERSION"],
    "aws-neuronx-runtime-lib": TEST_VERSIONS["TORCHNEURON_RUNTIME_LIB_VERSION"],
    "aws-neuronx-tools": TEST_VERSIONS["TORCHNEURON_TOOLS_VERSION"],
}
TORCHNEURON_PIP_PINS = {
    "torch-neuronx": TEST_VERSIONS["TORCHNEURON_TORCH_NEURONX_VERSION"],
    "neuronx-cc": TEST_VERSIONS["TORCHNEURON_NEURONX_CC_VERSION"],
    "nki": TEST_VERSIONS["TORCHNEURON_NKI_VERSION"],
}
TORCHNEURON_ENV = f"/fsx/envs/torchneuron-{TORCHNEURON_RELEASE}"
TORCHNEURON_ARGS = ["--neuron-release", TORCHNEURON_RELEASE, "--shared-env", TORCHNEURON_ENV, "--dry-run"]
REQUIRED_ARGS = ["--neuron-release", RELEASE, "--shared-env", SHARED_ENV]

UBUNTU_2204 = 'NAME="Ubuntu"\nID=ubuntu\nID_LIKE=debian\nVERSION_ID="22.04"\nVERSION_CODENAME=jammy\n'
UBUNTU_2404 = 'NAME="Ubuntu"\nID=ubuntu\nID_LIKE=debian\nVERSION_ID="24.04"\nVERSION_CODENAME=noble\n'
UBUNTU_2004 = 'NAME="Ubuntu"\nID=ubuntu\nID_LIKE=debian\nVERSION_ID="20.04"\nVERSION_CODENAME=focal\n'
AMAZON_LINUX_2023 = 'NAME="Amazon Linux"\nID="amzn"\nID_LIKE="fedora"\nVERSION_ID="2023"\n'

HOSTS = textwrap.dedent(
    """\
    127.0.0.1 localhost
    # The following lines are desirable for IPv6 capable hosts
    ::1 ip6-localhost ip6-loopback
    10.0.1.23 queue1-st-trn1-1.mycluster.pcluster queue1-st-trn1-1
    10.0.1.24 queue1-st-trn1-10.mycluster.pcluster queue1-st-trn1-10
    10.0.0.10 head-node.example internal-service
    """
)


@pytest.fixture
def node_files(tmp_path: Path):
    """Write an os-release and a cfnconfig for a given OS and ParallelCluster node type."""

    def make(os_release: str = UBUNTU_2204, cfn_node_type: str | None = "HeadNode") -> dict[str, str]:
        os_file = tmp_path / "os-release"
        os_file.write_text(os_release)
        cfnconfig = tmp_path / "cfnconfig"
        lines = ["stack_name=mycluster", "cfn_region=us-west-2"]
        if cfn_node_type is not None:
            lines.append(f"cfn_node_type={cfn_node_type}")
        cfnconfig.write_text("\n".join([*lines, "cfn_cluster_user=ubuntu", ""]))
        hosts = tmp_path / "hosts"
        hosts.write_text(HOSTS)
        return {
            "OS_RELEASE_FILE": str(os_file),
            "PCLUSTER_CFNCONFIG": str(cfnconfig),
            "HOSTS_FILE": str(hosts),
        }

    return make


def run_script(
    args: list[str], env_overrides: dict[str, str], script: Path = SCRIPT
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **env_overrides}
    return subprocess.run([BASH, str(script), *args], env=env, capture_output=True, text=True, timeout=60, check=False)


def run_sourced(snippet: str, env_overrides: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Source the script (main does not run) and execute `snippet` in the same shell."""
    env = {**os.environ, **(env_overrides or {})}
    return subprocess.run(
        [BASH, "-c", f'source "$1"\n{snippet}', "bash", str(SCRIPT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def dry_run_commands(stdout: str) -> list[str]:
    return [line.removeprefix("DRY-RUN: ") for line in stdout.splitlines() if line.startswith("DRY-RUN: ")]


# ----------------------------------------------------------------------------- static checks


def test_script_is_executable_bash_with_strict_mode() -> None:
    text = SCRIPT.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "\nset -euo pipefail\n" in text
    assert os.access(SCRIPT, os.X_OK), "ParallelCluster runs the script directly; it must be executable"


def test_bash_syntax() -> None:
    result = subprocess.run([BASH, "-n", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_shellcheck() -> None:
    shellcheck = require_tool("shellcheck")
    result = subprocess.run([shellcheck, "--severity=style", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_pinned_block_matches_the_release_artifacts() -> None:
    text = SCRIPT.read_text()
    assert f'NEURON_RELEASE="{RELEASE}"' in text
    assert f'TORCHNEURON_RELEASE="{TORCHNEURON_RELEASE}"' in text
    # The software table (training/software.py) names every version variable of each block, so a block is refused
    # while any is empty: the neuron backend's is complete, TorchNeuron's is not yet.
    for software in NODE_SOFTWARE.values():
        prefix = software.release_variable.removesuffix("RELEASE")
        assert set(software.pin_variables) == set(re.findall(rf"^({prefix}[A-Z_]+_VERSION)=", text, re.MULTILINE))
    assert NODE_SOFTWARE["neuron"].unpinned() == ()
    assert NODE_SOFTWARE["torch-native"].unpinned() == tuple(TEST_VERSIONS)
    for variable, version in {
        "NEURON_DKMS_VERSION": APT_PINS["aws-neuronx-dkms"],
        "NEURON_COLLECTIVES_VERSION": APT_PINS["aws-neuronx-collectives"],
        "NEURON_RUNTIME_LIB_VERSION": APT_PINS["aws-neuronx-runtime-lib"],
        "NEURON_TOOLS_VERSION": APT_PINS["aws-neuronx-tools"],
        "NEURON_TORCH_NEURONX_VERSION": PIP_PINS["torch-neuronx"],
        "NEURON_NEURONX_CC_VERSION": PIP_PINS["neuronx-cc"],
        "NEURON_NEURONX_DISTRIBUTED_VERSION": PIP_PINS["neuronx-distributed"],
    }.items():
        assert re.search(rf'^{variable}="{re.escape(version)}"', text, re.MULTILINE), variable


# ----------------------------------------------------------------------------- /etc/hosts fix


def test_hosts_fix_removes_only_the_own_hostname_line(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(HOSTS)
    result = run_sourced("fix_etc_hosts queue1-st-trn1-1", {"HOSTS_FILE": str(hosts)})
    assert result.returncode == 0, result.stderr
    expected = HOSTS.replace("10.0.1.23 queue1-st-trn1-1.mycluster.pcluster queue1-st-trn1-1\n", "")
    assert hosts.read_text() == expected
    # A hostname that merely starts with the same characters is another node and must stay.
    assert "queue1-st-trn1-10" in hosts.read_text()
    assert "removed" in result.stderr


def test_hosts_fix_is_idempotent(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(HOSTS)
    first = run_sourced("fix_etc_hosts queue1-st-trn1-1", {"HOSTS_FILE": str(hosts)})
    after_first = hosts.read_bytes()
    second = run_sourced("fix_etc_hosts queue1-st-trn1-1", {"HOSTS_FILE": str(hosts)})
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert hosts.read_bytes() == after_first
    assert "nothing to change" in second.stderr


def test_hosts_fix_keeps_other_names_on_a_shared_line(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n127.0.1.1 node-a.example node-a other-alias\n10.0.0.2 node-b\n")
    result = run_sourced("fix_etc_hosts node-a", {"HOSTS_FILE": str(hosts)})
    assert result.returncode == 0, result.stderr
    assert hosts.read_text() == "127.0.0.1 localhost\n127.0.1.1 other-alias\n10.0.0.2 node-b\n"


def test_hosts_fix_keeps_the_file_inode(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(HOSTS)
    inode = hosts.stat().st_ino
    result = run_sourced("fix_etc_hosts queue1-st-trn1-1", {"HOSTS_FILE": str(hosts)})
    assert result.returncode == 0, result.stderr
    assert hosts.stat().st_ino == inode, "/etc/hosts may be bind-mounted: rewrite in place, do not replace"


def test_hosts_fix_dry_run_reports_but_does_not_change(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(HOSTS)
    result = run_sourced("DRY_RUN=1\nfix_etc_hosts queue1-st-trn1-1", {"HOSTS_FILE": str(hosts)})
    assert result.returncode == 0, result.stderr
    assert hosts.read_text() == HOSTS
    assert "remove line: 10.0.1.23 queue1-st-trn1-1.mycluster.pcluster queue1-st-trn1-1" in result.stdout


def test_hosts_fix_never_removes_localhost(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(HOSTS)
    result = run_sourced("fix_etc_hosts localhost", {"HOSTS_FILE": str(hosts)})
    assert result.returncode == 0, result.stderr
    assert "refusing to remove 'localhost'" in result.stderr
    assert hosts.read_text() == HOSTS


# ----------------------------------------------------------------------------- arguments


def test_help_documents_the_cli(node_files) -> None:
    result = run_script(["--help"], node_files())
    assert result.returncode == 0
    for option in ("--neuron-release", "--shared-env", "--pip-index", "--node-type", "--dry-run"):
        assert option in result.stdout


def test_unknown_argument_is_rejected(node_files) -> None:
    result = run_script([*REQUIRED_ARGS, "--dry-run", "--bogus"], node_files())
    assert result.returncode == 2
    assert "unknown argument: '--bogus'" in result.stderr
    assert "DRY-RUN" not in result.stdout, "nothing may run after an argument error"


def test_unknown_positional_argument_is_rejected(node_files) -> None:
    result = run_script([*REQUIRED_ARGS, "--dry-run", "extra"], node_files())
    assert result.returncode == 2
    assert "unknown argument: 'extra'" in result.stderr


@pytest.mark.parametrize("missing", ["--neuron-release", "--shared-env"])
def test_missing_required_argument(node_files, missing: str) -> None:
    args = ["--neuron-release", RELEASE, "--shared-env", SHARED_ENV]
    index = args.index(missing)
    del args[index : index + 2]
    result = run_script([*args, "--dry-run"], node_files())
    assert result.returncode == 2
    assert f"missing required argument {missing}" in result.stderr


def test_option_without_value_is_rejected(node_files) -> None:
    result = run_script(["--shared-env", SHARED_ENV, "--neuron-release", "--dry-run"], node_files())
    assert result.returncode == 2
    assert "--neuron-release requires a value" in result.stderr


def test_release_other_than_the_pinned_ones_is_rejected(node_files) -> None:
    result = run_script(["--neuron-release", "2.27.0", "--shared-env", SHARED_ENV, "--dry-run"], node_files())
    assert result.returncode == 2
    assert "does not match a release pinned in this script" in result.stderr
    assert f"({RELEASE}: neuronx-distributed; {TORCHNEURON_RELEASE}: TorchNeuron)" in result.stderr


def test_the_unpinned_torchneuron_release_is_refused_before_anything_is_installed(node_files) -> None:
    result = run_script(TORCHNEURON_ARGS, node_files(os_release=UBUNTU_2404, cfn_node_type="ComputeFleet"))
    assert result.returncode == 2
    assert f"the TorchNeuron release {TORCHNEURON_RELEASE} is not pinned in this script yet (empty: " in result.stderr
    assert "TORCHNEURON_NKI_VERSION); fill in its versions" in result.stderr
    assert "DRY-RUN" not in result.stdout


def test_the_torchneuron_release_installs_its_own_block_on_ubuntu_2404(node_files, tmp_path: Path) -> None:
    """--neuron-release chooses the pinned block: TorchNeuron's apt packages on a trn2 node, its pip packages (nki,
    no neuronx-distributed) in its own environment with its own lock, on Ubuntu 24.04's Python 3.12."""
    pinned = pinned_copy(tmp_path)
    arguments = TORCHNEURON_ARGS
    compute = run_script(arguments, node_files(os_release=UBUNTU_2404, cfn_node_type="ComputeFleet"), pinned)
    assert compute.returncode == 0, compute.stderr
    (install,) = [c for c in dry_run_commands(compute.stdout) if " apt-get " in f" {c} " and " install " in c]
    for name, version in TORCHNEURON_APT_PINS.items():
        assert f"{name}={version}\\*" in install.split(), f"{name} is not pinned to {version}"
    head = run_script([*arguments, "--env-only", "--node-type", "head"], node_files(os_release=UBUNTU_2404), pinned)
    assert head.returncode == 0, head.stderr
    commands = dry_run_commands(head.stdout)
    (pip,) = [c for c in commands if " -m pip install " in c and "--extra-index-url" in c]
    assert {f"{name}=={version}" for name, version in TORCHNEURON_PIP_PINS.items()} <= set(pip.split())
    assert "neuronx-distributed" not in pip and pip.startswith(f"/fsx/envs/.torchneuron-{TORCHNEURON_RELEASE}.env-")
    assert any(c.startswith(f"python3.12 -m venv /fsx/envs/.torchneuron-{TORCHNEURON_RELEASE}.env-") for c in commands)


def test_the_torchneuron_release_refuses_ubuntu_2204s_python(node_files, tmp_path: Path) -> None:
    env = node_files(os_release=UBUNTU_2204, cfn_node_type="ComputeFleet")
    result = run_script(TORCHNEURON_ARGS, env, pinned_copy(tmp_path))
    assert result.returncode == 1
    assert (
        f"Python 3.10 of ubuntu 22.04 is not supported by Neuron {TORCHNEURON_RELEASE} (supported: 3.12 3.13 3.14)"
        in result.stderr
    )
    assert "DRY-RUN" not in result.stdout


@pytest.mark.parametrize("shared_env", ["fsx/envs/neuron", "/fsx", "/fsx/../etc/venv", "/fsx/my env"])
def test_invalid_shared_env_is_rejected(node_files, shared_env: str) -> None:
    result = run_script(["--neuron-release", RELEASE, "--shared-env", shared_env, "--dry-run"], node_files())
    assert result.returncode == 2
    assert "--shared-env" in result.stderr


def test_equals_form_of_options_is_accepted(node_files) -> None:
    args = [f"--neuron-release={RELEASE}", f"--shared-env={SHARED_ENV}", "--pip-index=https://mirror.example/simple"]
    result = run_script([*args, "--dry-run"], node_files())
    assert result.returncode == 0, result.stderr
    # The head node passes it on to the unit that builds the shared venv.
    (exec_start,) = (line for line in written_units(result.stdout)[SHARED_ENV_UNIT_PATH] if "ExecStart=" in line)
    assert "--pip-index https://mirror.example/simple" in exec_start
    built = run_script([*args, "--env-only", "--node-type", "head", "--dry-run"], node_files())
    assert "--extra-index-url https://mirror.example/simple" in built.stdout


# ----------------------------------------------------------------------------- OS and node type


@pytest.mark.parametrize(("os_release", "shown"), [(UBUNTU_2004, "ubuntu 20.04"), (AMAZON_LINUX_2023, "amzn 2023")])
def test_unsupported_os_is_rejected(node_files, os_release: str, shown: str) -> None:
    result = run_script([*REQUIRED_ARGS, "--dry-run"], node_files(os_release=os_release))
    assert result.returncode == 1
    assert f"unsupported OS '{shown}'" in result.stderr
    assert "Ubuntu 22.04 and 24.04" in result.stderr
    assert "DRY-RUN" not in result.stdout


def test_missing_os_release_file_is_reported(node_files, tmp_path: Path) -> None:
    env = {**node_files(), "OS_RELEASE_FILE": str(tmp_path / "absent")}
    result = run_script([*REQUIRED_ARGS, "--dry-run"], env)
    assert result.returncode == 1
    assert "cannot read" in result.stderr


def test_node_type_missing_from_cfnconfig_is_reported(node_files) -> None:
    result = run_script([*REQUIRED_ARGS, "--dry-run"], node_files(cfn_node_type=None))
    assert result.returncode == 1
    assert "no cfn_node_type" in result.stderr


def test_unknown_node_type_is_reported(node_files) -> None:
    result = run_script([*REQUIRED_ARGS, "--dry-run"], node_files(cfn_node_type="Toaster"))
    assert result.returncode == 1
    assert "unknown cfn_node_type 'Toaster'" in result.stderr


def test_login_node_installs_nothing(node_files) -> None:
    result = run_script([*REQUIRED_ARGS, "--dry-run"], node_files(cfn_node_type="LoginNode"))
    assert result.returncode == 0, result.stderr
    assert dry_run_commands(result.stdout) == []
    assert "login node" in result.stderr


# ----------------------------------------------------------------------------- dry runs


@pytest.mark.parametrize(("os_release", "python"), [(UBUNTU_2204, "python3.10"), (UBUNTU_2404, "python3.12")])
def test_dry_run_head_node(node_files, os_release: str, python: str) -> None:
    env = node_files(os_release=os_release, cfn_node_type="HeadNode")
    bootstrap = run_script([*REQUIRED_ARGS, "--dry-run"], env)
    assert bootstrap.returncode == 0, bootstrap.stderr
    # OnNodeConfigured itself builds nothing: the shared venv is built by a unit started in the background.
    started = dry_run_commands(bootstrap.stdout)
    assert not [c for c in started if " -m pip " in c or " -m venv " in c], started
    assert started[-2:] == ["systemctl daemon-reload", "systemctl start --no-block trainium-shared-env.service"]
    assert any(f"{python}-venv" in c for c in started)
    # The unit runs the same script's --env-only, which builds it.
    result = run_script([*REQUIRED_ARGS, "--env-only", "--node-type", "head", "--dry-run"], env)
    assert result.returncode == 0, result.stderr
    commands = dry_run_commands(result.stdout)
    pip_installs = [c for c in commands if " -m pip install " in c and "--extra-index-url" in c]
    assert len(pip_installs) == 1, commands
    install = pip_installs[0]
    for name, version in PIP_PINS.items():
        assert f"{name}=={version}" in install.split()
    assert "--extra-index-url https://pip.repos.neuron.amazonaws.com" in install
    # Built in a hidden sibling of the shared env, published by a symlink, under a lock.
    assert install.startswith(f"/fsx/envs/.neuron-{RELEASE}.env-")
    assert any(c.startswith(f"{python} -m venv /fsx/envs/.neuron-{RELEASE}.env-") for c in commands)
    assert any(c.startswith("flock ") and c.endswith(f"/fsx/envs/.neuron-{RELEASE}.lock") for c in commands)
    assert commands[-1].startswith("ln -sfn ") and commands[-1].endswith(f" {SHARED_ENV}")
    # No Neuron devices on the head node: no driver, runtime or tools.
    assert "aws-neuronx" not in result.stdout + bootstrap.stdout
    # The /etc/hosts fix is for compute nodes only.
    assert Path(env["HOSTS_FILE"]).read_text() == HOSTS
    assert "remove line" not in result.stdout


@pytest.mark.parametrize(("os_release", "suite"), [(UBUNTU_2204, "jammy"), (UBUNTU_2404, "noble")])
def test_dry_run_compute_node(node_files, os_release: str, suite: str) -> None:
    env = node_files(os_release=os_release, cfn_node_type="ComputeFleet")
    result = run_script([*REQUIRED_ARGS, "--dry-run"], env)
    assert result.returncode == 0, result.stderr
    commands = dry_run_commands(result.stdout)
    installs = [c for c in commands if " apt-get " in f" {c} " and " install " in c]
    assert len(installs) == 1, commands
    words = installs[0].split()
    for name, version in APT_PINS.items():
        assert f"{name}={version}\\*" in words, f"{name} is not pinned to {version}"
    assert any(w.startswith("linux-headers-") for w in words)
    assert f"apt-mark hold {' '.join(APT_PINS)}" in commands
    assert (
        "write /etc/apt/sources.list.d/neuron.list: deb [signed-by=/etc/apt/keyrings/aws-neuron.gpg] "
        f"https://apt.repos.neuron.amazonaws.com {suite} main"
    ) in commands
    # The shared venv is the head node's job.
    assert "pip install" not in result.stdout
    assert "-m venv" not in result.stdout
    # A dry run never touches the hosts file.
    assert Path(env["HOSTS_FILE"]).read_text() == HOSTS


def test_node_type_argument_overrides_cfnconfig(node_files) -> None:
    result = run_script([*REQUIRED_ARGS, "--dry-run", "--node-type", "compute"], node_files(cfn_node_type="HeadNode"))
    assert result.returncode == 0, result.stderr
    assert "aws-neuronx-dkms=" in result.stdout
    assert "torch-neuronx==" not in result.stdout


def test_apt_suite_override(node_files) -> None:
    env = node_files(os_release=UBUNTU_2404, cfn_node_type="ComputeFleet")
    result = run_script([*REQUIRED_ARGS, "--dry-run", "--apt-suite", "jammy"], env)
    assert result.returncode == 0, result.stderr
    assert "https://apt.repos.neuron.amazonaws.com jammy main" in result.stdout


def test_log_lines_are_timestamped(node_files) -> None:
    result = run_script([*REQUIRED_ARGS, "--dry-run"], node_files(cfn_node_type="ComputeFleet"))
    assert result.returncode == 0, result.stderr
    log_lines = [line for line in result.stderr.splitlines() if line]
    assert log_lines
    for line in log_lines:
        assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \[on_node_configured\] ", line), line


# ----------------------------------------------------------------------------- shared venv build


@pytest.fixture
def fake_head_node(tmp_path: Path, node_files):
    """A head node whose apt and pip steps are stubs: exercises the lock, build dir and publish logic.

    `python3.10 -m venv DIR` is a stub that creates DIR/bin/python (itself a stub that accepts any
    arguments) and counts builds in a file, after a short sleep so that concurrent runs overlap.
    """
    env = node_files(os_release=UBUNTU_2204, cfn_node_type="HeadNode")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    builds = tmp_path / "venv-builds"
    fake_python = bin_dir / "python3.10"
    fake_python.write_text(
        textwrap.dedent(
            f"""\
            #!/usr/bin/env bash
            set -euo pipefail
            [[ "$1 $2" == "-m venv" ]] || exit 64
            sleep 0.5
            mkdir -p "$3/bin"
            printf '#!/usr/bin/env bash\\nexit 0\\n' >"$3/bin/python"
            chmod +x "$3/bin/python"
            echo "$3" >>"{builds}"
            """
        )
    )
    fake_python.chmod(0o755)
    shared_env = tmp_path / "fsx" / "envs" / f"neuron-{RELEASE}"
    env["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    env["ARGUMENTS_FILE"] = str(tmp_path / "state" / "arguments")  # a head node's run records its arguments

    env["SYSTEMD_DIR"] = str(tmp_path / "systemd")
    env["BOOTSTRAP_COPY"] = str(tmp_path / "state" / "on_node_configured.sh")
    started = tmp_path / "systemctl-calls"
    fake_systemctl = bin_dir / "systemctl"
    fake_systemctl.write_text(f'#!/usr/bin/env bash\necho "$*" >>"{started}"\n')
    fake_systemctl.chmod(0o755)

    def run_main(pip_step: str = ":", extra: str = "", env_only: bool = True) -> subprocess.CompletedProcess[str]:
        """The build as the background unit runs it (--env-only), or the whole head node bootstrap."""
        mode = "--env-only --node-type head" if env_only else ""
        snippet = textwrap.dedent(
            f"""\
            install_head_packages() {{ :; }}
            require_root() {{ :; }}
            install_pip_packages() {{ {pip_step}; }}
            verify_pip_versions() {{ :; }}
            main --neuron-release {RELEASE} --shared-env "{shared_env}" {mode} {extra}
            """
        )
        return run_sourced(snippet, env)

    def build_count() -> int:
        return len(builds.read_text().splitlines()) if builds.exists() else 0

    return shared_env, run_main, build_count


def test_shared_env_is_published_by_symlink_when_complete(fake_head_node) -> None:
    shared_env, run_main, build_count = fake_head_node
    result = run_main()
    assert result.returncode == 0, result.stderr
    assert shared_env.is_symlink()
    target = shared_env.resolve()
    assert target.parent == shared_env.parent
    assert target.name.startswith(f".neuron-{RELEASE}.env-")
    assert (target / ".neuron-env-complete").read_text().startswith(f"neuron_release={RELEASE}\n")
    assert (target / "neuron-constraints.txt").exists()
    assert oct(target.stat().st_mode & 0o777) == "0o755", "compute nodes' users must be able to read the venv"
    assert build_count() == 1


def test_shared_env_rerun_does_not_rebuild(fake_head_node) -> None:
    shared_env, run_main, build_count = fake_head_node
    assert run_main().returncode == 0
    target = shared_env.resolve()
    result = run_main()
    assert result.returncode == 0, result.stderr
    assert "already complete" in result.stderr
    assert shared_env.resolve() == target
    assert build_count() == 1


def test_concurrent_runs_build_once(fake_head_node) -> None:
    shared_env, run_main, build_count = fake_head_node
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda _: run_main(), range(3)))
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    assert build_count() == 1
    assert shared_env.is_symlink()
    assert len(list(shared_env.parent.glob(f".neuron-{RELEASE}.env-*"))) == 1


def test_failed_build_is_never_published_and_is_cleaned_up(fake_head_node) -> None:
    shared_env, run_main, build_count = fake_head_node
    result = run_main(pip_step="echo 'simulated pip failure' >&2; return 1")
    assert result.returncode != 0
    assert "simulated pip failure" in result.stderr
    assert not shared_env.exists() and not shared_env.is_symlink()
    assert list(shared_env.parent.glob(f".neuron-{RELEASE}.env-*")) == []
    # The next run starts from scratch and succeeds.
    assert run_main().returncode == 0
    assert shared_env.is_symlink()
    assert build_count() == 2


def test_stale_build_from_a_killed_run_is_removed(fake_head_node) -> None:
    shared_env, run_main, _ = fake_head_node
    stale = shared_env.parent / f".neuron-{RELEASE}.env-KILLED00"
    (stale / "bin").mkdir(parents=True)
    result = run_main()
    assert result.returncode == 0, result.stderr
    assert not stale.exists()
    assert shared_env.resolve() != stale


def test_foreign_directory_at_shared_env_is_not_overwritten(fake_head_node) -> None:
    shared_env, run_main, build_count = fake_head_node
    shared_env.mkdir(parents=True)
    (shared_env / "user-file").write_text("keep me")
    result = run_main()
    assert result.returncode == 1
    assert "exists but is not a complete venv" in result.stderr
    assert (shared_env / "user-file").read_text() == "keep me"
    assert build_count() == 0


def test_a_changed_requirement_file_rebuilds_and_the_same_one_does_not(fake_head_node, tmp_path: Path) -> None:
    """The pipeline runs `--env-only` with the shipped lock before each new run: only a changed lock rebuilds,
    and the build jobs may still run on is kept."""
    shared_env, run_main, build_count = fake_head_node
    lock = tmp_path / "cluster-requirements.txt"
    lock.write_text("transformers==4.57.6\n")
    first = run_main(extra=f"--requirements {lock}")
    assert first.returncode == 0, first.stderr
    old_build = shared_env.resolve()
    assert (old_build / "cluster-requirements.txt").read_text() == lock.read_text()
    marker = (old_build / ".neuron-env-complete").read_text()
    assert f"requirements_sha256={hashlib.sha256(lock.read_bytes()).hexdigest()}\n" in marker

    same = run_main(extra=f"--requirements {lock} --env-only --node-type head")
    assert same.returncode == 0 and "already complete" in same.stderr and build_count() == 1

    lock.write_text("transformers==4.57.6\nsafetensors==0.6.2\n")
    changed = run_main(extra=f"--requirements {lock} --env-only --node-type head")
    assert changed.returncode == 0, changed.stderr
    assert "rebuilding" in changed.stderr and build_count() == 2
    assert shared_env.resolve() != old_build and old_build.is_dir()


def test_env_only_installs_no_system_packages(node_files, tmp_path: Path) -> None:
    lock = tmp_path / "cluster-requirements.txt"
    lock.write_text("transformers==4.57.6\n")
    env = node_files(cfn_node_type="HeadNode")
    args = [*REQUIRED_ARGS, "--requirements", str(lock), "--env-only", "--node-type", "head", "--dry-run"]
    result = run_script(args, env)
    assert result.returncode == 0, result.stderr
    commands = dry_run_commands(result.stdout)
    assert not [c for c in commands if "apt-get" in c]
    (install,) = [c for c in commands if " -m pip install " in c and "--extra-index-url" in c]
    assert install.endswith(f" -r {lock}"), install
    assert all(f"{name}=={version}" in install.split() for name, version in PIP_PINS.items())


def test_env_only_is_for_the_head_node(node_files) -> None:
    result = run_script([*REQUIRED_ARGS, "--env-only", "--dry-run"], node_files(cfn_node_type="ComputeFleet"))
    assert result.returncode == 2 and "--env-only builds the shared venv" in result.stderr


def test_requirements_from_s3_are_fetched_with_the_aws_cli(node_files) -> None:
    uri = "s3://results-bucket/cluster/cluster-requirements.txt"
    result = run_script([*REQUIRED_ARGS, "--requirements", uri, "--dry-run"], node_files(cfn_node_type="HeadNode"))
    assert result.returncode == 0, result.stderr
    assert f"DRY-RUN: fetch {uri} into " in result.stdout
    bad = run_script([*REQUIRED_ARGS, "--requirements", "reqs.txt", "--dry-run"], node_files())
    assert bad.returncode == 2 and "--requirements must be an absolute path or an s3:// URI" in bad.stderr


def test_verify_pip_versions_rejects_missing_packages() -> None:
    python = shutil.which("python3")
    assert python is not None
    result = run_sourced(f'verify_pip_versions "{python}"')
    assert result.returncode != 0
    assert f"torch-neuronx: wanted {PIP_PINS['torch-neuronx']}, found not installed" in result.stderr


def test_verify_pip_versions_accepts_matching_pins() -> None:
    python = shutil.which("python3")
    assert python is not None
    version = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('pip'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    result = run_sourced(f'NEURON_PIP_PINS=("pip=={version}")\nverify_pip_versions "{python}"')
    assert result.returncode == 0, result.stderr


def test_verify_pip_versions_ignores_local_version_labels(tmp_path: Path) -> None:
    # neuronx-cc wheels are versioned like 2.23.6484.0+<hash>; pip's == pin matches them, so must we.
    site = tmp_path / "site"
    dist_info = site / "neuronx_cc-2.23.6484.0+abc123.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: neuronx-cc\nVersion: 2.23.6484.0+abc123\n")
    python = shutil.which("python3")
    assert python is not None
    snippet = f'NEURON_PIP_PINS=("neuronx-cc==2.23.6484.0")\nverify_pip_versions "{python}"'
    assert run_sourced(snippet, {"PYTHONPATH": str(site)}).returncode == 0
    wrong = f'NEURON_PIP_PINS=("neuronx-cc==2.23.6485.0")\nverify_pip_versions "{python}"'
    result = run_sourced(wrong, {"PYTHONPATH": str(site)})
    assert result.returncode != 0
    assert "wanted 2.23.6485.0, found 2.23.6484.0+abc123" in result.stderr


# ----------------------------------------------------------------------------- node health


def fake_device_tree(root: Path, neuron: int, efa: int) -> Path:
    """A trn1.32xlarge's device files as the checks see them: /dev/neuronN and /sys/class/infiniband/*."""
    (root / "dev").mkdir(parents=True, exist_ok=True)
    (root / "sys" / "class" / "infiniband").mkdir(parents=True, exist_ok=True)
    for index in range(neuron):
        (root / "dev" / f"neuron{index}").touch()
    for index in range(efa):
        (root / "sys" / "class" / "infiniband" / f"rdmap{index}s0").mkdir()
    return root


@pytest.mark.parametrize(
    ("neuron", "efa", "problem"),
    [
        (16, 8, None),
        (15, 8, "15 of 16 Neuron devices"),
        (16, 0, "0 of 8 EFA devices"),
        (0, 0, "0 of 16 Neuron devices, 0 of 8 EFA devices"),
    ],
)
def test_bootstrap_fails_on_a_node_missing_devices(tmp_path: Path, neuron: int, efa: int, problem: str | None) -> None:
    """A failed OnNodeConfigured makes ParallelCluster replace the node instead of giving it to a job."""
    root = fake_device_tree(tmp_path / "node", neuron, efa)
    result = run_sourced("ARG_NEURON_DEVICES=16 ARG_EFA_DEVICES=8 check_devices", {"DEVICE_ROOT": str(root)})
    if problem is None:
        assert result.returncode == 0 and "16 Neuron and 8 EFA devices present" in result.stderr
    else:
        assert result.returncode == 1
        assert f"ERROR: node health: {problem} (the instance is faulty or not a Trainium type)" in result.stderr


def test_cpu_nodes_install_nothing_and_check_no_devices(node_files) -> None:
    result = run_script([*REQUIRED_ARGS, "--neuron-devices", "16", "--node-type", "cpu", "--dry-run"], node_files())
    assert result.returncode == 0, result.stderr
    assert dry_run_commands(result.stdout) == [] and "CPU node" in result.stderr


def test_dry_run_compute_node_checks_the_expected_devices(node_files) -> None:
    args = [*REQUIRED_ARGS, "--neuron-devices", "16", "--efa-devices", "8", "--dry-run"]
    result = run_script(args, node_files(cfn_node_type="ComputeFleet"))
    assert result.returncode == 0, result.stderr
    assert "would check for 16 Neuron and 8 EFA devices" in result.stderr


def test_device_counts_must_be_numbers(node_files) -> None:
    result = run_script([*REQUIRED_ARGS, "--efa-devices", "eight", "--dry-run"], node_files())
    assert result.returncode == 2 and "--neuron-devices and --efa-devices must be counts" in result.stderr


# ----------------------------------------------------------------------------- monitoring units

MONITOR_ARGS = [*REQUIRED_ARGS, "--environment", "default", "--dry-run"]
CLUSTER_EXEC = f"{SHARED_ENV}/bin/python -m training monitor cluster --site /fsx/pipeline/site-default.yaml"
NEURON_EXEC = f"{SHARED_ENV}/bin/python -m training monitor neuron --site /fsx/pipeline/site-default.yaml"


SHARED_ENV_UNIT_PATH = "/etc/systemd/system/trainium-shared-env.service"


def written_units(stdout: str) -> dict[str, list[str]]:
    """The unit files a dry run would write: path -> lines (printed indented after `DRY-RUN: write PATH`)."""
    units: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in stdout.splitlines():
        if line.startswith("DRY-RUN: write /etc/systemd/system/"):
            current = units.setdefault(line.removeprefix("DRY-RUN: write "), [])
        elif line.startswith("DRY-RUN: "):
            current = None
        elif current is not None:
            current.append(line.strip())
    return units


def test_dry_run_head_node_installs_the_cluster_monitor_timer(node_files) -> None:
    result = run_script(MONITOR_ARGS, node_files(cfn_node_type="HeadNode"))
    assert result.returncode == 0, result.stderr
    units = written_units(result.stdout)
    service = units.pop("/etc/systemd/system/trainium-monitor-cluster.service")
    timer = units.pop("/etc/systemd/system/trainium-monitor-cluster.timer")
    units.pop(SHARED_ENV_UNIT_PATH)
    assert units == {}, "the head node runs no Neuron monitor"
    assert f"ExecStart={CLUSTER_EXEC}" in service
    assert "Environment=PYTHONPATH=/fsx/pipeline/current" in service
    assert "Type=oneshot" in service
    assert "OnCalendar=minutely" in timer and "Unit=trainium-monitor-cluster.service" in timer
    assert "WantedBy=timers.target" in timer
    commands = dry_run_commands(result.stdout)
    enable = commands.index("systemctl enable --now trainium-monitor-cluster.timer")
    assert commands[enable - 1] == "systemctl daemon-reload"
    assert commands[-1] == "systemctl start --no-block trainium-shared-env.service"


def test_dry_run_trainium_node_installs_the_neuron_monitor_service(node_files) -> None:
    result = run_script(MONITOR_ARGS, node_files(cfn_node_type="ComputeFleet"))
    assert result.returncode == 0, result.stderr
    units = written_units(result.stdout)
    assert list(units) == ["/etc/systemd/system/trainium-monitor-neuron.service"]
    (service,) = units.values()
    assert f"ExecStart={NEURON_EXEC}" in service
    assert "Environment=PYTHONPATH=/fsx/pipeline/current" in service
    assert {"Restart=always", "RestartSec=60", "Type=simple", "WantedBy=multi-user.target"} <= set(service)
    assert "StartLimitIntervalSec=0" in service  # restarts for as long as the pipeline has not brought the code
    commands = dry_run_commands(result.stdout)
    assert commands[-3:-1] == [
        "systemctl daemon-reload",
        "systemctl enable --now trainium-monitor-neuron.service",
    ]
    # The last act: the bootstrap's end, for the run's timeline (training/pipeline/timeline.py)
    assert re.fullmatch(r"write /var/lib/trainium-bootstrap/configured: \d{10}", commands[-1]), commands[-1]


@pytest.mark.parametrize(
    ("cfn_node_type", "extra"),
    [("ComputeFleet", ["--node-type", "cpu"]), ("LoginNode", []), ("HeadNode", ["--env-only", "--node-type", "head"])],
    ids=["cpu-queue", "login", "env-only"],
)
def test_no_monitoring_units_elsewhere(node_files, cfn_node_type: str, extra: list[str]) -> None:
    result = run_script([*MONITOR_ARGS, *extra], node_files(cfn_node_type=cfn_node_type))
    assert result.returncode == 0, result.stderr
    assert "trainium-monitor" not in result.stdout and "systemctl" not in result.stdout


def test_no_monitoring_units_without_an_environment(node_files) -> None:
    result = run_script([*REQUIRED_ARGS, "--dry-run"], node_files(cfn_node_type="ComputeFleet"))
    assert result.returncode == 0, result.stderr
    assert "trainium-monitor" not in result.stdout
    assert "no --environment: no CloudWatch metrics units" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--environment", "Prod env"], "--environment must be an environment name"),
        (["--environment", "-x"], "--environment must be an environment name"),
        (["--environment", "default", "--shared-env", "/fsx/venvs/neuron"], "--environment needs --shared-env of"),
        (["--environment", "default", "--shared-env", "/envs/neuron"], "--environment needs --shared-env of"),
    ],
)
def test_bad_environment_arguments_are_rejected(node_files, args: list[str], message: str) -> None:
    result = run_script([*REQUIRED_ARGS, *args, "--dry-run"], node_files())
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "DRY-RUN" not in result.stdout


@pytest.fixture
def monitored_mount(tmp_path: Path):
    """A mount with the shared venv's python (a wrapper around this interpreter) and the unit files of both
    monitors written by the script's own function for that mount."""
    mount = tmp_path / "fsx"
    shared_env = mount / "envs" / f"neuron-{RELEASE}"
    (shared_env / "bin").mkdir(parents=True)
    python = shared_env / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # this venv: boto3, pydantic, PyYAML
    python.chmod(0o755)
    units = tmp_path / "units"
    units.mkdir()
    names = ["trainium-monitor-cluster.service", "trainium-monitor-cluster.timer", "trainium-monitor-neuron.service"]
    snippet = f'ARG_SHARED_ENV="{shared_env}" ARG_ENVIRONMENT=default\n' + "".join(
        f'monitor_unit_text {name} >"{units / name}"\n' for name in names
    )
    result = run_sourced(snippet)
    assert result.returncode == 0, result.stderr
    return mount, {name: units / name for name in names}


def test_units_pass_systemd_analyze_verify(monitored_mount) -> None:
    analyze = require_tool("systemd-analyze")
    _, units = monitored_mount
    result = subprocess.run([analyze, "verify", *map(str, units.values())], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr.strip() == "" or "Failed" not in result.stderr


def unit_setting(path: Path, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in path.read_text().splitlines() if line.startswith(f"{key}=")]


def test_the_neuron_unit_command_fails_until_the_pipeline_brings_the_code_then_runs_it(
    monitored_mount, tmp_path: Path
) -> None:
    """ExecStart as systemd runs it (its Environment only, no PATH): no code yet is a failure systemd restarts;
    with `<mount>/pipeline/current` and the site file in place, the real CLI runs (and here, without Neuron
    tools, stops at the missing neuron-monitor)."""
    mount, units = monitored_mount
    service = units["trainium-monitor-neuron.service"]
    (command,) = unit_setting(service, "ExecStart")
    environment = dict(value.split("=", 1) for value in unit_setting(service, "Environment"))
    assert environment["PYTHONPATH"] == f"{mount}/pipeline/current"

    def start() -> subprocess.CompletedProcess[str]:
        return subprocess.run(command.split(), env=environment, cwd="/", capture_output=True, text=True, check=False)

    before = start()  # no code (on the cluster) or, here where this venv has it, no site file yet
    assert before.returncode != 0
    assert "No module named training" in before.stderr or "site-default.yaml: cannot read" in before.stderr
    (mount / "pipeline").mkdir()
    (mount / "pipeline" / "current").symlink_to(ROOT, target_is_directory=True)
    (mount / "pipeline" / "site-default.yaml").write_text('{"metrics_namespace": "Trainium/default"}\n')
    after = start()
    assert after.returncode == 2, after.stderr
    assert "error: neuron-monitor: not found at /opt/aws/neuron/bin/neuron-monitor" in after.stderr


def test_units_are_installed_and_started_and_a_failing_systemctl_is_only_a_warning(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "systemctl.log"
    systemctl = bin_dir / "systemctl"
    systemctl.write_text(f'#!/bin/sh\necho "$*" >>"{calls}"\n[ ! -e "{tmp_path}/fail" ]\n')
    systemctl.chmod(0o755)
    systemd_dir = tmp_path / "systemd"
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SYSTEMD_DIR": str(systemd_dir)}
    snippet = f"ARG_SHARED_ENV={SHARED_ENV} ARG_ENVIRONMENT=default\ninstall_monitoring_units cluster"
    result = run_sourced(snippet, env)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in systemd_dir.iterdir()) == [
        "trainium-monitor-cluster.service",
        "trainium-monitor-cluster.timer",
    ]
    service = systemd_dir / "trainium-monitor-cluster.service"
    assert oct(service.stat().st_mode & 0o777) == "0o644"
    assert unit_setting(service, "ExecStart") == [CLUSTER_EXEC]
    assert calls.read_text().splitlines() == ["daemon-reload", "enable --now trainium-monitor-cluster.timer"]
    (tmp_path / "fail").touch()
    failed = run_sourced(snippet.replace("cluster", "neuron"), env)
    assert failed.returncode == 0, failed.stderr
    assert "WARNING: could not enable trainium-monitor-neuron.service" in failed.stderr


# ----------------------------------------------------------------------------- node settings, Neuron apt key

RECORD_URI = "s3://results-bucket/trust/neuron-apt-key.fingerprint"


@pytest.fixture
def gpg_tool() -> str:
    return require_tool("gpg")


needs_gpg = pytest.mark.usefixtures("gpg_tool")

# An `aws` stand-in for the S3 calls of the bootstrap: objects are files under S3_ROOT/<bucket>/<key>; a put with
# If-None-Match fails with S3's 412 when the object exists, and one without it is refused as the node policy
# refuses it. RACE_FILE, when present, is "another node" whose record lands just before this node's put.
AWS_STAND_IN = """\
import os, shutil, sys
from pathlib import Path

root = Path(os.environ["S3_ROOT"])
with open(os.environ["AWS_CALLS"], "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
args = sys.argv[1:]

def option(name):
    return args[args.index(name) + 1] if name in args else None

def path_of(uri):
    return root / uri.removeprefix("s3://")

if args[:2] == ["s3", "cp"]:
    source, target = [a for a in args[2:] if not a.startswith("--")]
    if not path_of(source).is_file():
        sys.exit(f"fatal error: An error occurred (404) when calling the HeadObject operation: Key does not exist")
    shutil.copyfile(path_of(source), target)
elif args[:2] == ["s3api", "put-object"]:
    target = root / option("--bucket") / option("--key")
    race = Path(os.environ.get("RACE_FILE", "/nonexistent"))
    if race.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(race, target)
    if option("--if-none-match") != "*":
        sys.exit("An error occurred (AccessDenied) when calling the PutObject operation: Access Denied")
    if target.exists():
        sys.exit("An error occurred (PreconditionFailed) when calling the PutObject operation: At least one of "
                 "the pre-conditions you specified did not hold")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(option("--body"), target)
else:
    sys.exit(f"aws stand-in: unexpected call {args}")
"""


@pytest.fixture(scope="module")
def neuron_keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Two OpenPGP public keys made with real gpg (armored, as Neuron publishes its key), by fingerprint."""
    gpg_path = require_tool("gpg")
    home = tmp_path_factory.mktemp("gnupg")
    home.chmod(0o700)
    keys: dict[str, tuple[Path, str]] = {}
    for name in ("neuron", "impostor"):
        email = f"{name}@example.com"

        def gpg(*args: str) -> str:
            done = subprocess.run(
                [gpg_path, "--homedir", str(home), "--batch", *args], capture_output=True, text=True, check=True
            )
            return done.stdout

        gpg("--passphrase", "", "--quick-gen-key", f"{name} <{email}>", "ed25519", "sign", "never")
        listing = gpg("--with-colons", "--list-keys", email)
        fingerprint = next(line.split(":")[9] for line in listing.splitlines() if line.startswith("fpr:"))
        path = home / f"{name}.asc"
        path.write_text(gpg("--armor", "--export", email))
        keys[name] = (path, fingerprint)
    return keys


@pytest.fixture
def trust_world(tmp_path: Path):
    """A bucket of files behind an `aws` stand-in, a node settings file, and a way to run the bootstrap's
    functions against them; returns (run, settings, s3 root, aws call log)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    aws = bin_dir / "aws"
    aws.write_text(f"#!{sys.executable}\n{AWS_STAND_IN}")
    aws.chmod(0o755)
    s3_root = tmp_path / "s3"
    (s3_root / "results-bucket").mkdir(parents=True)
    calls = tmp_path / "aws-calls"
    calls.touch()
    settings = tmp_path / "node-settings.json"
    settings.write_text(json.dumps({"neuron_apt_key_fingerprint": None, "neuron_apt_key_record": RECORD_URI}))
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "S3_ROOT": str(s3_root),
        "AWS_CALLS": str(calls),
        "RACE_FILE": str(tmp_path / "race"),
    }

    def run(snippet: str) -> subprocess.CompletedProcess[str]:
        return run_sourced(f'NODE_SETTINGS_FILE="{settings}" RECORD_RETRY_SECONDS=0\n{snippet}', env)

    return run, settings, s3_root, calls


def record_path(s3_root: Path) -> Path:
    return s3_root / RECORD_URI.removeprefix("s3://")


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "ERROR" in line]


def test_node_settings_are_read_by_key(tmp_path: Path) -> None:
    settings = tmp_path / "settings.json"
    settings.write_text('{"text": "a b", "count": 3, "flag": true, "none": null}')
    snippet = f'NODE_SETTINGS_FILE="{settings}"\n' + "".join(
        f'printf "%s|" "$(node_setting {key})"\n' for key in ("text", "count", "flag", "none", "absent")
    )
    result = run_sourced(snippet)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "a b|3|true|||"
    assert run_sourced('NODE_SETTINGS_FILE=""\nprintf "[%s]" "$(node_setting text)"').stdout == "[]"


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "not a readable JSON file"),
        ('["a list"]', "a JSON object is required"),
        ('{"text": {"nested": 1}}', "text must be a string, a number or a boolean"),
    ],
)
def test_bad_node_settings_stop_the_bootstrap_in_one_line(tmp_path: Path, content: str, problem: str) -> None:
    settings = tmp_path / "settings.json"
    settings.write_text(content)
    result = run_sourced(f'NODE_SETTINGS_FILE="{settings}"\nvalue=$(node_setting text) || exit 1\necho reached')
    assert result.returncode == 1 and "reached" not in result.stdout
    (line,) = error_lines(result.stderr)
    assert line.endswith(f"ERROR: node settings {settings}: {problem}") or f"{problem} (" in line, line


def test_node_settings_from_s3_are_fetched_and_checked(trust_world, node_files) -> None:
    run, settings, s3_root, calls = trust_world
    uri = "s3://results-bucket/cluster/node-settings.json"
    (s3_root / "results-bucket" / "cluster").mkdir()
    shutil.copyfile(settings, s3_root / "results-bucket" / "cluster" / "node-settings.json")
    result = run(f'ARG_NODE_SETTINGS="{uri}"\nfetch_node_settings\nnode_setting neuron_apt_key_record')
    assert result.returncode == 0, result.stderr
    assert result.stdout == RECORD_URI
    assert calls.read_text().splitlines() == [f"s3 cp --only-show-errors {uri} " + calls.read_text().split()[-1]]
    dry = run_script([*REQUIRED_ARGS, "--node-settings", uri, "--dry-run"], node_files(cfn_node_type="ComputeFleet"))
    assert dry.returncode == 0, dry.stderr
    assert f"DRY-RUN: fetch {uri}" in dry.stdout
    bad = run_script([*REQUIRED_ARGS, "--node-settings", "settings.json", "--dry-run"], node_files())
    assert bad.returncode == 2 and "--node-settings must be an absolute path or an s3:// URI" in bad.stderr


@needs_gpg
def test_first_use_records_the_fingerprint_with_a_conditional_write(trust_world, neuron_keys) -> None:
    run, _, s3_root, calls = trust_world
    key, fingerprint = neuron_keys["neuron"]
    result = run(f'check_neuron_apt_key "{key}"')
    assert result.returncode == 0, result.stderr
    assert record_path(s3_root).read_text() == f"{fingerprint}\n"
    assert f"first use: recorded the Neuron apt key's fingerprint {fingerprint} at {RECORD_URI}" in result.stderr
    (put,) = [call for call in calls.read_text().splitlines() if "put-object" in call]
    assert "--bucket results-bucket --key trust/neuron-apt-key.fingerprint " in put
    assert put.endswith("--if-none-match *")


@needs_gpg
def test_the_same_key_passes_and_another_is_refused_in_one_line(trust_world, neuron_keys) -> None:
    run, _, s3_root, calls = trust_world
    key, fingerprint = neuron_keys["neuron"]
    other, other_fingerprint = neuron_keys["impostor"]
    record_path(s3_root).parent.mkdir(parents=True)
    record_path(s3_root).write_text(f"{fingerprint}\n")
    same = run(f'check_neuron_apt_key "{key}"')
    assert same.returncode == 0, same.stderr
    assert f"fingerprint {fingerprint} is the expected one (recorded at {RECORD_URI}" in same.stderr
    refused = run(f'check_neuron_apt_key "{other}"\necho trusted')
    assert refused.returncode == 1 and "trusted" not in refused.stdout
    (line,) = refused.stderr.strip().splitlines()
    assert line.endswith(
        "ERROR: refusing the Neuron apt key from https://apt.repos.neuron.amazonaws.com/GPG-PUB-KEY-AMAZON-AWS-"
        f"NEURON.PUB: its fingerprint is {other_fingerprint}, not {fingerprint} (recorded at {RECORD_URI} by the "
        "first node)"
    ), line
    assert "put-object" not in calls.read_text(), "a record exists: nobody writes it again"
    assert record_path(s3_root).read_text() == f"{fingerprint}\n"


@needs_gpg
def test_the_environment_fingerprint_takes_precedence_over_the_record(trust_world, neuron_keys) -> None:
    run, settings, s3_root, calls = trust_world
    key, fingerprint = neuron_keys["neuron"]
    rotated, rotated_fingerprint = neuron_keys["impostor"]  # say Neuron rotated its key: the reviewer sets it
    record_path(s3_root).parent.mkdir(parents=True)
    record_path(s3_root).write_text(f"{fingerprint}\n")
    settings.write_text(
        json.dumps({"neuron_apt_key_fingerprint": rotated_fingerprint.lower(), "neuron_apt_key_record": RECORD_URI})
    )
    accepted = run(f'check_neuron_apt_key "{rotated}"')
    assert accepted.returncode == 0, accepted.stderr
    assert "(neuron.apt_key_fingerprint of the environment file)" in accepted.stderr
    assert calls.read_text() == "", "with a fingerprint set, the record is neither read nor written"
    refused = run(f'check_neuron_apt_key "{key}"')
    assert refused.returncode == 1
    (line,) = refused.stderr.strip().splitlines()
    assert f"its fingerprint is {fingerprint}, not {rotated_fingerprint} (neuron.apt_key_fingerprint of" in line


@needs_gpg
@pytest.mark.parametrize("winner", ["neuron", "impostor"])
def test_a_lost_race_to_record_rereads_and_compares(trust_world, neuron_keys, tmp_path: Path, winner: str) -> None:
    """No record when this node looked; another node's lands before this node's conditional write, which S3
    refuses (412): the other node's record decides."""
    run, _, s3_root, calls = trust_world
    key, fingerprint = neuron_keys["neuron"]
    (tmp_path / "race").write_text(f"{neuron_keys[winner][1]}\n")
    result = run(f'check_neuron_apt_key "{key}"')
    assert [call.split()[:2] for call in calls.read_text().splitlines()] == [
        ["s3", "cp"],
        ["s3api", "put-object"],
        ["s3", "cp"],
    ]
    assert record_path(s3_root).read_text() == f"{neuron_keys[winner][1]}\n", "the first record stays"
    if winner == "neuron":
        assert result.returncode == 0, result.stderr
        assert "first use" not in result.stderr
    else:
        assert result.returncode == 1
        (line,) = result.stderr.strip().splitlines()
        assert f"its fingerprint is {fingerprint}, not {neuron_keys['impostor'][1]}" in line


@needs_gpg
def test_a_record_that_can_be_neither_written_nor_read_stops_the_bootstrap(trust_world, neuron_keys) -> None:
    run, _, s3_root, calls = trust_world
    key, _ = neuron_keys["neuron"]
    result = run(
        f'record_key_fingerprint() {{ echo "An error occurred (AccessDenied)" >&2; return 1; }}\n'
        f'check_neuron_apt_key "{key}"'
    )
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.endswith(
        f"ERROR: cannot record the Neuron apt key's fingerprint at {RECORD_URI}: An error occurred (AccessDenied)"
    ), line
    assert not record_path(s3_root).exists()
    assert [call.split()[:2] for call in calls.read_text().splitlines()] == [["s3", "cp"]] * 3, "three tries"


@needs_gpg
def test_a_key_file_with_two_keys_is_refused(trust_world, neuron_keys, tmp_path: Path) -> None:
    run, _, _, _ = trust_world
    both = tmp_path / "both.asc"
    both.write_text(neuron_keys["neuron"][0].read_text() + neuron_keys["impostor"][0].read_text())
    result = run(f'check_neuron_apt_key "{both}"')
    assert result.returncode == 1
    assert "holds 2 OpenPGP keys, expected exactly one" in result.stderr


@needs_gpg
def test_apt_trusts_the_key_only_after_the_check(trust_world, neuron_keys, tmp_path: Path) -> None:
    """The whole repository step with `curl` serving a key: a refused key leaves no keyring and no source list."""
    run, _, s3_root, _ = trust_world
    served = tmp_path / "served.asc"
    curl = tmp_path / "bin" / "curl"
    curl.write_text(f'#!/bin/sh\nwhile [ "$1" != -o ]; do shift; done\ncp "{served}" "$2"\n')
    curl.chmod(0o755)
    keyring = tmp_path / "keyrings" / "aws-neuron.gpg"
    source_list = tmp_path / "neuron.list"
    snippet = (
        f'NEURON_APT_KEYRING="{keyring}" NEURON_APT_SOURCE="{source_list}" OS_CODENAME=jammy\nconfigure_neuron_apt_repo'
    )
    key, fingerprint = neuron_keys["neuron"]
    record_path(s3_root).parent.mkdir(parents=True)
    record_path(s3_root).write_text(f"{fingerprint}\n")
    shutil.copyfile(neuron_keys["impostor"][0], served)
    refused = run(snippet)
    assert refused.returncode == 1 and "refusing the Neuron apt key" in refused.stderr
    assert not keyring.exists() and not source_list.exists()
    shutil.copyfile(key, served)
    accepted = run(snippet)
    assert accepted.returncode == 0, accepted.stderr
    assert source_list.read_text() == f"deb [signed-by={keyring}] https://apt.repos.neuron.amazonaws.com jammy main\n"
    listing = subprocess.run(
        [require_tool("gpg"), "--show-keys", "--with-colons", str(keyring)], capture_output=True, text=True, check=True
    ).stdout
    assert f"fpr:::::::::{fingerprint}:" in listing, "the keyring apt reads holds the checked key"


# ----------------------------------------------------------------------------- --refresh


def test_refresh_reruns_the_head_node_with_its_first_arguments(fake_head_node, tmp_path: Path) -> None:
    """The head node runs OnNodeConfigured once; a newer script from the fixed key runs again through SSM with
    `--refresh`, with exactly the arguments ParallelCluster gave the first run."""
    shared_env, run_main, build_count = fake_head_node
    first = run_main(extra="--pip-index https://mirror.example/simple", env_only=False)
    assert first.returncode == 0, first.stderr
    assert build_count() == 0  # OnNodeConfigured started the build in the background; it built nothing itself
    unit = (tmp_path / "systemd" / "trainium-shared-env.service").read_text()
    copy = tmp_path / "state" / "on_node_configured.sh"
    assert f"ExecStart=/bin/bash {copy} --env-only --node-type head --neuron-release {RELEASE}" in unit
    assert (tmp_path / "systemctl-calls").read_text().splitlines()[-1] == (
        "start --no-block trainium-shared-env.service"
    )
    assert copy.read_bytes() == SCRIPT.read_bytes()
    recorded = tmp_path / "state" / "arguments"
    assert recorded.read_text().splitlines() == [
        "--neuron-release",
        RELEASE,
        "--shared-env",
        str(shared_env),
        "--pip-index",
        "https://mirror.example/simple",
    ]
    assert oct(recorded.stat().st_mode & 0o777) == "0o600" and oct(recorded.parent.stat().st_mode & 0o777) == "0o700"
    env = {"ARGUMENTS_FILE": str(recorded), "OS_RELEASE_FILE": str(tmp_path / "os-release")}
    again = run_sourced("require_root() { :; }\nmain --refresh --dry-run --node-type head", env)
    assert again.returncode == 0, again.stderr
    assert "--refresh: running with the arguments of the first run" in again.stderr
    assert "DRY-RUN: env DEBIAN_FRONTEND=noninteractive" in again.stdout  # the whole head node bootstrap again
    assert "DRY-RUN: systemctl start --no-block trainium-shared-env.service" in again.stdout
    assert recorded.read_text().count("\n") == 6, "a refresh records nothing"


def test_refresh_needs_recorded_arguments_and_comes_first(node_files, tmp_path: Path) -> None:
    env = {**node_files(), "ARGUMENTS_FILE": str(tmp_path / "absent")}
    missing = run_script(["--refresh"], env)
    assert missing.returncode == 2
    assert f"--refresh: no arguments recorded at {tmp_path / 'absent'}" in missing.stderr
    late = run_script([*REQUIRED_ARGS, "--refresh"], env)
    assert late.returncode == 2 and "--refresh must be the first argument" in late.stderr


def test_dry_runs_and_other_node_types_record_no_arguments(node_files, tmp_path: Path) -> None:
    env = {**node_files(cfn_node_type="HeadNode"), "ARGUMENTS_FILE": str(tmp_path / "state" / "arguments")}
    assert run_script([*REQUIRED_ARGS, "--dry-run"], env).returncode == 0
    assert not (tmp_path / "state").exists()


def test_the_shared_env_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """The unit the head node writes for the background build, as systemd would load it."""
    analyze = require_tool("systemd-analyze")
    copy = tmp_path / "on_node_configured.sh"
    copy.write_bytes(SCRIPT.read_bytes())
    unit = tmp_path / "trainium-shared-env.service"
    snippet = (
        f'ARG_NEURON_RELEASE={RELEASE} ARG_SHARED_ENV="{SHARED_ENV}" ARG_REQUIREMENTS=s3://bucket/cluster/lock.txt\n'
        f'BOOTSTRAP_COPY="{copy}" shared_env_unit_text >"{unit}"\n'
    )
    result = run_sourced(snippet)
    assert result.returncode == 0, result.stderr
    assert "Type=oneshot" in unit.read_text() and "--requirements s3://bucket/cluster/lock.txt" in unit.read_text()
    verified = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, check=False)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_an_argument_systemd_would_split_is_refused(tmp_path: Path) -> None:
    result = run_sourced(f'ARG_NEURON_RELEASE={RELEASE} ARG_SHARED_ENV="/fsx/envs/a b"\nshared_env_unit_text')
    assert result.returncode != 0
    assert "cannot pass '/fsx/envs/a b' to trainium-shared-env.service" in result.stderr


# ----------------------------------------------------------------------------- baked images


def fake_dpkg_query(tmp_path: Path, versions: dict[str, str]) -> str:
    """A dpkg-query that knows `versions` (package -> installed version) and nothing else."""
    table = "\n".join(f"{name}) printf '%s' '{version}' ;;" for name, version in versions.items())
    script = tmp_path / "dpkg-query"
    script.write_text(f'#!/usr/bin/env bash\ncase "${{@: -1}}" in\n{table}\n*) exit 1 ;;\nesac\n')
    script.chmod(0o755)
    return str(script)


def test_a_node_booted_from_a_baked_image_installs_no_apt_packages(node_files, tmp_path: Path) -> None:
    env = node_files(cfn_node_type="ComputeFleet")
    env["DPKG_QUERY"] = fake_dpkg_query(tmp_path, {name: f"{version}-1" for name, version in APT_PINS.items()})
    result = run_script([*REQUIRED_ARGS, "--dry-run"], env)
    assert result.returncode == 0, result.stderr
    commands = dry_run_commands(result.stdout)
    assert not [c for c in commands if "apt-get" in c], commands
    assert "modprobe neuron" in commands  # the image's driver, loaded on this node's devices
    assert "already installed (a baked image): no apt, no driver build" in result.stderr


def test_an_image_with_another_release_falls_back_to_the_boot_time_install(node_files, tmp_path: Path) -> None:
    versions = {name: f"{version}-1" for name, version in APT_PINS.items()}
    versions["aws-neuronx-dkms"] = "2.25.4.0"
    env = node_files(cfn_node_type="ComputeFleet")
    env["DPKG_QUERY"] = fake_dpkg_query(tmp_path, versions)
    result = run_script([*REQUIRED_ARGS, "--dry-run"], env)
    assert result.returncode == 0, result.stderr
    assert [c for c in dry_run_commands(result.stdout) if " install " in c and "apt-get" in c]


def test_bake_installs_the_pinned_packages_and_nothing_of_a_running_node(node_files) -> None:
    result = run_script([*REQUIRED_ARGS, "--bake", "--node-type", "compute", "--dry-run"], node_files())
    assert result.returncode == 0, result.stderr
    commands = dry_run_commands(result.stdout)
    (install,) = [c for c in commands if "apt-get" in c and " install " in c]
    for name, version in APT_PINS.items():
        assert f"{name}={version}\\*" in install.split()
    assert f"apt-mark hold {' '.join(APT_PINS)}" in commands
    assert "modprobe neuron" not in commands  # no devices on the build instance
    assert not [c for c in commands if "systemctl" in c or "hosts" in c or " -m pip " in c], commands
