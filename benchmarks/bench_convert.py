"""Checkpoint conversion: ours vs the reference approach vs `cp`, wall time and peak RSS, in one run.

    python benchmarks/bench_convert.py [--layers 4] [--tp 8] [--repeat 3] [--workdir DIR]

Generates a Llama-shaped bf16 checkpoint of more than 2 GB (Llama 3 8B widths, few layers) saved as
`pytorch_model.bin` (what the reference converter reads), then measures, each in a fresh process:

  (a) ours, HF -> NxD at --tp;            (b) reference: torch.load the whole state dict, build each
                                              rank's dict from cloned slices, torch.save per rank;
  (c) ours, NxD -> HF (safetensors);      (d) reference reverse: load every rank file, concatenate,
                                              torch.save the full state dict;
  (e) cp of the input file (the disk's limit for moving these bytes).

Before each step dirty pages are flushed, the page cache is emptied when the benchmark may (as root)
and the step's inputs are read once, so every step starts with cached inputs and free memory. The
five steps run in --repeat interleaved rounds and each step's fastest run counts (this machine's write
throughput varies from minute to minute). Prints the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def make_checkpoint(directory: Path, layers: int) -> int:
    import torch

    from training.formats.layouts import ModelSpec, hf_shapes

    config = {**CONFIG, "num_hidden_layers": layers}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator().manual_seed(0)
    state = {
        name: torch.randn(shape, generator=generator, dtype=torch.float32).to(torch.bfloat16)
        for name, shape in hf_shapes(ModelSpec.from_config(config)).items()
    }
    torch.save(state, directory / "pytorch_model.bin")
    return (directory / "pytorch_model.bin").stat().st_size


# --- the reference approach (REFERENCE.md section 5), written plainly -------------------------------------


def reference_forward(source: Path, output: Path, tp: int) -> None:
    import torch

    from training.formats.layouts import ModelSpec, Parallelism, query_head_order

    config = json.loads((source / "config.json").read_text())
    spec = ModelSpec.from_config(config)
    state = torch.load(source / "pytorch_model.bin", weights_only=True)
    order = query_head_order(spec, Parallelism(tp=tp, kv_multiplier=1))
    d = spec.head_dim
    (output / "model").mkdir(parents=True)
    for rank in range(tp):
        rank_state = {}
        for name, tensor in state.items():
            if name.endswith(("q_proj.weight",)):
                rows = torch.cat([tensor[h * d : (h + 1) * d] for h in order[rank]])
                rank_state[name.replace("q_proj.weight", "qkv_proj.weight_q")] = rows.clone()
            elif name.endswith(("k_proj.weight", "v_proj.weight")):
                key = name.replace("k_proj.weight", "qkv_proj.weight_k").replace("v_proj.weight", "qkv_proj.weight_v")
                rank_state[key] = tensor.chunk(tp, 0)[rank].clone()
            elif name.endswith("o_proj.weight"):
                rank_state[name] = torch.cat([tensor[:, h * d : (h + 1) * d] for h in order[rank]], dim=1).clone()
            elif name.endswith("gate_proj.weight"):
                up = state[name.replace("gate_proj", "up_proj")]
                gate_up = torch.cat([tensor.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]])
                rank_state[name.replace("gate_proj", "gate_up_proj")] = gate_up.clone()
            elif name.endswith("up_proj.weight"):
                continue
            elif name.endswith("down_proj.weight"):
                rank_state[name] = tensor.chunk(tp, 1)[rank].clone()
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                rank_state[name] = tensor.chunk(tp, 0)[rank].clone()
            else:
                rank_state[name] = tensor.clone()
        torch.save(rank_state, output / "model" / f"dp_rank_00_tp_rank_{rank:02d}_pp_rank_00.pt")


def reference_reverse(source: Path, output: Path, tp: int) -> None:
    import torch

    from training.formats.layouts import ModelSpec, Parallelism, query_head_order

    spec = ModelSpec.from_config(json.loads((source / "config.json").read_text()))
    ranks = [
        torch.load(source / "model" / f"dp_rank_00_tp_rank_{r:02d}_pp_rank_00.pt", weights_only=True) for r in range(tp)
    ]
    order = [h for heads in query_head_order(spec, Parallelism(tp=tp, kv_multiplier=1)) for h in heads]
    d = spec.head_dim
    full = {}
    for name in ranks[0]:
        parts = [rank[name] for rank in ranks]
        if name.endswith("weight_q"):
            stacked = torch.cat(parts)
            rows = [None] * len(order)
            for position, head in enumerate(order):
                rows[head] = stacked[position * d : (position + 1) * d]
            full[name.replace("qkv_proj.weight_q", "q_proj.weight")] = torch.cat(rows)
        elif name.endswith(("weight_k", "weight_v")):
            full[name.replace("qkv_proj.weight_k", "k_proj.weight").replace("qkv_proj.weight_v", "v_proj.weight")] = (
                torch.cat(parts)
            )
        elif name.endswith("o_proj.weight"):
            stacked = torch.cat(parts, dim=1)
            columns = [None] * len(order)
            for position, head in enumerate(order):
                columns[head] = stacked[:, position * d : (position + 1) * d]
            full[name] = torch.cat(columns, dim=1)
        elif name.endswith("gate_up_proj.weight"):
            halves = [p.chunk(2) for p in parts]
            full[name.replace("gate_up_proj", "gate_proj")] = torch.cat([h[0] for h in halves])
            full[name.replace("gate_up_proj", "up_proj")] = torch.cat([h[1] for h in halves])
        elif name.endswith("down_proj.weight"):
            full[name] = torch.cat(parts, dim=1)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            full[name] = torch.cat(parts)
        else:
            full[name] = parts[0]
    output.mkdir(parents=True)
    torch.save(full, output / "pytorch_model.bin")


# --- measurement -----------------------------------------------------------------------------------------


def settle() -> None:
    """Flush dirty pages and, when allowed (root), empty the page cache, so every step starts alike.

    Otherwise a step's speed depends on how full the cache was left by the steps before it (the kernel
    has to reclaim memory for every page written).
    """
    os.sync()
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("1\n")


def warm(*paths: Path) -> None:
    """Read the inputs of the next step once, so every step starts from cached, clean input files."""
    for path in paths:
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if file.is_file():
                with file.open("rb") as handle:
                    while handle.read(64 << 20):
                        pass


def measured(code: str, *inputs: Path) -> tuple[float, float]:
    """(seconds, peak RSS in GB) of `code` run in a fresh interpreter (VmHWM: this process alone).

    Dirty pages of earlier steps are flushed, the cache emptied if allowed, and the step's inputs read
    once beforehand, so no step pays for another's write-back or finds its input colder than another's.
    """
    settle()
    warm(*inputs)
    script = (
        "import sys, time\n"
        f"sys.path[:0] = [{str(ROOT)!r}, {str(Path(__file__).parent)!r}]\n"
        # Imports are not timed (the same for every approach); their memory stays in the peak.
        "import torch, bench_convert, training.formats.convert\n"
        f"started = time.perf_counter()\n{code}\n"
        "peak = next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM'))\n"
        "print(time.perf_counter() - started, peak)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(result.stderr)
    seconds, kilobytes = result.stdout.split()[-2:]
    return float(seconds), int(kilobytes) / 1024**2


def copy_time(source: Path, target: Path) -> float:
    """Seconds `cp` takes for the same bytes, measured like the other steps (flushed, warm input)."""
    target.unlink(missing_ok=True)
    settle()
    warm(source)
    started = time.perf_counter()
    subprocess.run(["cp", str(source), str(target)], check=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--repeat", type=int, default=3, help="rounds of all five steps; each step's fastest counts")
    arguments = parser.parse_args()
    work = arguments.workdir or Path(tempfile.mkdtemp(prefix="bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    hf, tp = work / "hf", arguments.tp
    size = make_checkpoint(hf, arguments.layers)
    print(f"checkpoint: {size / 1e9:.2f} GB bf16, {arguments.layers} layers of Llama 3 8B width; TP {tp}")
    baseline = measured("pass")

    ours_forward = (
        "from pathlib import Path\nfrom training.formats.convert import ConvertOptions, convert\n"
        f"convert(ConvertOptions(source_format='hf', target_format='nxd', input=Path({str(hf)!r}), "
        f"output=Path({str(work / 'ours-nxd')!r}), tp={tp}))"
    )
    ours_reverse = (
        "from pathlib import Path\nfrom training.formats.convert import ConvertOptions, convert\n"
        f"convert(ConvertOptions(source_format='nxd', target_format='hf', input=Path({str(work / 'ours-nxd')!r}), "
        f"output=Path({str(work / 'ours-hf')!r})))"
    )
    reference = "from pathlib import Path\nimport bench_convert as b\n"
    forward_reference = reference + f"b.reference_forward(Path({str(hf)!r}), Path({str(work / 'ref-nxd')!r}), {tp})"
    reverse_reference = (
        reference + f"b.reference_reverse(Path({str(work / 'ref-nxd')!r}), Path({str(work / 'ref-hf')!r}), {tp})"
    )
    labels = [
        "(a) ours hf -> nxd",
        "(b) reference hf -> nxd",
        "(c) ours nxd -> hf",
        "(d) reference nxd -> hf",
        "(e) cp of the same bytes",
    ]
    runs: dict[str, list[tuple[float, float]]] = {label: [] for label in labels}
    # Rounds interleave the steps, so a slow spell of this machine's disk hits every step alike; outputs
    # are deleted as soon as they are no longer needed, so page-cache pressure is the same in every round.
    for _ in range(arguments.repeat):
        for folder in ("ours-nxd", "ref-nxd", "ours-hf", "ref-hf"):
            shutil.rmtree(work / folder, ignore_errors=True)
        runs[labels[0]].append(measured(ours_forward, hf))
        runs[labels[1]].append(measured(forward_reference, hf))
        shutil.copyfile(hf / "config.json", work / "ref-nxd" / "config.json")
        runs[labels[2]].append(measured(ours_reverse, work / "ours-nxd"))
        shutil.rmtree(work / "ours-hf")
        runs[labels[3]].append(measured(reverse_reference, work / "ref-nxd"))
        shutil.rmtree(work / "ref-hf")
        runs[labels[4]].append((copy_time(hf / "pytorch_model.bin", work / "copy.bin"), float("nan")))
        (work / "copy.bin").unlink()
    rows = {
        label: (min(seconds for seconds, _ in results), max(rss for _, rss in results))
        for label, results in runs.items()
    }

    print(f"{'step':<28}{'seconds':>9}{'peak RSS GB':>13}")
    print(f"{'python + torch imported':<28}{'':>9}{baseline[1]:13.2f}")
    for label, (seconds, rss) in rows.items():
        print(f"{label:<28}{seconds:9.2f}{rss:13.2f}")
    a, b, c, d, e = (rows[k] for k in rows)
    base = baseline[1]
    for direction, ours, ref in (("hf -> nxd", a, b), ("nxd -> hf", c, d)):
        print(
            f"{direction}: {ref[0] / ours[0]:.2f}x faster than the reference (target >= 2x); "
            f"{ours[0] / e[0]:.2f}x the cp time (target <= 2x); peak RSS {ours[1] / ref[1]:.1%} of the reference's, "
            f"{(ours[1] - base) / (ref[1] - base):.1%} above the interpreter's own {base:.2f} GB (target <= 10%)"
        )
    if arguments.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
