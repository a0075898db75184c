"""The quantization step (QLoRA): a stage's frozen base in bitsandbytes 4-bit / 8-bit, block by block as it is read.

A stage keeps its embeddings, norms and lm_head in 16 bits, as transformers' bitsandbytes
integration does; every `nn.Linear` inside its decoder blocks becomes a `bnb.nn.Linear4bit`
(or `Linear8bitLt` with `load_in_8bit`). A block is quantized right after its tensors are read
(the load step, `hfsplit.apply.load.load_quantized_stage`), so a rank holds at most one block in 16 bits
on top of what it already quantized; the quantize step then checks every block holds bitsandbytes layers. An MoE
block's fused experts (3-D parameters, which bitsandbytes does not quantize) go to 4 bits too, expert by expert,
where the spec says so (`TrainingSpec.quantize_experts`, `hfsplit.apply.quantized_experts`).

Entry points: `quantization_config` (knobs → transformers' `BitsAndBytesConfig`; `quantization_config_of` from a
TrainingSpec), `check_quantization` (a one-line refusal where bitsandbytes cannot serve the request),
`quantize_module` (replace the linears of one block; a pre-quantized checkpoint's packed weights and
quant state are read as stored, `hfsplit.checkpoint.quantized`) and `check_quantized` (the step).
"""
from __future__ import annotations

import math
import sys
from typing import Optional, Sequence

import torch
from torch import nn

from hfsplit.apply import third_party_logs
from hfsplit.apply.nf4 import quantize_4bit_state
from hfsplit.apply.quantized_experts import (
    ExpertsNF4, dequantized_experts, experts_modules, is_placeholder, is_quantized_experts, quantize_block_experts,
)
from hfsplit.checkpoint.quantized import BLOCKSIZE
from hfsplit.errors import PlanError, QuantizationError
from hfsplit.plan.steps import Step


def quantization_config(*, load_in_8bit: bool = False, quant_type: str = "nf4", double_quant: bool = True,
                        compute_dtype: str = "bfloat16", quant_storage: str = "uint8"):
    """transformers' `BitsAndBytesConfig` for QLoRA: NF4 + double quantization by default, computing in
    `compute_dtype` (the run's `--dtype`)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=not load_in_8bit, load_in_8bit=load_in_8bit,
                              bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double_quant,
                              bnb_4bit_compute_dtype=getattr(torch, compute_dtype),
                              bnb_4bit_quant_storage=getattr(torch, quant_storage))


def quantization_config_of(spec):
    """The `BitsAndBytesConfig` a QLoRA `TrainingSpec` describes (its knobs, computing in its dtype): the one
    builder the run's loader and the calibration probe share, so the probe times the block the run trains."""
    return quantization_config(load_in_8bit=spec.load_in_8bit, quant_type=spec.bnb_4bit_quant_type,
                               double_quant=spec.bnb_4bit_use_double_quant, compute_dtype=spec.dtype)


def check_quantization(qconfig, *, device: torch.device) -> None:
    """Raise QuantizationError in one line unless bitsandbytes quantizes, runs forward and backward
    through one small layer of `qconfig` on `device` (so a refusal comes before any weight is read)."""
    what = "load_in_8bit" if qconfig.load_in_8bit else f"bnb_4bit_quant_type={qconfig.bnb_4bit_quant_type!r}"
    if not (qconfig.load_in_8bit or qconfig.load_in_4bit):
        raise QuantizationError("the quantization config quantizes nothing: set load_in_4bit=True or load_in_8bit=True")
    if not qconfig.load_in_8bit and qconfig.bnb_4bit_quant_type not in ("nf4", "fp4"):
        raise QuantizationError(f"{what}: bitsandbytes knows nf4 and fp4; use --bnb-4bit-quant-type nf4")
    third_party_logs.install()  # its import-time warning about optional kernels: one line of our own instead
    try:
        import bitsandbytes  # noqa: F401  (lazy: ~3 s import)
    except ImportError as exc:
        raise QuantizationError(f"QLoRA needs bitsandbytes ({exc}); pip install bitsandbytes") from None
    third_party_logs.explain_missing_kernels()
    probe = nn.Linear(BLOCKSIZE, BLOCKSIZE, bias=False)
    try:
        layer = quantize_linear(probe, qconfig, device=device)
        x = torch.ones(1, BLOCKSIZE, device=device, dtype=qconfig.bnb_4bit_compute_dtype, requires_grad=True)
        layer(x).float().sum().backward()
    except Exception as exc:  # bitsandbytes reports unsupported backends/types with assorted error types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        fix = ("use 4-bit (drop --load-in-8bit)" if qconfig.load_in_8bit else "use --bnb-4bit-quant-type nf4"
               if qconfig.bnb_4bit_quant_type != "nf4" else "run QLoRA on a device bitsandbytes serves (cuda, cpu)")
        raise QuantizationError(f"{what} on {device.type}: bitsandbytes refuses it ({first[:160]}); {fix}") from None


def quantize_linear(linear: nn.Linear, qconfig, *, device: torch.device) -> nn.Module:
    """A bitsandbytes layer holding `linear`'s weight quantized on `device` (the bias stays 16-bit)."""
    import bitsandbytes as bnb  # lazy: importing bitsandbytes compiles kernels with torch._inductor (~3 s)

    weight = linear.weight.data
    bias = linear.bias is not None
    if not qconfig.load_in_8bit and device.type == "cpu" and weight.device.type == "cpu":
        packed, stats = quantize_4bit_in_chunks(weight, qconfig)
        return prequantized_linear(linear, packed, stats, qconfig, device=device)
    if qconfig.load_in_8bit:
        layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=bias, has_fp16_weights=False,
                                    threshold=qconfig.llm_int8_threshold, device="meta")
        layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    else:
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=bias,
                                  compute_dtype=qconfig.bnb_4bit_compute_dtype,
                                  compress_statistics=qconfig.bnb_4bit_use_double_quant,
                                  quant_type=qconfig.bnb_4bit_quant_type,
                                  quant_storage=qconfig.bnb_4bit_quant_storage, device="meta")
        layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=qconfig.bnb_4bit_use_double_quant,
                                         quant_type=qconfig.bnb_4bit_quant_type,
                                         quant_storage=qconfig.bnb_4bit_quant_storage, module=layer)
    if bias:
        layer.bias = nn.Parameter(linear.bias.data.to(device), requires_grad=False)
    return layer.to(device)  # bitsandbytes quantizes on the move to the device


def quantize_4bit_in_chunks(weight: torch.Tensor, qconfig) -> tuple[torch.Tensor, dict]:
    """`bitsandbytes.functional.quantize_4bit(weight)` (packed bytes, quant state as a dict), bit for bit, done
    a chunk at a time (`hfsplit.apply.nf4.quantize_4bit_state`)."""
    packed, state = quantize_4bit_state(weight, qconfig)
    return packed.view(qconfig.bnb_4bit_quant_storage).unsqueeze(1), state.as_dict(packed=True)


def prequantized_linear(linear: nn.Module, data: torch.Tensor, stats: dict, qconfig, *, device: torch.device) -> nn.Module:
    """A `Linear4bit` (or, 8-bit, `Linear8bitLt`) holding a pre-quantized checkpoint's packed bytes and quant state
    as stored (nothing is re-quantized), computing in `qconfig`'s compute dtype."""
    import bitsandbytes as bnb  # lazy: importing bitsandbytes compiles kernels with torch._inductor (~3 s)

    if qconfig.load_in_8bit:  # int8 rows and their per-row scales (SCB), as transformers' 8-bit save_pretrained writes
        layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                    has_fp16_weights=False, threshold=qconfig.llm_int8_threshold, device="meta")
        data = data.to(device)  # CB set as bitsandbytes' own quantize sets it: the first forward moves it to the state
        layer.weight = bnb.nn.Int8Params(data, requires_grad=False, has_fp16_weights=False, CB=data,
                                         SCB=stats["SCB"].to(device))
    else:
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                  compute_dtype=qconfig.bnb_4bit_compute_dtype, device="meta")
        layer.weight = bnb.nn.Params4bit.from_prequantized(data, stats, requires_grad=False, device=device, module=layer)
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.data.to(device), requires_grad=False)
    return layer


# Linears whose weights the model's own forward reads or writes as a matrix while training, which 4-bit bytes cannot
# serve: Gemma 3n's AltUp clamps `prediction_coefs` in place and multiplies by a clamped copy of `correction_coefs`
# (a few dozen values a block); transformers' bitsandbytes load quantizes them and then fails there. They stay in the
# compute dtype, frozen.
KEPT_UNQUANTIZED = ("altup.prediction_coefs", "altup.correction_coefs")


def quantizes(name: str, module: nn.Module) -> bool:
    """Whether the quantization step turns the module `name` (inside a block) into a bitsandbytes layer."""
    return type(module) is nn.Linear and not name.endswith(KEPT_UNQUANTIZED)


def quantize_module(module: nn.Module, qconfig, *, device: torch.device, prefix: str = "", reader=None,
                    experts: bool = True) -> None:
    """Replace every `nn.Linear` inside `module` (one decoder block, named `prefix` in the checkpoint) with its
    quantized layer: quantized here, or, where `reader` holds it pre-quantized, read as stored. With `experts`
    (and a 4-bit config), an MoE block's fused experts are quantized too, expert by expert
    (`hfsplit.apply.quantized_experts.quantize_block_experts`: read from `reader` where they are still on meta)."""
    for name, sub in list(module.named_modules()):
        if quantizes(name, sub):  # bnb layers subclass nn.Linear: never quantize twice
            key = f"{prefix}.{name}.weight" if prefix else f"{name}.weight"
            if reader is not None and reader.packed_state_keys(key):
                data, stats = reader.read_packed(key, device=device)
                layer = prequantized_linear(sub, data, stats, qconfig, device=device)
            else:
                layer = quantize_linear(sub, qconfig, device=device)
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner) if owner else module, leaf, layer)
    if experts and not qconfig.load_in_8bit:
        quantize_block_experts(module, qconfig, device=device, prefix=prefix, reader=reader)


class Staging:
    """One buffer, the size of the largest block's linear weights, that every block's 16-bit weights are read
    into in turn. Fresh tensors per weight would leave the freed 16-bit blocks in glibc's heap, between the
    quantized bytes kept (its mmap threshold rises to the largest freed chunk, up to 32 MiB, so such weights
    stop being mmapped), and the process's RSS would grow by much of each block."""

    def __init__(self, numel: int, *, dtype: torch.dtype, device: torch.device):
        self.buffer = torch.empty(numel, dtype=dtype, device=device)
        self.used = 0

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        count = math.prod(shape)
        view = self.buffer[self.used:self.used + count].view(shape)
        self.used += count
        return view

    def reset(self) -> None:
        self.used = 0


def dequantized(param: torch.Tensor, layer: Optional[nn.Module] = None) -> torch.Tensor:
    """A bitsandbytes weight back in 16 bits (its quant state's dtype; 8-bit: fp32); any other tensor as it is.

    `layer` is the module holding `param`: a `Linear8bitLt`'s first forward moves the row scales (SCB) off its
    weight onto `layer.state`, so an 8-bit weight that has run is read with the layer's scales; 4-bit fused experts
    (`hfsplit.apply.quantized_experts`) hold their bytes beside the parameter, which is only their placeholder."""
    if layer is not None and is_quantized_experts(layer) and is_placeholder(param):
        return dequantized_experts(layer, next(n for n, p in layer.named_parameters(recurse=False) if p is param))
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:  # nothing in this process quantized: no bitsandbytes weight exists, and no import is made
        return param
    if isinstance(param, bnb.nn.Params4bit) and param.quant_state is not None:
        data, state = param.data, param.quant_state
        if getattr(state, "packing_format_for_cpu", False):  # repacked by bnb's CPU inference kernel (eval mode)
            from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu_inverse  # lazy: ~3 s import (inductor)

            data, state = _convert_weight_packed_for_cpu_inverse(data, state)
        return bnb.functional.dequantize_4bit(data, state).to(state.dtype)
    if isinstance(param, bnb.nn.Int8Params) and param.data.dtype == torch.int8:
        scales = param.SCB if param.SCB is not None else getattr(getattr(layer, "state", None), "SCB", None)
        if scales is None:
            raise QuantizationError("an 8-bit weight has no row scales (SCB) on it or on its layer's state: "
                                    "pass the Linear8bitLt holding it to dequantized(param, layer)")
        return bnb.functional.int8_vectorwise_dequant(param.data, scales.to(param.device))
    return param


def held_bytes(module: nn.Module) -> int:
    """Bytes `module`'s parameters really hold, bitsandbytes quant state (absmax, codes, nested state) included, and
    4-bit fused experts' bytes (their parameters are placeholders holding one value)."""
    total = sum(sub.nf4_bytes() for sub in module.modules() if isinstance(sub, ExpertsNF4))
    for p in module.parameters():
        total += p.untyped_storage().nbytes() if is_placeholder(p) else p.data.nbytes
        state = getattr(p, "quant_state", None)
        nested = getattr(state, "state2", None)
        extra = [getattr(state, "absmax", None), getattr(state, "code", None), getattr(state, "offset", None),
                 getattr(nested, "absmax", None), getattr(nested, "code", None), getattr(p, "SCB", None)]
        total += sum(t.nbytes for t in extra if isinstance(t, torch.Tensor))
    for sub in module.modules():  # a Linear8bitLt that has run keeps its row scales on its state, not its weight
        scales = getattr(getattr(sub, "state", None), "SCB", None)
        if isinstance(scales, torch.Tensor) and getattr(sub.weight, "SCB", None) is None:
            total += scales.nbytes
    return total


def quantized_linear_count(module: nn.Module) -> int:
    """How many bitsandbytes 4-bit / 8-bit linear layers `module` holds."""
    import bitsandbytes as bnb  # lazy: importing bitsandbytes compiles kernels with torch._inductor (~3 s)

    return sum(isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) for m in module.modules())


def check_quantized(modules: Sequence[nn.Module], step: Step, inputs) -> Step:
    """The quantization step: the load step already quantized each block's linears on the device as it read
    them (so no rank ever holds its stage in 16 bits), and, where the plan says so, an MoE block's fused experts
    expert by expert; this checks every block holds what the plan says."""
    plan = inputs.plan
    for module in modules:
        for name, block in module.body.layers.items():
            if quantized_linear_count(block) == 0:
                raise PlanError(f"stage {module.stage_index}: block {name} holds no quantized linear layer "
                                "after loading a QLoRA plan; load it with quantization_config")
            experts = [is_quantized_experts(sub) for _, sub in experts_modules(block)]
            if experts and (not plan.fused_experts or all(experts) != plan.spec.experts_in_4bit):
                raise PlanError(f"stage {module.stage_index}: block {name}'s fused experts are "
                                f"{'4-bit' if all(experts) else 'not all 4-bit'}, which the plan (fused_experts="
                                f"{plan.fused_experts}, quantize_experts={plan.spec.quantize_experts}) does not say; "
                                "re-plan for this checkpoint")
    return step
