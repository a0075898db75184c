"""Benchmark: per-rank peak memory of a pp=2 split vs one process, forward latency and greedy generation.

Writes a random Llama checkpoint (a few hundred MB; `--small`: a few MB), then
  1. one process: transformers `from_pretrained` + forward,
  2. two CPU ranks under torchrun: `split_from_pretrained(..., pp=2)` + forward through the pipeline,
and prints per-process peak RSS (after imports, after load, after forward), the median forward
latency, and the time per generated token (16-token prompts, 32 new tokens, KV cache on both sides).

    python scripts/bench_split.py --small
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 32


def import_everything() -> None:
    """Import what loading will import, so the 'imports' baseline holds it and '+load' is weights."""
    import transformers.masking_utils  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401  (transformers imports model classes lazily)

    import hfsplit.checkpoint.reader  # noqa: F401
    import hfsplit.load.launch  # noqa: F401  (the split model and what it imports)
    import hfsplit.planning.planner  # noqa: F401


def current_rss_mib() -> float:
    """This process's resident set size now, in MiB (the baseline: import peaks may since have been freed)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    """This process's peak resident set size so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def model_size(small: bool) -> dict:
    """Config overrides for the benchmark checkpoint."""
    if small:
        return dict(num_layers=4, hidden=256, heads=8, kv_heads=4, intermediate=688, vocab=4096)
    return dict(num_layers=8, hidden=1024, heads=16, kv_heads=8, intermediate=2816, vocab=32000)


def median_latency_s(run, *, repeats: int) -> float:
    """Median wall time of `run()` over `repeats` calls after one warm-up."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def single_process(checkpoint: str, *, batch: int, seq: int, repeats: int) -> dict:
    """Load with transformers in one process and time a forward."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # same per-process threads as each pipeline rank
    import_everything()
    imported = current_rss_mib()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    for p in model.parameters():  # from_pretrained leaves mmapped views: touch them so RSS is real
        p.data.add_(0)
    loaded = peak_rss_mib()
    ids = torch.randint(3, model.config.vocab_size, (batch, seq))
    with torch.no_grad():
        latency = median_latency_s(lambda: model(ids), repeats=repeats)
    prompt = ids[:, :16]
    generated = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, attention_mask=torch.ones_like(prompt))
    per_token = median_latency_s(lambda: model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False,
                                                        attention_mask=torch.ones_like(prompt)), repeats=repeats)
    return {"rank": "single", "imported_mib": imported, "loaded_mib": loaded, "forward_mib": peak_rss_mib(),
            "latency_s": latency, "token_s": per_token / (generated.shape[1] - 16)}


def split_worker(checkpoint: str, *, batch: int, seq: int, repeats: int) -> None:
    """Inside a torchrun rank: load this rank's stage, time forwards, rank 0 prints all ranks' figures."""
    import torch
    import torch.distributed as dist

    from hfsplit.plan import TrainingSpec
    from hfsplit.load.launch import split_from_pretrained

    torch.set_num_threads(1)
    import_everything()
    imported = current_rss_mib()
    model = split_from_pretrained(checkpoint, "2x8GiB", spec=TrainingSpec(method="inference", seq_len=seq,
                                  micro_batch_size=max(1, batch // 2), dtype="float32"), micro_batches=2, pp=2, tp=1, dp=1)
    loaded = peak_rss_mib()
    ids = torch.randint(3, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    latency = median_latency_s(lambda: model(ids, broadcast=True), repeats=repeats)
    prompt = ids[:, :16]
    generated = model.generate(prompt, max_new_tokens=NEW_TOKENS)
    per_token = median_latency_s(lambda: model.generate(prompt, max_new_tokens=NEW_TOKENS), repeats=repeats)
    row = {"rank": dist.get_rank(), "imported_mib": imported, "loaded_mib": loaded, "forward_mib": peak_rss_mib(),
           "latency_s": latency, "token_s": per_token / (generated.shape[1] - 16)}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    dist.destroy_process_group()


def run_split(checkpoint: str, *, batch: int, seq: int, repeats: int) -> list[dict]:
    """Two CPU ranks under torchrun running `split_worker`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           __file__, "--worker", checkpoint, "--batch", str(batch), "--seq", str(seq), "--repeats", str(repeats)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"split run failed:\n{out.stdout[-3000:]}\n{out.stderr[:4000]}")


def run_single(checkpoint: str, *, batch: int, seq: int, repeats: int) -> dict:
    """`single_process` in a fresh interpreter so its peak RSS is its own."""
    cmd = [sys.executable, __file__, "--single", checkpoint, "--batch", str(batch), "--seq", str(seq),
           "--repeats", str(repeats)]
    out = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"single-process run failed:\n{out.stderr[-3000:]}")


def free_port() -> int:
    """A TCP port free right now (torchrun's static rendezvous needs a real one, not 0)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkpoint_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="a few-MB model: runs in seconds")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--single", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return split_worker(args.worker, batch=args.batch, seq=args.seq, repeats=args.repeats)
    if args.single:
        print("RESULT " + json.dumps(single_process(args.single, batch=args.batch, seq=args.seq, repeats=args.repeats)))
        return

    from hfsplit.checkpoint.synthetic import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_checkpoint(Path(tmp) / "bench", "llama", **model_size(args.small))
        print(f"checkpoint: {checkpoint_mib(folder):.0f} MiB fp32, batch {args.batch} × seq {args.seq}")
        rows = [run_single(str(folder), batch=args.batch, seq=args.seq, repeats=args.repeats)]
        rows += run_split(str(folder), batch=args.batch, seq=args.seq, repeats=args.repeats)
    print("peak RSS above the RSS after imports (Linux ru_maxrss, /proc/self/statm)")
    print(f"{'process':>8}  {'imports MiB':>11}  {'+load MiB':>9}  {'+forward MiB':>12}  {'forward ms':>10}  "
          f"{'generate ms/token':>17}")
    for r in rows:
        print(f"{r['rank']!s:>8}  {r['imported_mib']:11.0f}  {r['loaded_mib'] - r['imported_mib']:9.0f}  "
              f"{r['forward_mib'] - r['imported_mib']:12.0f}  {1e3 * r['latency_s']:10.1f}  {1e3 * r['token_s']:17.1f}")


if __name__ == "__main__":
    main()
