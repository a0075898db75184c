"""One-GPU check of the plan against the run (issue 10, item 7): `python scripts/gpu_check.py`.

For a synthetic Llama of about 1B parameters in bf16 it prints
  - the CUDA allocator peak of one hfsplit training run vs the plan, for LoRA and full × activation
    checkpointing on and off (target ±10%),
  - tokens/s of hfsplit's one-rank run vs a plain transformers + peft loop on the same GPU (target ≥0.95×),
  - seconds to load onto the GPU: `hfsplit.from_pretrained` vs `transformers.from_pretrained(device_map="cuda")`,
  - headroom (issue 21): the CUDA peak of LoRA with offloaded checkpointing vs the plan (and the host bytes the
    offload held vs the plan's), its step time vs checkpointing on the device (target ≤1.10×), and the peak of full
    fine-tuning with bitsandbytes' 8-bit AdamW vs the plan,
  - long context (issue 30): the CUDA peak of LoRA at seq 16384 (micro-batch 1, checkpointed blocks, the MLP tiled
    over the sequence, the chunked loss) vs the plan (target ±15%), and its tokens/s.
Without a GPU it prints one line and exits 0. `--device cpu --tiny` runs every part on CPU with a tiny
model (the test suite does), where "peak" is the process's peak RSS above its own baseline after imports.

Each measurement runs in a child process of its own, so one run's allocator peak never leaks into the next.
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

ROOT = Path(__file__).resolve().parents[1]
# About 1.1B parameters (TinyLlama's shape): 22 blocks, hidden 2048, GQA 32/4 heads.
LLAMA_1B = dict(num_layers=22, hidden=2048, heads=32, kv_heads=4, intermediate=5632, vocab=32000,
                max_positions=16384)  # the long-context row's sequence
TINY = dict(num_layers=4, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256, max_positions=512)
SHAPES = {False: dict(seq_len=1024, micro_batch_size=2, micro_batches=2, steps=6),
          True: dict(seq_len=32, micro_batch_size=2, micro_batches=2, steps=3)}
LONG = {False: dict(seq_len=16384, micro_batch_size=1, micro_batches=1, steps=3),  # issue 30's long-context row
        True: dict(seq_len=256, micro_batch_size=1, micro_batches=1, steps=3)}


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(_child(json.loads(args.child))), flush=True)
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA GPU on this machine; nothing measured (use --device cpu --tiny to test the code path)")
            return 0
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        checkpoint = _write_model(Path(tmp) / "model", tiny=args.tiny)
        shape = SHAPES[args.tiny]
        job = dict(checkpoint=str(checkpoint), device=args.device, out=str(Path(tmp) / "runs"), **shape)
        # each table printed once its runs are done: a later run's failure keeps the earlier tables
        rows = [_run_child(dict(job, kind="hfsplit", method=m, ckpt=c)) for m in ("lora", "full") for c in (False, True)]
        plain = _run_child(dict(job, kind="plain"))
        loads = {kind: _run_child(dict(job, kind=kind)) for kind in ("load_hfsplit", "load_transformers")}
        print(report(rows, plain=plain, loads=loads, tiny=args.tiny, device=args.device), flush=True)
        long = _run_child(dict(job, **LONG[args.tiny], kind="hfsplit", method="lora", ckpt=True, tiled=True,
                               chunked=True))
        print(long_context_report(long, device=args.device), flush=True)
        headroom = [_run_child(dict(job, kind="hfsplit", method=m, ckpt=c, optim=o))
                    for m, c, o in (("lora", "offload", "adamw_torch"), ("full", True, "adamw_8bit"))]
        print(headroom_report(headroom, on=next(r for r in rows if r["method"] == "lora" and r["ckpt"]),
                              device=args.device), flush=True)
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 4-layer hidden-64 Llama instead of the 1B one")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def _write_model(folder: Path, *, tiny: bool) -> Path:
    import torch

    from hfsplit.checkpoint.synthetic import tiny_config, write_checkpoint

    config = tiny_config("llama", **(TINY if tiny else LLAMA_1B))
    return write_checkpoint(folder, config, max_shard_size="2GB", dtype=torch.float32 if tiny else torch.bfloat16)


def _run_child(job: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # one rank, no launcher
        env.pop(name, None)
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], env=env, capture_output=True,
                          text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"gpu_check: the {job['kind']} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _child(job: dict) -> dict:
    import torch

    torch.manual_seed(0)
    dtype = "float32" if job["device"] == "cpu" else "bfloat16"
    if job["kind"] == "hfsplit":
        return _hfsplit_run(job, dtype=dtype)
    if job["kind"] == "plain":
        return _plain_run(job, dtype=dtype)
    return _load_run(job, dtype=dtype)


def _rows(job: dict, vocab: int):
    import torch

    from hfsplit.training.data import TokenRows

    ids = torch.randint(3, vocab, (job["micro_batch_size"] * job["micro_batches"] * (job["steps"] + 1), job["seq_len"]),
                        generator=torch.Generator().manual_seed(0))
    return TokenRows(ids, ids.clone())


def _baseline(device: str) -> int:
    """Bytes already held before the run: the CUDA allocator's (reset) or this process's current RSS."""
    import psutil
    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return int(torch.cuda.memory_allocated())
    return psutil.Process().memory_info().rss


def _hfsplit_run(job: dict, *, dtype: str) -> dict:
    from hfsplit.checkpoint import load_config
    from hfsplit.checkpoint.synthetic import TINY_TOKENIZER_DIR
    from hfsplit.training.batches import MicroBatches
    from hfsplit.training.data import bundled_dataset_path
    from hfsplit.training.options import tiny_demo_options
    from hfsplit.training.metrics import peak_memory_bytes
    from hfsplit.training.run import build_run
    from hfsplit.training.trainer import train_step

    options = tiny_demo_options(model=job["checkpoint"], method=job["method"], activation_checkpointing=job["ckpt"],
                                optim=job.get("optim", "adamw_torch"), tiled_mlp=job.get("tiled", False),
                                chunked_loss=job.get("chunked", False),
                              seq_len=job["seq_len"], micro_batch_size=job["micro_batch_size"],
                              micro_batches=job["micro_batches"], max_steps=job["steps"], dtype=dtype, pp=1, tp=1,
                              warmup_steps=0, tokenizer=str(TINY_TOKENIZER_DIR),  # the rows are replaced below
                              dataset=str(bundled_dataset_path("tiny_text.txt")), dataset_format="text",
                              output_dir=str(Path(job["out"]) / f"{job['method']}-{job['ckpt']}"))
    base = _baseline(job["device"])
    run = build_run(options, progress=False)
    # The same random rows as the plain loop, so both runs see identical shapes and tokens.
    run.batches = MicroBatches(_rows(job, load_config(job["checkpoint"]).vocab_size),
                               micro_batch_size=job["micro_batch_size"], num_micro_batches=job["micro_batches"], seed=0)
    outcomes = [train_step(run, next(run.batches)) for _ in range(job["steps"])]
    seconds = [o.seconds for o in outcomes]
    timed = seconds[1:] or seconds  # the first step builds the schedule
    peak = peak_memory_bytes(run.model.device) - (base if job["device"] == "cpu" else 0)
    tokens = job["micro_batch_size"] * job["micro_batches"] * job["seq_len"]
    stage = run.model.plan.stages[0]
    return {"method": job["method"], "ckpt": job["ckpt"], "peak": peak, "plan": stage.memory.total,
            "tokens_per_s": tokens * len(timed) / sum(timed), "optim": stage.optim,
            "offload_plan": stage.memory.offload, "offload": outcomes[-1].offload_bytes, "seq_len": job["seq_len"],
            "tiles": run.model.plan.tiled_mlp_of(stage)}


def _plain_run(job: dict, *, dtype: str) -> dict:
    """The loop a user writes by hand: transformers + peft LoRA on the same targets, AdamW, accumulation."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from hfsplit.apply.lora import lora_config

    model = AutoModelForCausalLM.from_pretrained(job["checkpoint"], dtype=getattr(torch, dtype), device_map=job["device"])
    model = get_peft_model(model, lora_config(r=8, alpha=16, dropout=0.0, targets=None, model_config=model.config))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    rows, m, size = _rows(job, model.config.vocab_size), job["micro_batches"], job["micro_batch_size"]
    times = []
    for step in range(job["steps"]):
        _sync(job["device"])
        start = time.perf_counter()
        for k in range(m):
            ids = rows.input_ids[(step * m + k) * size:(step * m + k + 1) * size].to(job["device"])
            (model(input_ids=ids, labels=ids).loss / m).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(job["device"])
        times.append(time.perf_counter() - start)
    timed = times[1:] or times  # the first step warms up, as in hfsplit's figure
    return {"tokens_per_s": m * size * job["seq_len"] / (sum(timed) / len(timed))}


def _load_run(job: dict, *, dtype: str) -> dict:
    import torch

    from transformers import AutoModelForCausalLM

    import hfsplit  # imports stay outside the timed part: both sides pay them once per process

    _sync(job["device"])
    start = time.perf_counter()
    if job["kind"] == "load_hfsplit":
        budget = {"cpu": "64GiB"} if job["device"] == "cpu" else {0: "100GiB"}
        model = hfsplit.from_pretrained(job["checkpoint"], max_memory=budget, dtype=getattr(torch, dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(job["checkpoint"], dtype=getattr(torch, dtype),
                                                     device_map=job["device"])
    _touch(model)
    _sync(job["device"])
    return {"seconds": time.perf_counter() - start}


def _touch(model) -> None:
    """Read every weight once: CPU loads may leave weights as views of the mmapped files (untouched pages)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.sum()


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def report(rows: list[dict], *, plain: dict, loads: dict, tiny: bool, device: str) -> str:
    """The printed table (plain text; its figures go to the docs pages that await them, docs/guides/memory.md)."""
    gib = 2 ** 30
    model = "tiny Llama (4 layers, hidden 64)" if tiny else "synthetic Llama 1.1B (22 layers, hidden 2048)"
    what = "peak RSS above baseline" if device == "cpu" else "CUDA allocator peak"
    lines = [f"gpu_check on {device}: {model}, {'fp32' if device == 'cpu' else 'bf16'}, one rank",
             f"{'method':<6} {'ckpt':<5} {'plan GiB':>9} {what + ' GiB':>28} {'ratio':>6}  tokens/s"]
    for r in rows:
        ratio = r["peak"] / r["plan"] if r["plan"] else float("nan")
        lines.append(f"{r['method']:<6} {'on' if r['ckpt'] else 'off':<5} {r['plan'] / gib:>9.3f} "
                     f"{r['peak'] / gib:>28.3f} {ratio:>6.2f}  {r['tokens_per_s']:.0f}")
    ours = next(r for r in rows if r["method"] == "lora" and not r["ckpt"])["tokens_per_s"]
    lines.append(f"LoRA tokens/s: hfsplit {ours:.0f} vs transformers + peft {plain['tokens_per_s']:.0f} "
                 f"= {ours / plain['tokens_per_s']:.2f}× (target ≥0.95×)")
    lines.append(f"load onto {device}: hfsplit.from_pretrained {loads['load_hfsplit']['seconds']:.2f} s vs "
                 f"transformers.from_pretrained(device_map={device!r}) {loads['load_transformers']['seconds']:.2f} s")
    return "\n".join(lines)


def headroom_report(rows: list[dict], *, on: dict, device: str) -> str:
    """Issue 21's rows: offloaded checkpointing's device peak and host bytes against the plan, its step time against
    checkpointing on the device (the `on` row), and the 8-bit optimizer's peak against the plan."""
    gib, mib = 2 ** 30, 2 ** 20
    what = "peak RSS above baseline" if device == "cpu" else "CUDA allocator peak"
    lines = ["headroom (issue 21):", f"{'method':<6} {'ckpt':<8} {'optim':<11} {'plan GiB':>9} {what + ' GiB':>28} "
             f"{'ratio':>6}  {'host MiB plan/measured':>22}"]
    for r in rows:
        ckpt = {True: "on", False: "off"}.get(r["ckpt"], r["ckpt"])
        lines.append(f"{r['method']:<6} {ckpt:<8} {r['optim']:<11} {r['plan'] / gib:>9.3f} {r['peak'] / gib:>28.3f} "
                     f"{r['peak'] / r['plan']:>6.2f}  {r['offload_plan'] / mib:>10.1f} / {r['offload'] / mib:<9.1f}")
    offload = next(r for r in rows if r["ckpt"] == "offload")
    lines.append(f"offload step time vs checkpointing on the device: {on['tokens_per_s'] / offload['tokens_per_s']:.2f}× "
                 f"(target ≤1.10×; {offload['tokens_per_s']:.0f} vs {on['tokens_per_s']:.0f} tokens/s)")
    return "\n".join(lines)


def long_context_report(row: dict, *, device: str) -> str:
    """Issue 30's row: LoRA at a long sequence with the MLP tiled and the chunked loss, its peak against the plan."""
    gib = 2 ** 30
    what = "peak RSS above baseline" if device == "cpu" else "CUDA allocator peak"
    return (f"long context (issue 30): LoRA seq {row['seq_len']}, MLP in {row['tiles']} tiles, chunked loss: plan "
            f"{row['plan'] / gib:.3f} GiB, {what} {row['peak'] / gib:.3f} GiB, ratio {row['peak'] / row['plan']:.2f} "
            f"(target 0.85-1.15), {row['tokens_per_s']:.0f} tokens/s")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
