"""The MoE router auxiliary loss on a pipeline, exactly as transformers adds it.

transformers' `load_balancing_loss_func` (Mixtral, Qwen3-MoE) concatenates the router logits of every layer of
one forward and takes per-expert means over (layers × tokens) before their product:

    aux = E · Σ_e (Σ_layers count_e / rows) · (Σ_layers Σ_tokens softmax(logits)_e / rows)

so per-stage losses do not add up to it. Each stage instead continues three running sums — top-k assignments
per expert, router probability per expert, rows — in one `[2E + 1]` fp32 tensor that travels the pipeline
beside the hidden states (the probability part keeps its gradient, back to every stage's routers), folded
in layer by layer in the same order and the same arithmetic as transformers, and the last stage forms the
loss. transformers adds `router_aux_loss_coef` × aux to the loss only when `output_router_logits` is set, so
only then is anything carried. The pipeline runs without an attention mask (no padding rows), as
transformers' forward called without one; a step given a token mask (DPO's padded pairs, as TRL's DPOTrainer
passes its attention mask) folds in the real tokens only, as `load_balancing_loss_func` does with a mask.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from hfsplit.errors import UnsupportedModelError


class RouterStats:
    """Records the router logits of one stage's blocks during a forward and folds them into the running sums.

    Args:
        config: the model's config (`num_experts_per_tok`, the expert count, `router_aux_loss_coef`).
        routers: the stage's router modules (transformers' `_can_record_outputs["router_logits"]` class).
        index: which element of a router's output holds its logits (the recorder's `index`).
    """

    def __init__(self, *, config, routers: list[nn.Module], index: int):
        self.experts = config.num_local_experts if hasattr(config, "num_local_experts") else config.num_experts
        self.top_k = config.num_experts_per_tok
        self.coef = config.router_aux_loss_coef
        self.active = False  # set for training steps (`carrying`); inference sends hidden states only
        self._recording = False
        self._logits: list[torch.Tensor] = []
        self._mask: Optional[torch.Tensor] = None
        self._index = index
        for router in routers:
            router.register_forward_hook(self._record)

    def _record(self, module, args, output) -> None:
        if self._recording:  # not during an activation-checkpointing recompute in the backward
            self._logits.append(output[self._index])

    def begin(self, mask: Optional[torch.Tensor] = None) -> None:
        """Record this forward's router logits; `mask` `(batch, seq)`: the real tokens (None: every position)."""
        self._logits.clear()
        self._mask = mask.reshape(-1) if mask is not None else None
        self._recording = True

    def finish(self, stats: Optional[torch.Tensor], *, device: torch.device) -> torch.Tensor:
        """The running sums after this stage's layers (`stats`: the previous stage's, None on the first)."""
        self._recording = False
        if stats is None:
            stats = torch.zeros(2 * self.experts + 1, dtype=torch.float32, device=device)
        tokens, probs, rows = stats[:self.experts], stats[self.experts:-1], stats[-1:]
        # as transformers: floats where histc needs them (CPU, MPS), integers for determinism on GPUs
        histc_dtype = torch.float32 if device.type in ("cpu", "mps") else torch.int32
        for logits in self._logits:  # transformers' per-layer reductions (load_balancing_loss_func)
            if self._mask is not None:  # with its attention mask: the means over the real tokens only
                logits = logits[self._mask.to(logits.device)]
            weights = torch.nn.functional.softmax(logits, dim=-1)
            _, selected = torch.topk(weights, self.top_k, dim=-1)
            tokens = tokens + torch.histc(selected.reshape(-1).to(histc_dtype), bins=self.experts, min=0,
                                          max=self.experts)
            probs = probs + weights.float().sum(dim=0)
            rows = rows + weights.shape[0]
        self._logits.clear()
        return torch.cat([tokens, probs, rows])

    def loss(self, stats: torch.Tensor) -> torch.Tensor:
        """The auxiliary loss from the sums over every layer, as `load_balancing_loss_func` normalises them."""
        rows = stats[-1]
        tokens_per_expert = stats[:self.experts] / rows
        router_prob_per_expert = stats[self.experts:-1] / rows
        return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * self.experts


def router_stats_of(config, model: nn.Module, blocks: Iterable[nn.Module]) -> Optional[RouterStats]:
    """RouterStats for a stage holding `blocks` of `model` (the meta-built full model, whose class declares
    which module records router logits), or None when the model adds no router loss to its training loss."""
    if not getattr(config, "output_router_logits", False):
        return None
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is None:  # the loss would silently lack its router term
        raise UnsupportedModelError(f"{type(model).__name__} declares no router_logits recorder, so hfsplit cannot add "
                                    "its router auxiliary loss; set output_router_logits=False or train it with "
                                    "transformers itself")
    routers = [m for block in blocks for m in block.modules() if isinstance(m, recorder.target_class)]
    return RouterStats(config=config, routers=routers, index=recorder.index)


def stats_of(stages: Iterable[nn.Module]) -> list[RouterStats]:
    return [s.router for s in stages if getattr(s, "router", None) is not None]


@contextmanager
def carrying(stages: Iterable[nn.Module]):
    """Within: the stages carry the router sums (a training step's schedule); outside, hidden states only."""
    stats = stats_of(stages)
    for s in stats:
        s.active = True
    try:
        yield
    finally:
        for s in stats:
            s.active = False


def with_router_loss(loss_fn: Callable, stages: Iterable[nn.Module], *, forwards: int = 1) -> Callable:
    """`loss_fn` plus `router_aux_loss_coef` × the auxiliary loss the last stage returns beside its logits, as
    transformers' forward adds it, divided by `forwards` (the step's micro-batches × replicas: the step's router
    term is the mean of its forwards', while `loss_fn` gives each micro-batch's part of the step's token mean);
    `loss_fn` itself when the model carries no router loss."""
    stats = stats_of(stages)
    if not stats:
        return loss_fn
    coef = stats[0].coef

    def loss(output, target, **kwargs):
        logits, aux = output
        return loss_fn(logits, target, **kwargs) + coef * aux.to(logits.device) / forwards

    return loss
