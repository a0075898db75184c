"""Pipelined fine-tuning of a Hugging Face causal LM split across the launched ranks: the recipe, installed.

    accelerate launch --config_file "$(hfsplit accelerate-config)" -m hfsplit.finetune        # built-in default
    accelerate launch --num_processes 4 -m hfsplit.finetune --model NAME --dataset FILE --max-memory 4xRTX4090
    torchrun --nproc_per_node 2 -m hfsplit.finetune --config recipes/tiny/lora.yaml
    python -m hfsplit.finetune --model NAME --max-memory 24GiB                                 # one process

`recipes/finetune.py` in a clone is this same recipe. Every option is a flag and a key of the YAML recipe
(`--config`); flags win. Exit codes: 0 done; 2 bad input (one `finetune: ...` line naming it and the fix, nothing
of the run written; the built-in tiny model, written once beside the output folder, stays for the next run); 3 the run failed after it started (a rank died or hung, a non-finite step under --on-nonfinite stop);
130 Ctrl-C or SIGTERM stopped it (one line naming the last complete checkpoint and how to resume).
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

# Before torch is imported: one thread per rank (several ranks share a host's cores; STACK.md measured 5-10x).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from hfsplit.apply import third_party_logs  # noqa: E402
from hfsplit.errors import HfsplitError, Interrupted  # noqa: E402
from hfsplit.training.interrupts import interrupted, remove_partial_saves, sigterm_interrupts  # noqa: E402
from hfsplit.training.options import parse_options  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the recipe with `argv` (default: the command line) on this rank; its exit code. Bad input prints one
    `finetune: ...` line to stderr and returns 2, a run that failed after it started 3."""
    third_party_logs.install()
    options = None
    try:
        with sigterm_interrupts():
            options = parse_options(argv)
            from hfsplit.training.run import train  # after parsing: --help, a bad flag answer before torch loads
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # a torch imported before us: still one thread
            result = train(options)
            if result.timeline_json:  # rank 0: the step as it ran, drawn beside the plan's (matplotlib: here, not
                from hfsplit.cli.charts import run_timeline_chart  # in every train() call)

                print(f"drawn beside the plan's timeline: {run_timeline_chart(result.timeline_json)}", flush=True)
        return 0
    except (KeyboardInterrupt, Interrupted) as exc:  # Ctrl-C or SIGTERM: no traceback, no half-written folder
        output_dir = options.output_dir if options else None
        remove_partial_saves(output_dir)
        exc = exc if isinstance(exc, Interrupted) else interrupted(output_dir)
        print(f"finetune: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except HfsplitError as exc:
        print(f"finetune: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    finally:
        _leave_process_group()


def _leave_process_group() -> None:
    """Destroy the run's process group, if one was made (not after --help or a refused flag: torch never loaded)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        dist.destroy_process_group()


def run_as_process(argv: Optional[Sequence[str]] = None) -> None:
    """`main`, then leave the process at once with its code (`python -m`, a launcher's rank, the clone's recipe)."""
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written and the process group is gone; leaving without C++ static teardown avoids a
    # rare abort of a finished rank ("terminate called without an active exception") in gloo's threads.
    os._exit(code)


if __name__ == "__main__":
    run_as_process()
