"""What the shared Neuron environment downloads, from the cluster's lock and PyPI's JSON API (needs the network).

`python benchmarks/bootstrap_budget.py` prints, per group (CUDA libraries that PyPI's torch pulls in, torch
itself, the rest), the bytes of the wheels a node with the nodes' Python downloads, and the Neuron index's own
packages it cannot see from here. The head node's budget in docs/operations.md comes from this output.
"""

from __future__ import annotations

import json
import re
import sys
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stacks.cluster_requirements import LOCK, NODE_PYTHON  # noqa: E402

PIN = re.compile(r"^([A-Za-z0-9_.-]+)==([^\s;]+)")
CUDA = re.compile(r"^(nvidia-|triton$)")
NEURON_INDEX_ONLY = ("torch-neuronx", "neuronx-cc", "neuronx-distributed")


def pins(lines: Iterable[str]) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for line in lines if (m := PIN.match(line.strip()))]


def wheel_size(name: str, version: str, python: str = NODE_PYTHON) -> int | None:
    """Bytes of the wheel pip picks for CPython `python` on manylinux x86_64, or the sdist's; None if none.

    From PyPI's simple index in its JSON form (PEP 691), which lists every file with its size."""
    request = urllib.request.Request(
        f"https://pypi.org/simple/{name.lower()}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    tag = "cp" + python.replace(".", "")
    normalized = re.sub(r"[-_.]+", "_", name).lower()

    def of_version(filename: str) -> bool:
        stem = re.sub(r"[-_.]+", "_", filename.lower())
        return stem.startswith(f"{normalized}_{re.sub(r'[-_.]+', '_', version.lower())}_")

    def fits(filename: str) -> bool:
        if not filename.endswith(".whl") or not of_version(filename[:-4] + "_"):
            return False
        parts = filename[:-4].split("-")
        python_tags, abi, platform = parts[-3], parts[-2], parts[-1]
        python_ok = tag in python_tags.split(".") or python_tags.startswith(("py3", "py2.py3")) or "abi3" in abi
        platform_ok = platform == "any" or ("x86_64" in platform and "linux" in platform)
        return python_ok and platform_ok

    wheels = [f["size"] for f in files if fits(f["filename"])]
    if wheels:
        return int(max(wheels))
    sdists = [f["size"] for f in files if f["filename"].endswith(".tar.gz") and of_version(f["filename"][:-7] + "_")]
    return int(sdists[0]) if sdists else None


def main() -> int:
    locked = pins(LOCK.read_text().splitlines())
    with ThreadPoolExecutor(max_workers=8) as pool:
        sizes = dict(zip(locked, pool.map(lambda pin: wheel_size(*pin), locked), strict=True))
    groups: dict[str, int] = {"CUDA libraries (nvidia-*, triton)": 0, "torch": 0, "everything else": 0}
    for (name, _), size in sizes.items():
        group = "torch" if name == "torch" else "CUDA libraries (nvidia-*, triton)" if CUDA.match(name) else None
        groups[group or "everything else"] += size or 0
    total = sum(groups.values())
    print(f"{len(locked)} pinned packages of {LOCK.relative_to(ROOT)} for CPython {NODE_PYTHON}, x86_64 Linux:")
    for group, size in groups.items():
        print(f"  {group:<36} {size / 1e9:6.2f} GB  ({size / total:.0%})")
    print(f"  {'total download from PyPI':<36} {total / 1e9:6.2f} GB")
    missing = [f"{n}=={v}" for (n, v), size in sizes.items() if size is None]
    if missing:
        print(f"  no file found for: {', '.join(missing)}")
    print(f"  not counted (Neuron's index, unreachable here): {', '.join(NEURON_INDEX_ONLY)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
