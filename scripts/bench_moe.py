"""Tiny-MoE QLoRA on pp=2 (2 CPU ranks): 4-bit experts against 16-bit experts, tokens/s and each rank's peak against
the plan, from the very rank function `tests/training/test_moe_training.py` asserts with (`qlora_moe_runs`: the
recipe's `build_run` + `fit`, then one more step measured: bytes held, quant state included, + the peak of the
storages it creates).

    python scripts/bench_moe.py              # 2 × 2 runs of 12 steps (~4 min on 2 CPU cores)
    python scripts/bench_moe.py --steps 6 --repeats 1

The 4-bit and 16-bit runs alternate (`--repeats` pairs) so that machine load hits both alike; tokens/s is the
global batch's tokens over the median step (the first two steps excluded), the best of the repeats.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Mixtral-shaped: 8 experts, top-2, each expert 2 × 512 × 256 + 256 × 512; the experts are 94% of the block weights
MODEL = dict(num_layers=4, hidden=256, heads=8, kv_heads=4, intermediate=512, vocab=1024, num_local_experts=8)
RUN = dict(method="qlora", tp=1, pp=2, max_memory="2x4GiB", seq_len=256, micro_batch_size=2, micro_batches=4,
           schedule="1F1B", dtype="float32", lora_r=8, learning_rate=1e-3, warmup_steps=2)


def measure(checkpoint: str, out: Path, *, quantize_experts: bool, steps: int) -> dict:
    import torch

    from tests.parallel.launcher import launch

    run = dict(RUN, model=checkpoint, output_dir=str(out), max_steps=steps, quantize_experts=quantize_experts)
    probe = torch.zeros(1, 8, dtype=torch.long)
    ids = torch.randint(3, 1024, (8, 32), generator=torch.Generator().manual_seed(0))
    results = launch("tests.training.test_moe_training:qlora_moe_runs", world_size=2, timeout_s=1200,
                     kwargs={"runs": [run], "probe": probe, "ids": ids})
    ranks = [r[0] for r in results]
    tokens = RUN["seq_len"] * RUN["micro_batch_size"] * RUN["micro_batches"]
    return {"tokens_per_s": tokens / statistics.median(ranks[0]["step_times_s"][2:]),
            "ratios": [r["measured"] / r["planned"] for r in ranks], "planned": [r["planned"] for r in ranks],
            "steps": ranks[0]["steps"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from hfsplit.checkpoint.synthetic import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = str(write_tiny_checkpoint(Path(tmp) / "model", "mixtral", **MODEL))
        runs: dict[bool, list[dict]] = {True: [], False: []}
        for repeat in range(args.repeats):
            for four_bit in (True, False):
                runs[four_bit].append(measure(checkpoint, Path(tmp) / f"run-{repeat}-{four_bit}",
                                              quantize_experts=four_bit, steps=args.steps))
                print(f"4-bit experts {four_bit}: {runs[four_bit][-1]}", file=sys.stderr, flush=True)
    best = {k: max(v, key=lambda r: r["tokens_per_s"]) for k, v in runs.items()}
    print("| experts | tokens/s | vs 16-bit experts | planned per rank (MiB) | measured / planned per rank |")
    print("|---|---|---|---|---|")
    for four_bit, label in ((True, "4-bit (NF4, expert by expert)"), (False, "16-bit (fp32 here), as transformers")):
        r = best[four_bit]
        print(f"| {label} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / best[False]['tokens_per_s']:.2f}× "
              f"| {' / '.join(f'{p / 2**20:.1f}' for p in r['planned'])} "
              f"| {' / '.join(f'{x:.2f}' for x in r['ratios'])} |")
    print(f"\napplies per stage (4-bit): {' → '.join(best[True]['steps'])}")


if __name__ == "__main__":
    main()
