"""Checkpoint cost: hfsplit's split save / resume vs one process saving the same state with transformers.

    python scripts/bench_checkpoint.py            # ~2 minutes on 2 CPU cores
    python scripts/bench_checkpoint.py --layers 4 # quicker

A full fine-tune of a ~100M-parameter fp32 Llama (weights + AdamW moments ≈ 1.2 GB of state):
- hfsplit: the recipe under torchrun on 2 ranks (pp=2) with --save-every, then a resume from that
  checkpoint on 2 ranks as tp=2 (another split). Save time = the atomic HF-folder + trainer-state save
  as the recipe logs it (`save_s` in metrics.jsonl), resume time = `resume_s`.
- baseline: one process holding the whole model after one AdamW step, saving what a transformers user
  saves for a resumable checkpoint (`save_pretrained` + `torch.save(optimizer.state_dict())`) and reading
  it back (`from_pretrained` + `torch.load` + `load_state_dict`).
Prints a markdown table of seconds and ratios (warm page cache, local disk).
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
sys.path.insert(0, str(ROOT / "scripts"))

from bench_train import TINY_RECIPE, free_port  # noqa: E402


def recipe(model: Path, out: Path, *flags: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(ROOT / "recipes/finetune.py"), "--config", str(TINY_RECIPE), "--model", str(model), "--output-dir", str(out), "--dtype", "float32",
           "--seq-len", "64", "--micro-batches", "2", "--max-memory", "2x8GiB", "--method", "full", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def baseline(model: Path, out: Path) -> tuple[float, float]:
    """(save seconds, load seconds) of one process with transformers + torch."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    ids = torch.randint(0, net.config.vocab_size, (2, 64))
    net(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    start = time.perf_counter()
    net.save_pretrained(out / "model")
    torch.save(optimizer.state_dict(), out / "optimizer.pt")
    saved = time.perf_counter() - start
    start = time.perf_counter()
    again = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32)
    fresh = torch.optim.AdamW(again.parameters(), lr=1e-4)
    fresh.load_state_dict(torch.load(out / "optimizer.pt"))
    return saved, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    from hfsplit.checkpoint.synthetic import write_tiny_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="bench_checkpoint_"))
    model = write_tiny_checkpoint(tmp / "model", "llama", num_layers=args.layers, hidden=1024, heads=16, kv_heads=8,
                                  intermediate=2816, vocab=8192, max_positions=512)
    records = recipe(model, tmp / "split", "--pp", "2", "--max-steps", "3", "--save-every", "2")
    save_s = next(r["save_s"] for r in records if "save_s" in r)
    records = recipe(model, tmp / "moved", "--pp", "1", "--tp", "2", "--max-steps", "3",
                     "--resume", str(tmp / "split" / "checkpoint-2"))
    resume_s = next(r["resume_s"] for r in records if "resume_s" in r)
    base_save, base_load = baseline(model, tmp / "baseline")
    size = sum(f.stat().st_size for f in (tmp / "split" / "checkpoint-2").rglob("*") if f.is_file())
    print(f"checkpoint of {size / 2**30:.2f} GiB (HF model folder + trainer state)\n")
    print("| | hfsplit (2 ranks) | one process (transformers + torch.save) | ratio |")
    print("|---|---|---|---|")
    print(f"| save | {save_s:.2f} s (pp=2) | {base_save:.2f} s | {save_s / base_save:.2f}× |")
    print(f"| resume | {resume_s:.2f} s (onto tp=2, resharded) | {base_load:.2f} s | {resume_s / base_load:.2f}× |")


if __name__ == "__main__":
    main()
