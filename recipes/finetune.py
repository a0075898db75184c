"""Pipelined fine-tuning of a Hugging Face causal LM split across the launched ranks.

    accelerate launch --config_file recipes/accelerate_cpu.yaml recipes/finetune.py          # built-in default
    accelerate launch --num_processes 4 recipes/finetune.py --model NAME --dataset FILE --max-memory 4x24GiB
    torchrun --nproc_per_node 2 recipes/finetune.py --config recipes/tiny/lora.yaml

Every option is a flag and a key of the YAML recipe (`--config`); flags win.
Exit codes: 0 done; 2 bad input (one `finetune: ...` line naming it and the fix, nothing written);
3 the run failed after it started (a rank died or hung, a non-finite step under --on-nonfinite stop).
"""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist

    from hfsplit.errors import HfsplitError
    from hfsplit.training.options import parse_options

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        options = parse_options(argv)
        from hfsplit.training.run import train  # after parsing: --help and a bad flag answer before the training stack loads

        train(options)
        return 0
    except HfsplitError as exc:
        print(f"finetune: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written and the process group is gone; leaving without C++ static teardown avoids a
    # rare abort of a finished rank ("terminate called without an active exception") in gloo's threads.
    os._exit(code)
