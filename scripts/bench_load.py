"""Benchmark loading a checkpoint: time and peak host RAM, each method in a fresh process.

The two NF4 rows (QLoRA's base) compare hfsplit's block-by-block quantization with transformers'
own 4-bit `from_pretrained` (their ratio columns are against that row); "bytes held" counts
bitsandbytes' packed weights and quant state.

    python scripts/bench_load.py --size small      # ~60 MB checkpoint, < 1 minute
    python scripts/bench_load.py                   # ~2 GB bf16 Llama (hidden 2048, 16 layers, 400MB shards)

Peak RSS is the child's `ru_maxrss` as the OS reports it when the child exits
(`os.wait4`); the parent never imports torch, so children do not inherit a large peak.
"Above imports" subtracts the child's RSS after it imported the libraries and built the
meta-device model (every method does that first, untimed).
Every method touches what it loaded (CPU weights from transformers stay views of the
memory-mapped files until touched, which would hide their real cost).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SIZES = {
    # hidden, layers, heads, kv heads, intermediate, vocab, shard size
    "small": dict(hidden=512, num_layers=4, heads=8, kv_heads=8, intermediate=1408, vocab=8000, shard="20MB"),
    "default": dict(hidden=2048, num_layers=16, heads=16, kv_heads=16, intermediate=5632, vocab=32000, shard="400MB"),
}
METHODS = ("raw", "transformers", "accelerate", "hfsplit", "hfsplit_half", "hfsplit_tp2", "transformers_4bit",
           "hfsplit_4bit", "hfsplit_4bit_rank")
LABELS = {
    "raw": "raw read of shard files",
    "transformers": "transformers from_pretrained",
    "accelerate": "accelerate load_checkpoint_and_dispatch",
    "hfsplit": "hfsplit.from_pretrained (whole model)",
    "hfsplit_half": "hfsplit reader, stage 0 of 2 (half the layers)",
    "hfsplit_tp2": "hfsplit reader, TP rank 0 of 2 (read_slice)",
    "transformers_4bit": "transformers from_pretrained, NF4 (BitsAndBytesConfig)",
    "hfsplit_4bit": "hfsplit.from_pretrained, NF4, quantized block by block",
    "hfsplit_4bit_rank": "hfsplit split rank (pp=1, one gloo rank), NF4, block by block",
}


# ---- workers (run in a child process; print one JSON line) -----------------------------------


def _warm_up(ckpt: Path) -> None:
    """Import the libraries and the model's modeling code (transformers imports lazily), so that
    neither the timings nor the RAM figures count them."""
    import accelerate  # noqa: F401
    import bitsandbytes  # noqa: F401  (imported by the NF4 rows' loads, ~50 MiB of RSS: not the load's cost)
    import torch
    from transformers import AutoModelForCausalLM

    import hfsplit.load.materialize  # noqa: F401
    from hfsplit.checkpoint import load_config

    with torch.device("meta"):
        AutoModelForCausalLM.from_config(load_config(ckpt))


def _touch(tensors) -> int:
    """Sum every tensor so each page is really in memory; returns the bytes touched."""
    import torch

    total = 0
    with torch.no_grad():
        for t in tensors:
            t.sum()  # reduces in place of a float copy: no temporary as large as the tensor
            total += t.numel() * t.element_size()
    return total


def worker_write(ckpt: Path, size: str) -> dict:
    import torch

    from hfsplit.checkpoint.synthetic import tiny_config, write_checkpoint

    dims = dict(SIZES[size])
    shard = dims.pop("shard")
    config = tiny_config("llama", max_positions=4096, **dims)
    write_checkpoint(ckpt, config, dtype=torch.bfloat16, max_shard_size=shard)
    return {"bytes": sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))}


def worker_raw(ckpt: Path) -> dict:
    held = []
    for file in sorted(ckpt.glob("*.safetensors")):
        buffer = bytearray(file.stat().st_size)
        with open(file, "rb", buffering=0) as f:
            view, done = memoryview(buffer), 0
            while done < len(buffer):
                done += f.readinto(view[done:])
        held.append(buffer)
    return {"bytes": sum(len(b) for b in held)}


def worker_transformers(ckpt: Path) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt)
    return {"bytes": _touch(model.state_dict().values())}


def worker_accelerate(ckpt: Path) -> dict:
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ckpt)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    model = load_checkpoint_and_dispatch(model, str(ckpt), device_map={"": "cpu"})
    return {"bytes": _touch(model.state_dict().values())}


def _nf4():
    """QLoRA's default: NF4 + double quantization, computing in bf16 (the checkpoint's dtype)."""
    from hfsplit.apply.quantize import quantization_config

    return quantization_config(compute_dtype="bfloat16")


def worker_transformers_4bit(ckpt: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from hfsplit.apply.quantize import held_bytes

    model = AutoModelForCausalLM.from_pretrained(ckpt, quantization_config=_nf4(), device_map="cpu")
    _touch(model.state_dict().values())
    return {"bytes": held_bytes(model)}


def worker_hfsplit_4bit(ckpt: Path) -> dict:
    from hfsplit.checkpoint import load_config
    from hfsplit.load.materialize import from_pretrained
    from hfsplit.apply.quantize import held_bytes

    config = load_config(ckpt)
    model = from_pretrained(ckpt, plan=_cpu_device_map(config.num_hidden_layers), quantization_config=_nf4())
    _touch(model.state_dict().values())
    return {"bytes": held_bytes(model)}


_RANK = {}  # the split rank's plan, made before the timed load (prepare_hfsplit_4bit_rank)


def prepare_hfsplit_4bit_rank(ckpt: Path) -> None:
    """Join a one-rank gloo group and plan the QLoRA stage (untimed, like the imports)."""
    import socket

    import torch.distributed as dist

    from hfsplit.plan import TrainingSpec
    from hfsplit.planning.planner import make_plan

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      HFSPLIT_NO_CALIBRATION="1")
    dist.init_process_group("gloo")
    _RANK["plan"] = make_plan(str(ckpt), "64GiB", spec=TrainingSpec(method="qlora", seq_len=8, dtype="bfloat16"),
                              micro_batches=1, pp=1, world_size=1)


def worker_hfsplit_4bit_rank(ckpt: Path) -> dict:
    from hfsplit.load.launch import split_from_pretrained
    from hfsplit.apply.quantize import held_bytes

    model = split_from_pretrained(str(ckpt), plan=_RANK["plan"], quantization_config=_nf4())
    _touch([p for stage in model.stages for p in stage.state_dict().values()])
    return {"bytes": sum(held_bytes(stage) for stage in model.stages)}


def _cpu_device_map(num_layers: int) -> dict:
    return {"model.embed_tokens": "cpu", **{f"model.layers.{i}": "cpu" for i in range(num_layers)},
            "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}


def worker_hfsplit(ckpt: Path) -> dict:
    from hfsplit.checkpoint import load_config
    from hfsplit.load.materialize import from_pretrained

    config = load_config(ckpt)
    model = from_pretrained(ckpt, plan=_cpu_device_map(config.num_hidden_layers))
    return {"bytes": _touch(model.state_dict().values())}


def _meta(ckpt: Path):
    import torch
    from transformers import AutoModelForCausalLM

    from hfsplit.checkpoint import load_config

    config = load_config(ckpt)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def worker_hfsplit_half(ckpt: Path) -> dict:
    from hfsplit.checkpoint import CheckpointReader
    from hfsplit.load.materialize import tensor_names_of

    model = _meta(ckpt)
    half = model.config.num_hidden_layers // 2
    needed = tensor_names_of(model, ["model.embed_tokens", *(f"model.layers.{i}" for i in range(half))])
    with CheckpointReader.open(ckpt, needed=needed, model=model) as reader:
        held = [reader.read(name) for name in sorted(needed)]
        shards = len(reader.shards_for(needed))
    return {"bytes": _touch(held), "shards": shards}


# Megatron-style split, as transformers' base_model_tp_plan for Llama: colwise → rows of the
# weight (dim 0), rowwise → columns (dim 1); embeddings and lm_head split over the vocabulary.
_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
_ROWWISE = ("o_proj", "down_proj")


def worker_hfsplit_tp2(ckpt: Path) -> dict:
    from hfsplit.checkpoint import CheckpointReader

    model = _meta(ckpt)
    held = []
    with CheckpointReader.open(ckpt, model=model) as reader:
        for name in model.state_dict():
            module = name.rsplit(".", 2)[-2]
            if module in _COLWISE:
                held.append(reader.read_slice(name, dim=0, index=0, parts=2))
            elif module in _ROWWISE:
                held.append(reader.read_slice(name, dim=1, index=0, parts=2))
            else:  # norms: replicated
                held.append(reader.read(name))
    return {"bytes": _touch(held)}


def run_worker(method: str, ckpt: Path, size: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    if method != "write":
        _warm_up(ckpt)
    if f"prepare_{method}" in globals():
        globals()[f"prepare_{method}"](ckpt)
    warm_rss = _current_rss()
    start = time.perf_counter()
    if method == "write":
        result = worker_write(ckpt, size)
    else:
        result = globals()[f"worker_{method}"](ckpt)
    result["seconds"] = time.perf_counter() - start
    result["warm_rss"] = warm_rss
    print(json.dumps(result))


def _current_rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


# ---- parent -------------------------------------------------------------------------------


def measure(method: str, ckpt: Path, size: str) -> dict:
    """Run one method in a fresh process; its result plus the OS's peak RSS of that process."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    child = subprocess.Popen([sys.executable, __file__, "--worker", method, "--ckpt", str(ckpt), "--size", size],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # wait4 rather than communicate: it returns the child's own rusage (ru_maxrss in KiB on Linux).
    out_text = child.stdout.read()
    err_text = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"{method} failed:\n{err_text[-3000:]}")
    result = json.loads(out_text.strip().splitlines()[-1])
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    result["peak_rss"] = usage.ru_maxrss * scale
    return result


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def table(results: dict[str, dict]) -> str:
    ref = results["transformers"]
    ref_above = max(ref["peak_rss"] - ref["warm_rss"], 1)
    lines = [
        "| method | time (s) | peak RSS (MiB) | above imports (MiB) | bytes held (MiB) | time vs transformers | RAM above imports vs transformers |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for method, label in LABELS.items():
        r = results[method]
        if method.endswith("_4bit") and "transformers_4bit" in results:  # 4-bit rows against transformers' 4-bit load
            ref = results["transformers_4bit"]
            ref_above = max(ref["peak_rss"] - ref["warm_rss"], 1)
        above = r["peak_rss"] - r["warm_rss"]
        lines.append(
            f"| {label} | {r['seconds']:.2f} | {mib(r['peak_rss'])} | {mib(above)} | {mib(r['bytes'])} | "
            f"{r['seconds'] / ref['seconds']:.2f}× | {above / ref_above:.2f}× |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--keep", action="store_true", help="print the checkpoint folder and keep it")
    parser.add_argument("--ckpt", type=Path, help="checkpoint folder (written there when empty or absent)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args.worker, args.ckpt, args.size)
        return

    with tempfile.TemporaryDirectory(prefix="hfsplit-bench-") as tmp:
        scratch = Path(tempfile.mkdtemp(prefix="hfsplit-bench-")) if args.keep else Path(tmp)
        ckpt = args.ckpt or scratch / f"llama-{args.size}"
        if not (ckpt.exists() and any(ckpt.glob("*.safetensors"))):
            written = measure("write", ckpt, args.size)
            print(f"wrote {mib(written['bytes'])} MiB checkpoint to {ckpt} in {written['seconds']:.1f} s", flush=True)
        methods = [m for m in args.methods.split(",") if m]
        if "transformers" not in methods:
            methods.append("transformers")  # the reference for the ratios
        results = {}
        for method in methods:
            results[method] = measure(method, ckpt, args.size)
            print(f"{method}: {results[method]['seconds']:.2f} s, peak {mib(results[method]['peak_rss'])} MiB",
                  file=sys.stderr, flush=True)
        shards = len(list(ckpt.glob("*.safetensors")))
        print(f"\ncheckpoint: {ckpt.name}, {shards} shard(s), "
              f"{mib(sum(f.stat().st_size for f in ckpt.glob('*.safetensors')))} MiB bf16\n")
        for label_method in list(LABELS):
            if label_method not in results:
                LABELS.pop(label_method)
        print(table(results))
        if args.keep:
            print(f"\ncheckpoint kept in {ckpt}")


if __name__ == "__main__":
    main()
