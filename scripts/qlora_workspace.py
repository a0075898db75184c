"""What one QLoRA block's recompute + backward workspace is made of, as the cost model traces it.

    python scripts/qlora_workspace.py [--model meta-llama/Llama-3.1-70B] [--seq-len 2048] [--lora-r 16]

For bf16 QLoRA with activation checkpointing, the plan's per-block workspace is: the recomputed activations
(what autograd saves in one block's forward), the backward transient on top of them, and one weight
dequantized to bf16 (`quantize.with_dequantize`). The script traces one block on fake tensors (nothing is
allocated), with the stage forwards under autocast (the default, `hfsplit.parallel.autocast`) and without
(`TrainingSpec(autocast=False)`: peft casts every adapter's input to fp32 and lora_A keeps that copy), and
lists the saved tensors by shape and dtype.
"""
from __future__ import annotations

import argparse
import collections

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hfsplit import costs
from hfsplit.checkpoint.resolve import load_config
from hfsplit.costs import TrainingSpec

MiB = 1 << 20


def saved_by_shape(key: str, spec: TrainingSpec) -> collections.Counter:
    """{(shape, dtype): bytes} of the storages one block's forward saves for backward (its input and its
    parameters excluded), traced as `costs._block_events` traces it."""
    config = costs._CONFIGS[key]
    mode = FakeTensorMode()
    _, block, kwargs, _ = costs._fake_model(key, spec, 1, mode)
    found: dict[int, tuple] = {}
    with mode:
        costs._set_trainable(block, spec)
        x = torch.empty((spec.micro_batch_size, spec.seq_len, config.hidden_size), dtype=getattr(torch, spec.dtype),
                        requires_grad=True)
        skip = {id(p.untyped_storage()) for p in block.parameters()} | {id(x.untyped_storage())}

        def pack(t):
            if id(t.untyped_storage()) not in skip:
                found.setdefault(id(t.untyped_storage()), (tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                                           t.untyped_storage().nbytes(), t.untyped_storage()))
            return t

        cast = costs._traced_autocast(spec)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=cast, enabled=cast is not None):
            costs._hidden(block(x, **kwargs))
    by_shape = collections.Counter()
    for shape, dtype, nbytes, _ in found.values():
        by_shape[(shape, dtype)] += nbytes
    return by_shape


def report(model: str, *, seq_len: int, lora_r: int) -> None:
    config = load_config(model)
    key = costs._config_key(config)
    costs._CONFIGS.setdefault(key, config)
    for autocast in (False, None):
        spec = TrainingSpec(method="qlora", seq_len=seq_len, lora_r=lora_r, activation_checkpointing=True,
                            autocast=autocast)
        traced = costs._traced_spec(spec)
        trace = costs._trace_block(key, traced, 1)
        block = costs.model_costs(config, spec).block
        dequantized = block.workspace_bytes - trace.activations - trace.workspace
        print(f"\n{model} bf16 QLoRA r={lora_r}, seq {seq_len}, autocast {'on' if autocast is None else 'off'}: "
              f"workspace {block.workspace_bytes / MiB:.0f} MiB = recomputed activations {trace.activations / MiB:.0f}"
              f" + backward transient {trace.workspace / MiB:.0f} + dequantized weight {dequantized / MiB:.0f}")
        for (shape, dtype), nbytes in saved_by_shape(key, traced).most_common(8):
            print(f"    saved {str(shape):24} {dtype:9} {nbytes / MiB:7.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="meta-llama/Llama-3.1-70B")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--lora-r", type=int, default=16)
    args = parser.parse_args()
    report(args.model, seq_len=args.seq_len, lora_r=args.lora_r)


if __name__ == "__main__":
    main()
