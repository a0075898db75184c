"""Pipelined fine-tuning of a Hugging Face causal LM split across the launched ranks (a clone's copy of the
installed recipe `hfsplit.finetune`: the same options, the same code).

    accelerate launch --config_file recipes/accelerate_cpu.yaml recipes/finetune.py          # built-in default
    accelerate launch --num_processes 4 recipes/finetune.py --model NAME --dataset FILE --max-memory 4x24GiB
    torchrun --nproc_per_node 2 recipes/finetune.py --config recipes/tiny/lora.yaml

From an installed package: `accelerate launch -m hfsplit.finetune ...`, `torchrun -m hfsplit.finetune ...`,
`python -m hfsplit.finetune ...`. Every option is a flag and a key of the YAML recipe (`--config`); flags win.
Exit codes: 0 done; 2 bad input (one `finetune: ...` line naming it and the fix, nothing written);
3 the run failed after it started (a rank died or hung, a non-finite step under --on-nonfinite stop).
"""
from hfsplit.finetune import main, run_as_process

__all__ = ["main"]

if __name__ == "__main__":
    run_as_process()
