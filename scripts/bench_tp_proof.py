"""What the tp=2 proof on a user's own config costs (`hfsplit.load.tp_proof.ranks_verdict`, which `hfsplit check MODEL
--tp 2`, `hfsplit plan` with tp>1 and a launched run's rank 0 run before a tp>1 split): its two ranks forked (from the
process that asks, or from a launched rank 0's prover), against fresh interpreters (where no fork is safe: CUDA
initialised or a process group joined first), and the cached verdict.

    taskset -c 0 python scripts/bench_tp_proof.py               # one CPU core, 3 forked proofs a config
    taskset -c 0 python scripts/bench_tp_proof.py --no-fresh    # forked and cached only (fresh: ~15 s a config)

Every proof is a new config's: the cache is a fresh folder, and forked or fresh proofs call `ranks_verdict`, which
never reads it. The time is the proof's wall time in a process that has imported torch and transformers already (as
every caller has); it covers the ranks' start, their rendezvous, shrinking, building the tiny model and its stages,
the forward and backward, the float64 rerun where float32 differs (Qwen3-Next), and the ranks' end.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["HFSPLIT_CACHE"] = tempfile.mkdtemp(prefix="hfsplit-bench-tp-proof-")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def configs() -> dict:
    """A few configs the sweep's defaults do not cover, each flag a user might set."""
    from transformers import AutoConfig, LlamaConfig

    return {
        "llama (biased, tied, 8 kv heads)": LlamaConfig(attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                                        num_key_value_heads=8),
        "qwen3_moe (default)": AutoConfig.for_model("qwen3_moe"),
        "glm4_moe (use_qk_norm)": AutoConfig.for_model("glm4_moe", use_qk_norm=True),
        "qwen3_next (float64 rerun)": AutoConfig.for_model("qwen3_next"),
    }


def seconds(run) -> tuple[float, object]:
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="forked proofs a config (median and worst shown)")
    parser.add_argument("--no-fresh", action="store_true", help="skip the fresh-interpreter proofs")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from hfsplit.load.tp_proof import forked_ranks, interpreter_ranks, ranks_verdict, tp_verdict_of

    print(f"CPU cores usable: {len(os.sched_getaffinity(0))}\n")
    print("| config | verdict | forked, median (worst) | fresh interpreters | cached |")
    print("|---|---|---|---|---|")
    for name, config in configs().items():
        forked = [seconds(lambda: ranks_verdict(config, forked_ranks)) for _ in range(args.repeats)]
        verdict = forked[0][1]
        times = [t for t, _ in forked]
        fresh = "-"
        if not args.no_fresh:
            took, other = seconds(lambda: ranks_verdict(config, interpreter_ranks))
            assert other == verdict, f"{name}: the fresh interpreters' verdict differs: {other} against {verdict}"
            fresh = f"{took:.1f} s"
        tp_verdict_of(config)  # writes the cache
        cached, _ = seconds(lambda: tp_verdict_of(config))
        found = "proven" + (" in float64" if verdict.rounding else "") if verdict.proven else "refused"
        print(f"| {name} | {found} | {statistics.median(times):.2f} s ({max(times):.2f} s) | {fresh} | "
              f"{cached * 1e3:.0f} ms |", flush=True)


if __name__ == "__main__":
    main()
