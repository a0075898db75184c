"""A pipeline stage built from the model's own modules, following `base_model_pp_plan`.

The whole model is built on the meta device (no memory), the stage keeps only its
blocks (embeddings on the first stage, final norm + lm_head on the last), and only
then are this rank's parameters materialised from the checkpoint. Parameter names
equal checkpoint keys ("model.layers.7.mlp.up_proj.weight"), so loading, saving and
comparing against transformers need no renaming.

Each stage builds its rotary embeddings and attention masks itself, from the position ids every stage is given
(the pipeline hands them to each stage as a keyword argument: they restart at 0 for each example of a packed row,
and attention stays inside each example: under sdpa each example runs on its own, `hfsplit.models.varlen`, found
once per micro-batch; otherwise transformers' mask builders): only hidden states travel between stages.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from hfsplit.models.families import FAMILIES, check_pp_plan, family_of
from hfsplit.models.layout import meta_model
from hfsplit.models.masks import causal_masks, layer_attention_type
from hfsplit.parallel.followed_stage import FollowedStage
from hfsplit.parallel.router import router_stats_of
from hfsplit.plan import Stage


def build_stage_module(*, config, stage: Stage, tied: bool) -> nn.Module:
    """This stage's module, on meta: a declared family's `StageModule` (its outside work redone as declared, packed
    rows under sdpa example by example), any other causal LM's `FollowedStage` (its own forward, proven on the
    user's config by `hfsplit.load.proof` before a run builds it)."""
    if config.model_type in FAMILIES:
        return StageModule(config=config, stage=stage, tied=tied)
    return FollowedStage(config=config, stage=stage, tied=tied)


class StageModule(nn.Module):
    """One pipeline stage: `forward(input_ids or hidden_states) -> hidden_states or logits`.

    Args:
        config: the transformers config of the model.
        stage: the plan's stage (layer range, embed / head flags).
        tied: lm_head shares the embedding matrix (a last stage without the embeddings keeps its own copy).
    """

    def __init__(self, *, config, stage: Stage, tied: bool):
        super().__init__()
        self.config = config
        self.stage_index = stage.index
        self.has_embed = stage.has_embed
        self.has_head = stage.has_head
        self.head_in_loss = False
        # A stage is built from the blocks alone: only declared families, whose outside work it redoes, split right.
        self.family = family_of(config)
        self.layer_range = tuple(stage.layers)
        full = meta_model(config)
        self._init_weights = full._init_weights  # recomputes buffers no checkpoint holds (`materialize_buffers`)
        base = getattr(full, full.base_model_prefix)
        check_pp_plan(base)
        # A plain container named like the base model keeps parameter names equal to checkpoint keys.
        body = nn.Module()
        body.embed_tokens = base.embed_tokens if stage.has_embed else None
        body.layers = nn.ModuleDict({str(i): base.layers[i] for i in range(*stage.layers)})
        body.norm = base.norm if stage.has_head else None
        setattr(self, full.base_model_prefix, body)
        self.body_name = full.base_model_prefix  # the base model's attribute name ("model"): checkpoint keys start with it
        self.lm_head = full.lm_head if stage.has_head else None
        # A stage holding both ends keeps one shared matrix; a last stage without the
        # embeddings holds its own copy, whose gradient is summed with the first stage's.
        self.shares_embedding = tied and stage.has_embed and stage.has_head
        if self.lm_head is not None and tied and not self.shares_embedding:
            self.lm_head.weight = nn.Parameter(torch.empty_like(self.lm_head.weight))
        self.rotary_emb = base.rotary_emb  # rebuilt on the real device by `materialize_buffers`
        # MoE: the running router sums the training loss needs travel with the hidden states (parallel/router.py)
        self.router = router_stats_of(config, full, body.layers.values()) if self.family.router_aux_loss else None

    @property
    def body(self) -> nn.Module:
        return getattr(self, self.body_name)

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits from the final hidden states, as the model's forward makes them (lm_head, the family's scaling)."""
        return self.family.output_side(self.config, self.lm_head(hidden))

    def forward(self, x: torch.Tensor, router_sums: Optional[torch.Tensor] = None, cache=None,
                position_ids: Optional[torch.Tensor] = None, router_mask: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, logits_to_keep: int = 0):
        """`position_ids` `(batch, seq)`: each token's position within its example (a packed row restarts at 0
        for each); None: one sequence per row, from 0 or, with `cache` (a transformers Cache of this stage's
        layers, for generation), after the positions it holds. While `router.active` (a training step of an
        MoE model adding its router loss) it also takes and returns the router sums (the last stage: the
        logits and the auxiliary loss); `router_mask` `(batch, seq)`: the tokens those sums count (None: all).
        `attention_mask` `(batch, cached + seq)`: generation's 2-D padding mask (left-padded prompts), as
        transformers' forward takes it; None: no padding. `logits_to_keep`: the last stage's head runs on the last
        so many positions only (generation needs the last one's logits), as transformers' argument; 0: all."""
        carry = self.router is not None and self.router.active
        if carry:
            self.router.begin(router_mask)
        if self.body.embed_tokens is not None:
            x = self.family.input_side(self.config, self.body.embed_tokens(x))
        layers = [int(name) for name in self.body.layers]
        positions = position_ids if position_ids is not None else \
            default_positions(x, past=cache.get_seq_length(layers[0]) if cache is not None and layers else 0)
        masks = causal_masks(self.config, hidden=x, position_ids=positions, cache=cache, layers=layers,
                             attention_mask=attention_mask)
        kinds = {index: layer_attention_type(self.config, index) for index in layers}
        rotary = self.family.position_embeddings(self.rotary_emb, x, positions, set(kinds.values()))
        for name, layer in self.body.layers.items():
            kind = kinds[int(name)]
            x = layer(x, attention_mask=masks[kind], position_embeddings=rotary[kind], position_ids=positions,
                      cache=cache, use_cache=cache is not None)
        if self.body.norm is not None:
            x = self.body.norm(x[:, -logits_to_keep:] if logits_to_keep else x)
            if not self.head_in_loss:  # a chunked loss runs lm_head itself (hfsplit/models/loss.py)
                x = self.family.output_side(self.config, self.lm_head(x))
        if carry:
            sums = self.router.finish(router_sums, device=x.device)
            return (x, self.router.loss(sums)) if self.body.norm is not None else (x, sums)
        return x


def default_positions(x: torch.Tensor, *, past: int = 0) -> torch.Tensor:
    """Position ids `(1, seq)` of rows that are one sequence each, continuing after `past` cached positions."""
    return torch.arange(past, past + x.shape[1], device=x.device).unsqueeze(0)
