"""Training throughput: pipeline schedules vs one process vs sequential model parallelism.

    python scripts/bench_train.py            # ~3 minutes on 2 CPU cores
    python scripts/bench_train.py --steps 6  # quicker
    python scripts/bench_train.py --rows qlora --steps 6  # only the QLoRA rows (NF4 base, LoRA r=8; each schedule and auto)

Every run trains the same model on the same global batch (micro-batch size × micro-batches)
with one thread per rank, launched by torchrun exactly as users launch the recipe:
- one process holding the whole model (pp=1, gradient accumulation over the same micro-batches);
- pp=2 with 1F1B, GPipe, interleaved 1F1B and ZBV zero-bubble, m=8;
- sequential model parallelism on the same two ranks, as `device_map` training runs it: the
  whole batch as ONE micro-batch, so one stage works while the other waits;
- "hfsplit auto": pp=2, m=8, the schedule left to `--schedule auto` (the calibrated time model); and with
  `--global-batch 16` instead of m=8, the micro-batch cut left to it too (size × count, printed after the schedule).
Then the auto row's ratio to the best hand-picked pp=2 row and to sequential model parallelism,
and each run's estimated step next to its measured median (the recipe's "time model" line).
Prints a markdown table of tokens/s (median step, first step excluded), ratios, and the
measured bubble next to `(p-1)/(m+p-1)`; "cache ×r" marks a run whose busy time was r× the estimate, beyond
`probes.RECHECK_FACTOR`, which replaced the cached FLOP/s with its own rate for the rows after it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "hfsplit/training/bundled/tiny.yaml"  # the built-in demo's values, for tiny checkpoints


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(model: Path, out: Path, *, ranks: int, steps: int, **options) -> dict:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
           str(free_port()), str(ROOT / "recipes/finetune.py"), "--config", str(TINY_RECIPE), "--model", str(model), "--output-dir", str(out),
           "--max-steps", str(steps), "--dtype", "float32", "--seq-len", "256", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records[1:] if "tokens_per_s" in r]
    bubble = re.search(r"bubble measured ([\d.]+)% \(theory ([\d.]+)%\)", proc.stdout)
    model_line = re.search(r"estimated step ([\d.]+) ms, measured median ([\d.]+) ms", proc.stdout)
    chosen = re.search(r"schedule (\S+)\n", proc.stdout)
    recheck = re.search(r"measured busy time was ([\d.]+)× the estimate", proc.stdout)
    cut = re.search(r"micro-batches auto cut \d+ rows per replica as (\d+ × \d+)", proc.stdout)
    # the median step: single steps on 2 shared cores swing ±15%, and one slow step would move a mean
    return {"tokens_per_s": statistics.median(rates), "bubble": float(bubble.group(1)) if bubble else float("nan"),
            "theory": float(bubble.group(2)) if bubble else float("nan"),
            "estimate_ms": float(model_line.group(1)) if model_line else float("nan"),
            "measured_ms": float(model_line.group(2)) if model_line else float("nan"),
            "recheck": f" (cache ×{recheck.group(1)})" if recheck else "",
            "schedule": chosen.group(1) + (f", {cut.group(1)}" if cut else "") if chosen else "?"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rows", choices=("all", "full", "qlora"), default="all",
                        help="full fine-tuning rows, QLoRA rows (NF4 base + LoRA r=8), or both")
    args = parser.parse_args()
    from hfsplit.checkpoint.synthetic import write_tiny_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="bench_train_"))
    model = write_tiny_checkpoint(tmp / "model", "llama", num_layers=8, hidden=256, heads=8, kv_heads=4,
                                  intermediate=768, vocab=256, max_positions=512)
    common = dict(method="full", micro_batch_size=2, max_memory="2x8GiB")
    cases = [
        ("one process, whole model", 1, dict(pp=1, micro_batches=8, max_memory="8GiB")),
        ("pp=2 1F1B m=8", 2, dict(pp=2, micro_batches=8, schedule="1F1B")),
        ("pp=2 GPipe m=8", 2, dict(pp=2, micro_batches=8, schedule="GPipe")),
        ("pp=2 Interleaved1F1B m=8", 2, dict(pp=2, micro_batches=8, schedule="Interleaved1F1B")),
        ("pp=2 ZBVZeroBubble m=8", 2, dict(pp=2, micro_batches=8, schedule="ZBVZeroBubble")),
        ("sequential model parallel (device_map style)", 2, dict(pp=2, micro_batches=1, micro_batch_size=16, schedule="GPipe")),
        ("hfsplit auto m=8", 2, dict(pp=2, micro_batches=8, schedule="auto")),
        # the same 16 rows per step, the cut (micro-batch size ≤ 2 × count) left to the time model too
        ("hfsplit auto --global-batch 16", 2, dict(pp=2, global_batch=16, schedule="auto")),
    ]
    qlora = dict(method="qlora", lora_r=8)
    qlora_cases = [  # the same three set-ups with a 4-bit frozen base (how accelerate's device_map runs QLoRA)
        ("QLoRA one process", 1, dict(qlora, pp=1, micro_batches=8, max_memory="8GiB")),
        ("QLoRA pp=2 1F1B m=8", 2, dict(qlora, pp=2, micro_batches=8, schedule="1F1B")),
        ("QLoRA pp=2 Interleaved1F1B m=8", 2, dict(qlora, pp=2, micro_batches=8, schedule="Interleaved1F1B")),
        ("QLoRA pp=2 ZBVZeroBubble m=8", 2, dict(qlora, pp=2, micro_batches=8, schedule="ZBVZeroBubble")),
        ("QLoRA pp=2 auto m=8", 2, dict(qlora, pp=2, micro_batches=8, schedule="auto")),
        ("QLoRA sequential model parallel (device_map style)", 2,
         dict(qlora, pp=2, micro_batches=1, micro_batch_size=16, schedule="GPipe")),
    ]
    cases = {"all": cases + qlora_cases, "full": cases, "qlora": qlora_cases}[args.rows]
    results = {}
    for name, ranks, opts in cases:
        options = {**common, **opts}
        results[name] = run(model, tmp / re.sub(r"\W+", "-", name), ranks=ranks, steps=args.steps, **options)
        print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    print("| run | tokens/s | vs one process | vs sequential | bubble measured | bubble (theory) "
          "| step estimated / measured |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        group = "QLoRA " if name.startswith("QLoRA") else ""  # QLoRA rows against the QLoRA baselines
        base = results[f"{group}one process" + ("" if group else ", whole model")]["tokens_per_s"]
        seq = results[f"{group}sequential model parallel (device_map style)"]["tokens_per_s"]
        print(f"| {name}{' → ' + r['schedule'] if 'auto' in name else ''} | {r['tokens_per_s']:.0f} "
              f"| {r['tokens_per_s'] / base:.2f}× | {r['tokens_per_s'] / seq:.2f}× "
              f"| {r['bubble']:.1f}% | {r['theory']:.1f}% "
              f"| {r['estimate_ms']:.0f} / {r['measured_ms']:.0f} ms{r['recheck']} |")
    if "QLoRA pp=2 auto m=8" in results:
        ratio = (results["QLoRA pp=2 auto m=8"]["tokens_per_s"]
                 / results["QLoRA sequential model parallel (device_map style)"]["tokens_per_s"])
        best = max((n for n in results if n.startswith("QLoRA pp=2 ") and "auto" not in n),
                   key=lambda n: results[n]["tokens_per_s"])
        print(f"\nQLoRA pp=2 auto: {ratio:.2f}× sequential model parallelism (target ≥1.6×); the best hand-picked "
              f"row ({best}) {results[best]['tokens_per_s'] / results['QLoRA sequential model parallel (device_map style)']['tokens_per_s']:.2f}×")
    if "hfsplit auto m=8" not in results:
        return
    seq = results["sequential model parallel (device_map style)"]["tokens_per_s"]
    auto = results["hfsplit auto m=8"]["tokens_per_s"]
    best_name = max((n for n in results if n.startswith("pp=2")), key=lambda n: results[n]["tokens_per_s"])
    print(f"\nhfsplit auto: {auto / results[best_name]['tokens_per_s']:.2f}× the best hand-picked row ({best_name}), "
          f"{auto / seq:.2f}× sequential model parallelism (targets ≥0.97× and ≥1.6×)")


if __name__ == "__main__":
    main()
