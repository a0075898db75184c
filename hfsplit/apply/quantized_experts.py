"""An MoE's fused experts in 4 bits (QLoRA), each expert quantized alone as it is read.

transformers 5 keeps a layer's experts as 3-D parameters of one module (`gate_up_proj [E, 2I, H]`, `down_proj
[E, H, I]`; gpt-oss transposed, `[E, H, 2I]` with biases), and bitsandbytes quantizes `nn.Linear` weights only, so
under `load_in_4bit` transformers leaves the experts, nearly all of an MoE's bytes, in 16 bits (bitsandbytes#1849).
Here every expert's matrix of each 3-D parameter is quantized alone with bitsandbytes' own `quantize_4bit` (the
QLoRA config's 4-bit type, block size and double quantization), one expert at a time from a one-expert staging
buffer (`quantize_experts`), and kept in an `ExpertsNF4` beside the module.

The module keeps transformers' class and routing: the MoE block's router picks each token's experts and calls the
experts module as before, whose class becomes a subclass running `quantized_experts_forward`, transformers'
grouped-matmul forward (`integrations.moe.grouped_mm_experts_forward`: rows sorted by expert, the module's own
`_apply_gate` / `act_fn`, biases, routing weights, sum over the top-k) on the routed experts only: only the experts
that received a token are dequantized, into `[routed, out, in]`, and `grouped_mm` runs on them. The frozen matmul
saves nothing but its offsets for backward, which dequantizes the same experts again for the input gradient
(`_FrozenGroupedLinear`), so no dequantized expert outlives its matmul.

LoRA on such experts (peft's `target_parameters`) keeps peft's adapters (`lora_A [r·E, in]`, `lora_B [out, r·E]`,
the same names and init), but is applied split, `x W_eᵀ + s · (x A_eᵀ) B_eᵀ`, on the routed experts' slices,
never building a `ΔW` of every expert (`expert_adapters`; hfsplit's own wrapper: hfsplit.apply.quantized_experts_lora).

The 3-D parameter itself stays on the module as a placeholder of its shape and dtype holding one value (NaN,
expanded), so peft, shapes and names see the module as before; nothing computes with it.

Entry points: `quantize_experts` (any family's experts module), `quantize_block_experts` (a block's, from the
checkpoint: the loaders through `hfsplit.apply.quantize.quantize_module`),
`experts_modules` (the fused experts modules of a block), `is_quantized_experts`, `dequantized_experts`.
"""
from __future__ import annotations

import math
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from hfsplit.apply.nf4 import quantize_4bit_state
from hfsplit.checkpoint.quantized import BLOCKSIZE, NESTED_BLOCKSIZE
from hfsplit.errors import UnsupportedModelError
from hfsplit.models.layout import holds_experts

Fill = Callable[[str, int, torch.Tensor], torch.Tensor]


def expert_tensor_names(module: nn.Module) -> list[str]:
    """The 3-D parameters `[experts, d1, d2]` `module` holds itself (a fused experts module's matrices)."""
    return [name for name, p in module.named_parameters(recurse=False) if p.dim() == 3] if holds_experts(module) else []


def experts_modules(block: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name within `block`, module) of every fused experts module under `block` (those holding 3-D parameters)."""
    return [(name, sub) for name, sub in block.named_modules() if expert_tensor_names(sub) or is_quantized_experts(sub)]


class ExpertsNF4(nn.Module):
    """One fused expert tensor `[experts, d1, d2]` in 4 bits, each expert's `[d1, d2]` matrix quantized alone, exactly
    as bitsandbytes' `quantize_4bit` quantizes a weight of that shape (packed values, one absmax per 64 values;
    under double quantization the absmax in uint8 with an fp32 absmax per 256 blocks and an fp32 offset). The
    codes are the same for every expert and kept once. Non-persistent buffers: the module's state dict stays
    transformers' (the adapters are what a QLoRA run saves).

    Args:
        experts: how many experts.
        shape: one expert's matrix, `(d1, d2)` as the module holds it.
        dtype: the compute dtype it dequantizes to.
        qconfig: the QLoRA `BitsAndBytesConfig` (4-bit type, double quantization).
        device: where the bytes live.
    """

    def __init__(self, experts: int, shape: tuple[int, int], *, dtype: torch.dtype, qconfig, device: torch.device):
        super().__init__()
        self.shape, self.dtype = tuple(shape), dtype
        self.quant_type, self.double_quant = qconfig.bnb_4bit_quant_type, bool(qconfig.bnb_4bit_use_double_quant)
        values = math.prod(shape)
        blocks = math.ceil(values / BLOCKSIZE)

        def buffer(name, size, kind):
            self.register_buffer(name, torch.zeros(size, dtype=kind, device=device), persistent=False)

        buffer("packed", (experts, math.ceil(values / 2)), torch.uint8)
        buffer("absmax", (experts, blocks), torch.uint8 if self.double_quant else torch.float32)
        buffer("code", (16,), torch.float32)
        if self.double_quant:
            buffer("nested_absmax", (experts, math.ceil(blocks / NESTED_BLOCKSIZE)), torch.float32)
            buffer("offset", (experts,), torch.float32)
            buffer("nested_code", (256,), torch.float32)
        self.dequantized = Counter()  # expert → how many times it was dequantized (tests and benchmarks read it)

    @property
    def experts(self) -> int:
        return self.packed.shape[0]

    def store(self, expert: int, matrix: torch.Tensor, qconfig) -> None:
        """Quantize `matrix` (`[d1, d2]`, on this module's device) as expert `expert`."""
        packed, state = quantize_4bit_state(matrix, qconfig)
        self.packed[expert].copy_(packed)
        self.absmax[expert].copy_(state.absmax)
        self.code.copy_(state.code)
        if self.double_quant:
            self.nested_absmax[expert].copy_(state.state2.absmax)
            self.offset[expert].copy_(state.offset)
            self.nested_code.copy_(state.state2.code)

    def quant_state(self, expert: int):
        """bitsandbytes' `QuantState` of expert `expert`, views of the stored bytes."""
        import bitsandbytes.functional as F  # lazy: importing bitsandbytes compiles kernels with torch._inductor (~3 s)

        nested = {}
        if self.double_quant:
            nested = dict(offset=self.offset[expert], state2=F.QuantState(
                absmax=self.nested_absmax[expert], code=self.nested_code, blocksize=NESTED_BLOCKSIZE, dtype=torch.float32))
        return F.QuantState(absmax=self.absmax[expert], shape=torch.Size(self.shape), dtype=self.dtype,
                            blocksize=BLOCKSIZE, code=self.code, quant_type=self.quant_type, **nested)

    def dequantize(self, experts: Sequence[int]) -> torch.Tensor:
        """`[len(experts), d1, d2]`: the listed experts' matrices in the compute dtype (bitsandbytes' own
        `dequantize_blockwise` / `dequantize_4bit`), and nothing else. Experts whose blocks tile their matrix
        exactly (64 values, and 256 absmax under double quantization: every real model) are dequantized in one call
        each, bit for bit as expert by expert; a run of consecutive experts (all of them, in a long micro-batch)
        without copying their bytes."""
        import bitsandbytes.functional as F  # lazy: importing bitsandbytes compiles kernels with torch._inductor (~3 s)

        experts = list(experts)
        self.dequantized.update(experts)
        values, blocks = math.prod(self.shape), self.absmax.shape[1]
        if values % BLOCKSIZE or (self.double_quant and blocks % NESTED_BLOCKSIZE) or not experts:
            out = torch.empty((len(experts), *self.shape), dtype=self.dtype, device=self.packed.device)
            for i, expert in enumerate(experts):  # (bitsandbytes' CPU backend has no `out=` variant: one expert's copy)
                out[i].copy_(F.dequantize_4bit(self.packed[expert], self.quant_state(expert)))
            return out
        pick = slice(experts[0], experts[-1] + 1) if experts == list(range(experts[0], experts[-1] + 1)) else \
            torch.tensor(experts, device=self.packed.device)
        absmax = self.absmax[pick].reshape(-1)
        if self.double_quant:
            nested = F.QuantState(absmax=self.nested_absmax[pick].reshape(-1), code=self.nested_code,
                                  blocksize=NESTED_BLOCKSIZE, dtype=torch.float32)
            absmax = F.dequantize_blockwise(absmax, nested)
            absmax = (absmax.view(len(experts), blocks) + self.offset[pick].unsqueeze(1)).reshape(-1)
        state = F.QuantState(absmax=absmax, shape=torch.Size((len(experts), *self.shape)), dtype=self.dtype,
                             blocksize=BLOCKSIZE, code=self.code, quant_type=self.quant_type)
        return F.dequantize_4bit(self.packed[pick].reshape(-1), state)

    def nf4_bytes(self) -> int:
        """Bytes held: packed values and quant state, codes once."""
        return sum(b.nbytes for b in self.buffers(recurse=False))


def quantize_experts(module: nn.Module, qconfig, *, device: torch.device, fill: Optional[Fill] = None) -> None:
    """Quantize the fused experts `module` (any family's: every 3-D parameter it holds) to 4 bits, expert by expert.

    Args:
        module: a transformers experts module (`@use_experts_implementation`), its 3-D parameters on the meta device
            (then `fill` reads them) or already holding their values.
        qconfig: the QLoRA `BitsAndBytesConfig`; its compute dtype is the dtype the experts dequantize to.
        device: where the quantized bytes live (the stage's device).
        fill: `fill(name, expert, out)` writes expert `expert`'s `[d1, d2]` matrix of parameter `name` into `out`
            (a staging tensor in the compute dtype on `device`, reused for every expert) and returns it; None copies
            from the module's own parameters. A checkpoint's reader (`CheckpointReader.read_expert_into`), or a
            family whose checkpoint stores its experts packed otherwise (gpt-oss MXFP4) dequantizing one expert.

    Raises:
        UnsupportedModelError: the module lacks transformers' experts interface (`has_gate`, `is_transposed`).
    """
    check_experts_interface(module)
    dtype = qconfig.bnb_4bit_compute_dtype
    names = expert_tensor_names(module)
    shapes = {name: tuple(module._parameters[name].shape) for name in names}
    staging = torch.empty(max(math.prod(s[1:]) for s in shapes.values()), dtype=dtype, device=device)
    stores = nn.ModuleDict()
    for name, (count, *shape) in shapes.items():
        store = ExpertsNF4(count, tuple(shape), dtype=dtype, qconfig=qconfig, device=device)
        own = module._parameters[name]
        for expert in range(count):
            out = staging[:math.prod(shape)].view(shape)
            store.store(expert, fill(name, expert, out) if fill is not None else out.copy_(own[expert]), qconfig)
        stores[name] = store
        module._parameters[name] = placeholder(shapes[name], dtype=dtype, device=device)
        del own
    module.nf4_experts = stores
    module.expert_adapters = {}
    module.__class__ = quantized_class(type(module))


def quantize_block_experts(block: nn.Module, qconfig, *, device: torch.device, prefix: str = "", reader=None) -> None:
    """`quantize_experts` on every fused experts module of `block` (named `prefix` in the checkpoint): an experts
    module still on the meta device is read from `reader` expert by expert (`CheckpointReader.read_expert_into`),
    one already holding its values is quantized from them."""
    for name, sub in experts_modules(block):
        if is_quantized_experts(sub):
            continue
        owner = ".".join(p for p in (prefix, name) if p)
        on_meta = any(p.is_meta for p in sub.parameters(recurse=False))
        fill = (lambda param, expert, out, owner=owner: reader.read_expert_into(f"{owner}.{param}", expert, out)) \
            if on_meta else None
        quantize_experts(sub, qconfig, device=device, fill=fill)


def check_experts_interface(module: nn.Module) -> None:
    """Raise UnsupportedModelError unless `module` declares transformers' experts interface, which the 4-bit forward
    follows (`use_experts_implementation`: `has_gate`, `has_bias`, `is_transposed`)."""
    missing = [a for a in ("has_gate", "has_bias", "is_transposed") if not hasattr(module, a)]
    if missing:
        raise UnsupportedModelError(
            f"{type(module).__name__} holds 3-D expert parameters but not transformers' experts interface "
            f"(missing {', '.join(missing)}); hfsplit cannot run its experts in 4 bits: --quantize-experts off")


def placeholder(shape: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """A frozen parameter of `shape` and `dtype` holding one NaN (expanded): what a 4-bit experts module shows peft
    and shape readers in place of its 3-D parameter; any computation with it gives NaN, never a silent wrong value."""
    return nn.Parameter(torch.full((), float("nan"), dtype=dtype, device=device).expand(*shape), requires_grad=False)


def is_placeholder(param: torch.Tensor) -> bool:
    """Whether `param` is a 4-bit experts module's placeholder (one value, expanded)."""
    return param.dim() == 3 and param.numel() > 1 and all(s == 0 for s in param.stride())


class QuantizedExperts:
    """Mixin ahead of a transformers experts class: its forward runs on the 4-bit experts."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return quantized_experts_forward(self, hidden_states, top_k_index, top_k_weights)


_CLASSES: dict[type, type] = {}


def quantized_class(cls: type) -> type:
    """`cls` with `QuantizedExperts` ahead of it (one class per experts class)."""
    if issubclass(cls, QuantizedExperts):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"NF4{cls.__name__}", (QuantizedExperts, cls), {"__module__": __name__})
    return _CLASSES[cls]


def is_quantized_experts(module: nn.Module) -> bool:
    """Whether `module` runs its experts in 4 bits (`quantize_experts`)."""
    return isinstance(module, QuantizedExperts)


def dequantized_experts(module: nn.Module, name: str) -> torch.Tensor:
    """Parameter `name` of a 4-bit experts module, every expert dequantized: `[experts, d1, d2]` (a merge, a save)."""
    store = module.nf4_experts[name]
    return store.dequantize(range(store.experts))


# --- forward ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Routing:
    """Where each (token, k) row goes, sorted by expert as transformers' grouped forward sorts them.

    Args:
        order: the rows (token-major, `token · top_k + k`) in expert order.
        inverse: position of each row in `order` (to restore token order).
        experts: the experts that received a row, ascending (a host list: what is dequantized).
        routed: the same as a tensor on the device.
        offsets: cumulative rows per routed expert (int32, `grouped_mm`'s `offs`).
        expert_of_row: the expert of each sorted row (for per-expert biases).
        all_offsets: cumulative rows per expert, every expert (for matrices held for all experts: LoRA's).
    """

    order: torch.Tensor
    inverse: torch.Tensor
    experts: list[int]
    routed: torch.Tensor
    offsets: torch.Tensor
    expert_of_row: torch.Tensor
    all_offsets: torch.Tensor


def route(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """The `Routing` of `top_k_index` (tokens × top-k expert ids)."""
    flat = top_k_index.reshape(-1)
    expert_of_row, order = torch.sort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    routed = counts.nonzero().flatten()
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return Routing(order, inverse, routed.tolist(), routed, counts[routed].cumsum(0).to(torch.int32), expert_of_row,
                   counts.cumsum(0).to(torch.int32))


def quantized_experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' grouped experts forward (`grouped_mm_experts_forward`) on 4-bit experts: `(tokens, hidden)`."""
    first = "gate_up_proj" if module.has_gate else "up_proj"
    routing = route(top_k_index, module.nf4_experts[first].experts)
    rows = hidden_states[routing.order // top_k_index.shape[-1]]
    projected = _expert_linear(module, first, rows, routing)
    projected = module._apply_gate(projected) if module.has_gate else module.act_fn(projected)
    projected = _expert_linear(module, "down_proj", projected, routing)
    if getattr(module, "has_post_expert_norm", False):
        projected = module.post_expert_norm(projected)
    weighted = projected * top_k_weights.reshape(-1)[routing.order].unsqueeze(-1)
    out = weighted[routing.inverse].view(*top_k_index.shape, -1).sum(dim=1)  # fp32 when the routing weights are
    return out.to(hidden_states.dtype)


def _expert_linear(module: nn.Module, name: str, rows: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Each sorted row through its expert's matrix of parameter `name` (+ its LoRA, + its bias)."""
    store = module.nf4_experts[name]
    rows = rows.to(store.dtype)
    out = _FrozenGroupedLinear.apply(rows, routing.offsets, store, routing.experts, module.is_transposed)
    adapter = expert_adapters(module, name)
    if adapter is not None:  # every expert's factors, unrouted ones as empty groups: views of the adapters, no copy
        down, up, scaling = adapter  # [E, r, in], [E, out, r]
        low = grouped_matmul(rows, down.to(store.dtype).transpose(-2, -1), routing.all_offsets)
        # B's per-expert slices are strided across experts: one contiguous copy, which backward keeps
        up = up.to(store.dtype).transpose(-2, -1).contiguous()
        out = out + scaling * grouped_matmul(low, up, routing.all_offsets)
    if module.has_bias:
        out = out + getattr(module, f"{name}_bias")[routing.expert_of_row]
    return out


class _FrozenGroupedLinear(torch.autograd.Function):
    """`grouped_mm(rows, W)` with W the routed experts' matrices dequantized for the call and freed after it:
    saves only the offsets, and backward dequantizes the same experts again for the input gradient."""

    @staticmethod
    def forward(ctx, rows, offsets, store, experts, transposed):
        ctx.store, ctx.experts, ctx.transposed = store, experts, transposed
        ctx.save_for_backward(offsets)
        return grouped_matmul(rows, _input_major(store.dequantize(experts), transposed), offsets)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        weight = _input_major(ctx.store.dequantize(ctx.experts), ctx.transposed)
        return grouped_matmul(grad.contiguous(), weight.transpose(-2, -1), offsets), None, None, None, None


def _input_major(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """`[n, in, out]` of expert matrices held `[n, out, in]` (or already `[n, in, out]`: `is_transposed`)."""
    return weight if transposed else weight.transpose(-2, -1)


def grouped_matmul(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`(S, in)` rows, grouped by `offsets`, each group times its `(in, out)` matrix of `weight` `[n, in, out]`:
    torch's `grouped_mm` where it runs (CPU; CUDA from compute capability 8.0), else a loop of matmuls."""
    if rows.shape[0] == 0 or weight.shape[0] == 0:
        return rows.new_zeros(rows.shape[0], weight.shape[-1])
    if _grouped_mm_runs(rows.device):
        return torch.nn.functional.grouped_mm(rows, weight, offs=offsets)
    bounds = [0] + offsets.tolist()
    return torch.cat([rows[a:b] @ weight[i] for i, (a, b) in enumerate(zip(bounds, bounds[1:]))])


def _grouped_mm_runs(device: torch.device) -> bool:
    if not hasattr(torch.nn.functional, "grouped_mm"):
        return False
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0))


# --- LoRA on 4-bit experts --------------------------------------------------------------------------


@contextmanager
def adapting(module: nn.Module, name: str, factors: tuple[torch.Tensor, torch.Tensor, float]):
    """Within: parameter `name` of the 4-bit experts `module` carries the LoRA `factors` (down `[E, r, in]`, up
    `[E, out, r]`, scaling), applied split to each routed expert's rows."""
    module.expert_adapters[name] = factors
    try:
        yield
    finally:
        module.expert_adapters.pop(name, None)


def expert_adapters(module: nn.Module, name: str):
    """The LoRA factors on parameter `name` of 4-bit experts `module`, or None: set by hfsplit's wrapper
    (`adapting`), or by peft's own `ParamWrapper`, which registers its factors as a parametrization of the
    parameter for the call (`_LoraFactorsProxy`: `ΔW = lhs @ rhs` in the parameter's layout)."""
    if name in module.expert_adapters:
        return module.expert_adapters[name]
    parametrizations = getattr(module, "parametrizations", None)
    if parametrizations is None or name not in parametrizations:
        return None
    (proxy,) = list(parametrizations[name])
    if not hasattr(proxy, "lhs"):  # several adapters at once: peft sums their full ΔW
        raise UnsupportedModelError(f"{type(module).__name__}.{name}: 4-bit experts take one active LoRA adapter "
                                    "at a time (peft's summed ΔW of several would be every expert's, in 16 bits)")
    if module.is_transposed:  # [E, in, out]: ΔW = Aᵀ Bᵀ, lhs [E, in, r], rhs [E, r, out]
        return proxy.lhs.transpose(-2, -1), proxy.rhs.transpose(-2, -1), proxy.scaling
    return proxy.rhs, proxy.lhs, proxy.scaling  # [E, out, in]: ΔW = B A, lhs [E, out, r], rhs [E, r, in]
