"""What one QLoRA block's recompute + backward workspace is made of, as the cost model traces it.

    python scripts/qlora_workspace.py [--model meta-llama/Llama-3.1-70B] [--seq-len 2048] [--lora-r 16] [--measure-seq 256]

For bf16 QLoRA with activation checkpointing, the plan's per-block workspace is: the recomputed activations
(what autograd saves in one block's forward), the backward transient on top of them, and one weight
dequantized to bf16 (`quantize.with_dequantize`). The script traces one block on fake tensors (nothing is
allocated), with the stage forwards under autocast (the default, `hfsplit.apply.autocast`) and without
(`TrainingSpec(autocast=False)`: peft casts every adapter's input to fp32 and lora_A keeps that copy), and
lists the saved tensors by shape and dtype. `--measure-seq N` then runs one real block of the model's
dimensions (random weights quantized to NF4, peft adapters) forward and backward on CPU at seq N, and sets its
backward peak beside the plan's workspace.
"""
from __future__ import annotations

import argparse
import collections

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hfsplit.planning.costs import layout as costs_layout, model as costs_model, trace as costs_trace
from hfsplit.checkpoint.resolve import load_config
from hfsplit.plan import TrainingSpec

MiB = 1 << 20


def saved_by_shape(key: str, spec: TrainingSpec) -> collections.Counter:
    """{(shape, dtype): bytes} of the storages one block's forward saves for backward (its input and its
    parameters excluded), traced as `costs_trace.block_events` traces it."""
    config = costs_layout.CONFIGS[key]
    mode = FakeTensorMode()
    _, block, kwargs, _ = costs_trace._fake_model(key, spec, 1, mode)
    found: dict[int, tuple] = {}
    with mode:
        costs_trace.set_trainable(block, spec)
        x = torch.empty((spec.micro_batch_size, spec.seq_len, config.hidden_size), dtype=getattr(torch, spec.dtype),
                        requires_grad=True)
        skip = {id(p.untyped_storage()) for p in block.parameters()} | {id(x.untyped_storage())}

        def pack(t):
            if id(t.untyped_storage()) not in skip:
                found.setdefault(id(t.untyped_storage()), (tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                                           t.untyped_storage().nbytes(), t.untyped_storage()))
            return t

        cast = costs_trace._traced_autocast(spec)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=cast, enabled=cast is not None):
            costs_trace._hidden(block(x, **kwargs))
    by_shape = collections.Counter()
    for shape, dtype, nbytes, _ in found.values():
        by_shape[(shape, dtype)] += nbytes
    return by_shape


def report(model: str, *, seq_len: int, lora_r: int) -> None:
    config = load_config(model)
    key = costs_layout.config_key(config)
    costs_layout.CONFIGS.setdefault(key, config)
    for autocast in (False, None):
        spec = TrainingSpec(method="qlora", seq_len=seq_len, lora_r=lora_r, activation_checkpointing=True,
                            autocast=autocast)
        traced = costs_model._traced_spec(spec)
        trace = costs_trace.trace_block(key, traced, 1)
        block = costs_model.model_costs(config, spec).block
        dequantized = block.workspace_bytes - trace.activations - trace.workspace
        print(f"\n{model} bf16 QLoRA r={lora_r}, seq {seq_len}, autocast {'on' if autocast is None else 'off'}: "
              f"workspace {block.workspace_bytes / MiB:.0f} MiB = recomputed activations {trace.activations / MiB:.0f}"
              f" + backward transient {trace.workspace / MiB:.0f} + dequantized weight {dequantized / MiB:.0f}")
        for (shape, dtype), nbytes in saved_by_shape(key, traced).most_common(8):
            print(f"    saved {str(shape):24} {dtype:9} {nbytes / MiB:7.0f} MiB")


def real_block(config, *, lora_r: int) -> torch.nn.Module:
    """One decoder block of `config`'s real dimensions, random bf16 weights quantized to NF4 as hfsplit's loader
    does, peft LoRA on every projection upcast to fp32 as `hfsplit.apply.steps` has it."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.tuners_utils import cast_adapter_dtype
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from hfsplit.models.layout import block_linear_names
    from hfsplit.apply.quantize import quantization_config, quantize_module

    with torch.device("meta"):
        block = LlamaDecoderLayer(config, 0)
    block = block.to_empty(device="cpu").to(torch.bfloat16)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    quantize_module(block, quantization_config(compute_dtype="bfloat16"), device=torch.device("cpu"))
    block.is_loaded_in_4bit = True
    inject_adapter_in_model(LoraConfig(r=lora_r, target_modules=block_linear_names(config)), block)
    cast_adapter_dtype(block, "default")
    for name, p in block.named_parameters():
        p.requires_grad_("lora_" in name)
    return block


def measure(model: str, *, seq_len: int, lora_r: int) -> None:
    """A real block (Llama-family configs) run forward and backward on CPU, autocast on and off: its backward
    peak (recomputed activations + transient + bitsandbytes' dequantized weight) against the plan's workspace."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from hfsplit.models.masks import causal_masks

    config = load_config(model)
    config._attn_implementation = "sdpa"
    block = real_block(config, lora_r=lora_r)
    x0 = torch.randn(1, seq_len, config.hidden_size, dtype=torch.bfloat16)
    pos = torch.arange(seq_len)[None]
    rotary = tuple(t.to(torch.bfloat16) for t in LlamaRotaryEmbedding(config)(x0, pos))
    mask = causal_masks(config, hidden=x0, position_ids=pos)["full_attention"]
    for autocast in (False, None):
        for layer in block.modules():
            if hasattr(layer, "lora_A"):
                layer.cast_input_dtype_enabled = autocast is False
        x = x0.clone().requires_grad_(True)
        with costs_trace.LiveBytes() as live:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast is None):
                y = block(x, attention_mask=mask, position_embeddings=rotary, position_ids=pos)
            live.reset_peak()
            y.backward(torch.ones_like(y))
        for p in block.parameters():
            p.grad = None
        spec = TrainingSpec(method="qlora", seq_len=seq_len, lora_r=lora_r, activation_checkpointing=True,
                            autocast=autocast)
        planned = costs_model.model_costs(config, spec).block.workspace_bytes
        print(f"real block, seq {seq_len}, autocast {'on' if autocast is None else 'off'}: backward peak "
              f"{live.peak / MiB:.1f} MiB, plan's workspace {planned / MiB:.1f} MiB (plan/real {planned / live.peak:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="meta-llama/Llama-3.1-70B")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--measure-seq", type=int, default=0,
                        help="also run one real block at this sequence length on CPU (70B dims, seq 256: ~1.5 min)")
    args = parser.parse_args()
    report(args.model, seq_len=args.seq_len, lora_r=args.lora_r)
    if args.measure_seq:
        measure(args.model, seq_len=args.measure_seq, lora_r=args.lora_r)


if __name__ == "__main__":
    main()
