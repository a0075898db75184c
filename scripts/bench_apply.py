"""The "run against the plan" table of docs/benchmarks/apply.md: each rank's measured peak of one training step against the plan's
figure, from the very cases `tests/parallel/test_apply.py` asserts (same model, same step, same launcher).

    python scripts/bench_apply.py            # the four splits × methods, checkpointing off, on, offload (~7 min)
    python scripts/bench_apply.py --rows lora-tp2
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROWS = {"lora-pp2": ("lora", 1, 2), "lora-tp2": ("lora", 2, 1), "full-pp2": ("full", 1, 2), "full-tp2": ("full", 2, 1)}


def row(name: str, checkpoint: str) -> str:
    from tests.parallel.launcher import launch
    from tests.parallel.test_apply import STEP

    method, tp, pp = ROWS[name]
    results = launch("tests.parallel.apply_cases:step_memory_and_losses", world_size=2, timeout_s=600,
                     kwargs=dict(checkpoint=checkpoint, method=method, tp=tp, pp=pp, **STEP))

    def per_rank(figure) -> str:
        return " / ".join(f"{figure(r):.2f}" for r in results)

    ratio = {ac: per_rank(lambda r, ac=ac: r[ac]["measured"] / r[ac]["planned"]) for ac in (False, True, "offload")}
    host = per_rank(lambda r: r["offload"]["offloaded"] / r["offload"]["planned_offload"]
                    if r["offload"]["planned_offload"] else float("nan"))
    saving = per_rank(lambda r: (r[False]["measured"] - r[True]["measured"])
                      / (r[False]["planned"] - r[True]["planned"]))
    growth = max(r[ac]["growth"] for r in results for ac in (False, True, "offload"))
    schedules = {ac: results[0][ac]["schedule"] for ac in (False, True)}
    split = f"pp={pp}" if pp > 1 else f"tp={tp}"
    if schedules[False] != schedules[True]:
        split += f" (off: {schedules[False]}, on: {schedules[True]})"
    label = "LoRA" if method == "lora" else method
    return (f"| {label} | {split} | 0 / 1 | {ratio[False]} | {ratio[True]} | {saving} | {ratio['offload']} | {host} "
            f"| {growth} B |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    args = parser.parse_args()
    from hfsplit.checkpoint.synthetic import write_tiny_checkpoint
    from tests.parallel.test_apply import MODEL

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = str(write_tiny_checkpoint(Path(tmp), "llama", **MODEL))
        print("| method | split | rank | measured / planned, checkpointing off | on | saving measured / planned "
              "| offload: device | offload: host | left behind per step |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name in args.rows.split(","):
            print(row(name, checkpoint), flush=True)


if __name__ == "__main__":
    main()
