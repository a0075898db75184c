"""A pipeline stage built from the model's own modules, following `base_model_pp_plan`.

The whole model is built on the meta device (no memory), the stage keeps only its
blocks (embeddings on the first stage, final norm + lm_head on the last), and only
then are this rank's parameters materialised from the checkpoint. Parameter names
equal checkpoint keys ("model.layers.7.mlp.up_proj.weight"), so loading, saving and
comparing against transformers need no renaming.

Each stage recomputes the position ids, rotary embeddings and causal mask itself:
only hidden states travel between stages.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from hfsplit.models import check_pp_plan, family_of, meta_model, recompute_buffers
from hfsplit.plan import Stage
from hfsplit.parallel.router import router_stats_of


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

    def forward(self, x: torch.Tensor, router_sums: Optional[torch.Tensor] = None, cache=None):
        """`cache` (a transformers Cache of this stage's layers, for generation) continues after the
        positions it holds; without it the sequence starts at position 0. While `router.active` (a training
        step of an MoE model adding its router loss) it also takes and returns the router sums (the last
        stage: the logits and the auxiliary loss)."""
        carry = self.router is not None and self.router.active
        if carry:
            self.router.begin()
        if self.body.embed_tokens is not None:
            x = self.family.input_side(self.config, self.body.embed_tokens(x))
        layers = [int(name) for name in self.body.layers]
        past = cache.get_seq_length(layers[0]) if cache is not None and layers else 0
        positions = torch.arange(past, past + x.shape[1], device=x.device).unsqueeze(0)
        masks = causal_masks(self.config, hidden=x, position_ids=positions, cache=cache, layers=layers)
        kinds = {index: layer_attention_type(self.config, index) for index in layers}
        rotary = self.family.position_embeddings(self.rotary_emb, x, positions, set(kinds.values()))
        for name, layer in self.body.layers.items():
            kind = kinds[int(name)]
            x = layer(x, attention_mask=masks[kind], position_embeddings=rotary[kind], position_ids=positions,
                      cache=cache, use_cache=cache is not None)
        if self.body.norm is not None:
            x = self.body.norm(x)
            if not self.head_in_loss:  # a chunked loss runs lm_head itself (hfsplit/parallel/chunked_loss.py)
                x = self.family.output_side(self.config, self.lm_head(x))
        if carry:
            sums = self.router.finish(router_sums, device=x.device)
            return (x, self.router.loss(sums)) if self.body.norm is not None else (x, sums)
        return x


def layer_attention_type(config, index: int) -> str:
    """"full_attention" or "sliding_attention" for layer `index`, as the model's own forward picks it."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def causal_masks(config, *, hidden: torch.Tensor, position_ids: torch.Tensor, cache=None,
                 layers: tuple[int, ...] | list[int] = ()) -> dict[str, Optional[torch.Tensor]]:
    """Attention masks by attention type, as the model's own forward builds them; with `cache`, over the cached
    positions too (sized from the first of this stage's `layers` of each type: a stage's cache holds only its own).

    Under sdpa a causal mask without padding is None, as in transformers: sdpa's causal flag replaces it, and a
    materialised mask costs a float copy per block that backward keeps (measured: ~0.29 GiB on SmolLM2 at seq
    512 × 4). Eager attention always gets a tensor (transformers' `eager_mask` never skips), so None never means
    non-causal there.
    """
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    def first_layer(kind: str):
        return next((i for i in layers if layer_attention_type(config, i) == kind), None) if cache is not None else None

    kwargs = dict(config=config, inputs_embeds=hidden, attention_mask=None, cache=cache,
                  position_ids=position_ids)
    masks = {"full_attention": create_causal_mask(**kwargs, layer_idx=first_layer("full_attention"))}
    if getattr(config, "sliding_window", None):
        masks["sliding_attention"] = create_sliding_window_causal_mask(
            **kwargs, layer_idx=first_layer("sliding_attention"))
    return masks


def materialize_buffers(module: StageModule, *, device: torch.device) -> None:
    """Rebuild the rotary embedding and the other non-persistent buffers (absent from checkpoints) on `device`."""
    with torch.device(device):
        module.rotary_emb = type(module.rotary_emb)(config=module.config)
    recompute_buffers(module, module._init_weights, device=device)


def load_stage_weights(module: StageModule, *, reader, device: torch.device, dtype: Optional[torch.dtype] = None,
                       tp_rank: int = 0, tp_size: int = 1) -> None:
    """Replace every meta parameter of `module` with this rank's bytes read from `reader`.

    Parameters that TP turned into DTensors are read as this rank's slice only. A tied
    lm_head reads the embedding matrix (the reader maps the name).
    """
    from torch.distributed.tensor import DTensor

    from hfsplit.parallel.tensor import shard_layout

    for key, param in list(module.named_parameters()):
        if isinstance(param, DTensor):
            if layout := shard_layout(param):  # (dim, packed halves): fused experts' gate_up_proj holds [gate_r; up_r]
                local = reader.read_slice(key, layout[0], tp_rank, tp_size, dtype=dtype, device=device,
                                          packed=layout[1])
            else:
                local = reader.read(key, dtype=dtype, device=device)
            value = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)
        else:
            value = reader.read(key, dtype=dtype, device=device)
        set_parameter(module, key, nn.Parameter(value, requires_grad=param.requires_grad))
    if module.shares_embedding:  # named_parameters listed the shared matrix once, under the embedding
        module.lm_head.weight = module.body.embed_tokens.weight
    materialize_buffers(module, device=device)


def set_parameter(module: nn.Module, name: str, value: nn.Parameter) -> None:
    """Assign `value` to the dotted parameter `name` of `module`."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    setattr(owner, leaf, value)
