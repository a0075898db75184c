"""The run's optimizer as the plan decided it per stage: torch's AdamW, or bitsandbytes' 8-bit AdamW.

`adamw_torch`, `adamw_8bit` and `paged_adamw_8bit` are transformers' names (`TrainingArguments.optim`); the 8-bit
ones are bitsandbytes' `AdamW8bit` / `PagedAdamW8bit`, whose moments are one byte a value with an fp32 absmax per
block of 256 (`hfsplit.planning.costs.optimizer` counts them for the plan). They run on CPU tensors too; paged ones fall back to
non-paged there, as bitsandbytes says.

bitsandbytes' kernels take plain tensors, and a tensor-parallel stage's parameters are DTensors: the 8-bit
optimizer steps plain parameters that share each DTensor's local piece (`_pieces`), its gradient handed over
before each step. `moments` and `load_moments` read and write the two Adam moments as fp32 tensors shaped like
the parameter's local piece whatever the optimizer keeps (the trainer's checkpoints, `hfsplit.training.resume`);
`raw_state` / `load_raw_state` move the 8-bit codes and absmax as they are.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hfsplit.errors import PlanError
from hfsplit.plan import is_8bit

RAW_KEYS = ("state1", "state2", "absmax1", "absmax2")  # bitsandbytes' 8-bit state of one tensor, besides its step
BLOCKSIZE = 256


def optim_of_rank(plan, stage_indices) -> str:
    """The optimizer the plan gives this rank's stages (one per rank: the planner decides per pipeline rank)."""
    optims = {plan.optim_of(s) for s in plan.stages if s.index in stage_indices}
    if len(optims) > 1:
        raise PlanError(f"stages {sorted(stage_indices)} of one rank have optimizers {sorted(optims)}; a rank runs "
                        "one optimizer: re-plan, or give --optim")
    return optims.pop()


def build_optimizer(params: list[nn.Parameter], *, optim: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer `optim` (an `OPTIMS` name) over `params`, with transformers' AdamW defaults (betas 0.9 / 0.999,
    eps 1e-8)."""
    if not is_8bit(optim):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    import bitsandbytes as bnb  # lazy: its import pulls torch's inductor (seconds), which fp32 runs never need

    base = bnb.optim.PagedAdamW8bit if optim == "paged_adamw_8bit" else bnb.optim.AdamW8bit
    return _on_pieces(base)(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999), eps=1e-8)


class OnLocalPieces:
    """Mixed into a bitsandbytes optimizer: it steps plain parameters sharing the local pieces of DTensor ones."""

    def __init__(self, params, **kwargs):
        params = list(params)
        self.pieces = {p: _piece(p) for p in params}
        super().__init__([self.pieces[p] for p in params], **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        for p, piece in self.pieces.items():
            if piece is not p:
                piece.grad = None if p.grad is None else p.grad.to_local()
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for p, piece in self.pieces.items():
            if piece is not p and p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def state_of(self, p: nn.Parameter) -> dict:
        return self.state[self.pieces[p]]


@functools.lru_cache(maxsize=None)
def _on_pieces(base: type) -> type:
    return type(f"{base.__name__}OnLocalPieces", (OnLocalPieces, base), {})


def _piece(p: nn.Parameter) -> nn.Parameter:
    """`p`, or for a DTensor a plain parameter sharing its local piece's storage."""
    if not isinstance(p, DTensor):
        return p
    with torch.no_grad():
        return nn.Parameter(p.to_local(), requires_grad=True)


def state_of(optimizer, p: nn.Parameter) -> dict:
    """The optimizer's state of `p` ({} before its first step)."""
    if isinstance(optimizer, OnLocalPieces):
        return optimizer.state_of(p)
    return optimizer.state.get(p, {})


def is_8bit_state(state: dict) -> bool:
    return "state1" in state


def moments(optimizer, p: nn.Parameter) -> Optional[tuple[torch.Tensor, torch.Tensor, float]]:
    """(exp_avg, exp_avg_sq, step) of `p` as fp32 tensors shaped like its local piece (8-bit codes dequantized),
    or None before its first step."""
    state = state_of(optimizer, p)
    if not state:
        return None
    step = float(state["step"])
    if not is_8bit_state(state):
        return state["exp_avg"], state["exp_avg_sq"], step
    if state["state1"].dtype == torch.float32:  # a tensor under min_8bit_size: fp32 moments there too
        return state["state1"], state["state2"], step
    import bitsandbytes.functional as F  # lazy: see build_optimizer

    first = F.dequantize_blockwise(state["state1"], absmax=state["absmax1"], code=state["qmap1"], blocksize=BLOCKSIZE)
    second = F.dequantize_blockwise(state["state2"], absmax=state["absmax2"], code=state["qmap2"], blocksize=BLOCKSIZE)
    return first, second, step


def raw_state(optimizer, p: nn.Parameter) -> dict[str, torch.Tensor]:
    """bitsandbytes' 8-bit codes and absmax of `p` as they are ({} for fp32 moments): what resumes it exactly."""
    state = state_of(optimizer, p)
    if not is_8bit_state(state) or state["state1"].dtype != torch.uint8:
        return {}
    return {key: state[key] for key in RAW_KEYS}


def load_moments(optimizer, p: nn.Parameter, *, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: float,
                 raw: Optional[dict] = None) -> None:
    """Make `exp_avg`, `exp_avg_sq` (fp32, like `p`'s local piece) and `step` `p`'s state: as they are for torch's
    AdamW; for an 8-bit optimizer `raw` (its codes and absmax, exact) where given, else the moments quantized
    blockwise as bitsandbytes' step would (re-quantized)."""
    if not isinstance(optimizer, OnLocalPieces):
        optimizer.state[p] = {"step": torch.tensor(float(step)), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        return
    piece = optimizer.pieces[p]
    gindex, pindex = next((g, i) for g, group in enumerate(optimizer.param_groups)
                          for i, q in enumerate(group["params"]) if q is piece)
    optimizer.init_state(optimizer.param_groups[gindex], piece, gindex, pindex)
    state = optimizer.state[piece]
    state["step"] = int(step)
    if state["state1"].dtype == torch.float32:
        state["state1"].copy_(exp_avg.reshape(state["state1"].shape))
        state["state2"].copy_(exp_avg_sq.reshape(state["state2"].shape))
        return
    if raw is not None:
        for key in RAW_KEYS:
            state[key].copy_(raw[key])
        return
    import bitsandbytes.functional as F  # lazy: see build_optimizer

    for moment, codes, absmax, qmap in ((exp_avg, "state1", "absmax1", "qmap1"), (exp_avg_sq, "state2", "absmax2", "qmap2")):
        quantized, quant_state = F.quantize_blockwise(moment.reshape(state[codes].shape).contiguous(), code=state[qmap],
                                                      blocksize=BLOCKSIZE)
        state[codes].copy_(quantized)
        state[absmax].copy_(quant_state.absmax)
