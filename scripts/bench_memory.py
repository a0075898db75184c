"""Memory of one real training step on SmolLM2-135M-Instruct (fp32, one rank): plan / hfsplit / transformers side by side.

    python scripts/bench_memory.py                          # LoRA and full, seq 512 x micro-batch 4 (~10 min on 2 cores)
    python scripts/bench_memory.py --methods lora --seq-len 256 --micro-batch-size 2
    python scripts/bench_memory.py --malloc                 # and transformers under a fixed glibc mmap threshold

Each row runs in a fresh process and takes two optimizer steps (the second is measured: AdamW's moments exist).
Columns:
- "live": weights + optimizer state held when the step starts, plus the peak of the tensors the step creates
  (counted by the cost model's own dispatch-mode counter, `hfsplit.planning.costs.trace.LiveBytes`). This is the figure the
  plan predicts (on a GPU it is the allocator's `max_memory_allocated`).
- "RSS": the process's peak resident set (VmHWM) minus its RSS once it had imported the libraries.
The plan row is `make_plan`'s stage total for the same spec (reserve 0 on CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
GIB = 1024 ** 3
# A fixed threshold turns glibc's dynamic one off: every block over 64 KiB is its own mmap, unmapped on free.
# hfsplit's CPU ranks set it themselves when asked (hfsplit/parallel/host_memory.py).
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "65536"}
HFSPLIT_FIXED = {"HFSPLIT_MMAP_THRESHOLD": "65536"}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _child(runner: str, method: str, seq_len: int, micro_batch_size: int) -> dict:
    import torch

    import hfsplit.training.trainer  # noqa: F401  (import everything first: the baseline)
    import peft  # noqa: F401
    import transformers  # noqa: F401
    from hfsplit.checkpoint.smollm2 import smollm2_checkpoint

    torch.set_num_threads(1)
    checkpoint = str(smollm2_checkpoint())
    base_kib = _status_kib("VmRSS")
    step, params, optimizer, plan = (_hfsplit_step if runner == "hfsplit" else _transformers_step)(
        checkpoint, method, seq_len, micro_batch_size)
    from hfsplit.planning.costs.trace import LiveBytes as _LiveBytes

    step()  # AdamW state now exists
    held = sum(p.untyped_storage().nbytes() for p in {id(p): p for p in params}.values())
    held += sum(t.untyped_storage().nbytes() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.dim())
    start = time.perf_counter()
    with _LiveBytes() as live:
        step()
    return {"step_s": time.perf_counter() - start, "live": held + live.peak, "step_peak": live.peak, "held": held,
            "rss": (_status_kib("VmHWM") - base_kib) * 1024, "plan": plan}


def _options(checkpoint: str, method: str, seq_len: int, micro_batch_size: int):
    from hfsplit.training.data import bundled_dataset_path
    from hfsplit.training.options import tiny_demo_options

    return tiny_demo_options(model=checkpoint, method=method, seq_len=seq_len, micro_batch_size=micro_batch_size,
                           micro_batches=1, max_steps=2, pp=1, tp=1, dtype="float32", warmup_steps=0,
                           activation_checkpointing=False, dataset=str(bundled_dataset_path("tiny_text.txt")),
                           dataset_format="text", output_dir=str(REPO_ROOT / "runs" / "bench_memory"))


def _hfsplit_step(checkpoint: str, method: str, seq_len: int, micro_batch_size: int):
    from hfsplit.training.run import build_run
    from hfsplit.training.trainer import train_step

    run = build_run(_options(checkpoint, method, seq_len, micro_batch_size), progress=False)
    batch = next(run.batches)
    m = run.model.plan.stages[0].memory
    plan = {"total": m.total, "activations": m.activations, "workspace": m.workspace}
    return (lambda: train_step(run, batch)), list(run.model.parameters()), run.optimizer, plan


def _transformers_step(checkpoint: str, method: str, seq_len: int, micro_batch_size: int):
    """The plain loop a user writes: the same rows, LoRA config and AdamW, model(ids, labels=ids)."""
    import torch
    from transformers import AutoModelForCausalLM

    options = _options(checkpoint, method, seq_len, micro_batch_size)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    for p in model.parameters():
        p.data = p.data.clone()  # CPU weights are views of the mmapped shards: make them ordinary memory, as hfsplit's
    if method == "lora":
        from peft import get_peft_model

        from hfsplit.apply.lora import lora_config

        model = get_peft_model(model, lora_config(r=options.lora_r, alpha=options.lora_alpha, dropout=0.0,
                                                  targets=None, model_config=model.config))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=options.learning_rate, weight_decay=options.weight_decay)
    ids = torch.randint(3, model.config.vocab_size, (micro_batch_size, seq_len), generator=torch.Generator().manual_seed(0))

    def step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, options.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, list(model.parameters()), optimizer, None


def _run_child(runner: str, method: str, args, env_extra: dict) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env_extra,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, __file__, "--child", runner, method, "--seq-len", str(args.seq_len),
           "--micro-batch-size", str(args.micro_batch_size)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"bench_memory: the {runner} {method} row failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="lora,full")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--malloc", action="store_true", help="add a transformers row under " + str(FIXED_MMAP))
    parser.add_argument("--child", nargs=2, metavar=("RUNNER", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(*args.child, args.seq_len, args.micro_batch_size)))
        return
    rows = [("hfsplit", "hfsplit", {}), ("hfsplit", "hfsplit, HFSPLIT_MMAP_THRESHOLD=65536", HFSPLIT_FIXED),
            ("transformers", "transformers + peft", {})]
    if args.malloc:
        rows.append(("transformers", "transformers, fixed mmap threshold", FIXED_MMAP))
    print(f"SmolLM2-135M, fp32, one rank, seq {args.seq_len} x micro-batch {args.micro_batch_size}, "
          "1 micro-batch, checkpointing off; GiB")
    print(f"{'method':6} {'row':34} {'live':>7} {'RSS':>7} {'RSS/live':>8} {'live/plan':>9} {'step s':>7}")
    for method in args.methods.split(","):
        plan = None
        for runner, label, env in rows:
            r = _run_child(runner, method, args, env)
            if plan is None:
                plan = r["plan"]
                print(f"{method:6} {'plan (stage total)':34} {plan['total'] / GIB:7.2f} {'':>7} {'':>8} "
                      f"{'':>9}  (activations {plan['activations'] / GIB:.2f})")
            print(f"{method:6} {label:34} {r['live'] / GIB:7.2f} {r['rss'] / GIB:7.2f} "
                  f"{r['rss'] / r['live']:8.2f} {r['live'] / plan['total']:9.2f} {r['step_s']:7.1f}", flush=True)


if __name__ == "__main__":
    main()
