"""The tensor-parallel step: each stage sharded by the model's own `base_model_tp_plan`.

Implementation: torch DTensor `parallelize_module` (ColwiseParallel / RowwiseParallel),
applied to the stage while it is still on the meta device; each parameter is then
materialised as `DTensor.from_local(this rank's slice)`, so a rank never reads another
rank's slice. Activations between modules are plain tensors (the styles' default
`use_local_output=True`), so the pipeline only ever sees ordinary tensors.

Beyond the block plan: the input embedding is sharded over the vocabulary, whether or not the plan
names it (RowwiseParallel on nn.Embedding: masked lookup + all-reduce) and lm_head over the
vocabulary with its output gathered (the model's own `colwise_gather_output`), so
both ends of a tied pair hold matching `Shard(0)` pieces.

Attention needs no per-rank head counts: transformers 5 attention reshapes with
`view(*shape, -1, head_dim)` and uses `num_key_value_groups` (heads / kv heads, the
same on every rank since both divide by the TP degree); q/k/v rows are head-major,
so an even row split hands each rank whole query heads and their own KV heads.
"""
from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle
from torch.utils.weak import WeakIdKeyDictionary

from hfsplit.apply.tp_experts import ExpertsParallel
from hfsplit.errors import UnsupportedModelError
from hfsplit.models.families import (
    COLWISE_GATHERED, EMBEDDING_ROWWISE, MLA_KV_A, MOE_EXPERTS, PACKED_COLWISE, PACKED_ROWWISE, REPLICATED_SUMMED,
    ROWWISE_OWN_OUTPUT, ROWWISE_WHOLE_INPUT, expert_tp_params, tp_plan_of,
)
from hfsplit.plan.steps import Step


def block_styles(config) -> dict[str, object]:
    """ParallelStyles of one stage keyed by module path pattern, from `config.base_model_tp_plan`; the input
    embedding's under the plan's own name (`embedding_rowwise`), else under "embed_tokens" (see `embedding_patterns`)."""
    tp_plan = tp_plan_of(config)
    if not tp_plan:
        raise UnsupportedModelError(f"{type(config).__name__} declares no base_model_tp_plan; use tp=1")
    styles, experts = {}, expert_tp_params(config)
    inside = {f"{module}.{name}" for module, params in experts.items() for name in params}
    for pattern, kind in tp_plan.items():
        if pattern in inside or kind == REPLICATED_SUMMED:
            continue  # a fused experts module's own parameter (its module's style shards it), or one kept whole
        if kind == MOE_EXPERTS:
            styles[pattern] = expert_style(config, pattern, experts[pattern])
        elif kind in LINEAR_STYLES:
            styles[pattern] = linear_style(kind)
        elif kind == MLA_KV_A:
            styles[pattern] = RopeGradSummed(config.qk_rope_head_dim)
        else:
            raise UnsupportedModelError(
                f"{type(config).__name__}: tensor-parallel style {kind!r} of {pattern} is not supported yet; use tp=1"
            )
    for pattern in embedding_patterns(config):
        styles[pattern] = linear_style(EMBEDDING_ROWWISE)
    return styles


# The plan's styles of single modules, as torch's ParallelStyles (`linear_style`).
LINEAR_STYLES = ("colwise", "rowwise", COLWISE_GATHERED, ROWWISE_WHOLE_INPUT, EMBEDDING_ROWWISE, ROWWISE_OWN_OUTPUT)


def linear_style(kind: str):
    """The torch ParallelStyle of plan style `kind` (one of LINEAR_STYLES). A gathered column-wise output is every
    column on every rank, so a fused projection split after it ([q; k; v]) needs no per-part row split; a whole input
    is sliced on each rank to the rows its row-wise shard holds. The embedding: a masked lookup of this rank's
    vocabulary rows, summed over the ranks."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
            COLWISE_GATHERED: lambda: ColwiseParallel(output_layouts=Replicate()),
            ROWWISE_WHOLE_INPUT: lambda: RowwiseParallel(input_layouts=Replicate()),
            EMBEDDING_ROWWISE: lambda: RowwiseParallel(input_layouts=Replicate()),
            ROWWISE_OWN_OUTPUT: RowwiseOwnOutput}[kind]()


class RowwiseOwnOutput(ParallelStyle):
    """torch's RowwiseParallel, its output then copied into a tensor of its own (`ROWWISE_OWN_OUTPUT`): the model adds
    into it in place, which autograd refuses on the view of the summed DTensor RowwiseParallel returns."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.tensor.parallel import RowwiseParallel

        RowwiseParallel()._apply(module, device_mesh)
        module.register_forward_hook(lambda _m, _i, out: out.clone())
        return module


def embedding_patterns(config) -> tuple[str, ...]:
    """The input embedding's patterns in the plan (`embedding_rowwise`: GPT-NeoX's "embed_in", GPT-J's "wte"), or
    ("embed_tokens",) when the plan names none: hfsplit shards the input embedding over the vocabulary either way,
    so that a tied lm_head's `Shard(0)` pieces match it."""
    named = tuple(p for p, kind in tp_plan_of(config).items() if kind == EMBEDDING_ROWWISE)
    return named or (DEFAULT_EMBEDDING,)


DEFAULT_EMBEDDING = "embed_tokens"


def expert_style(config, pattern: str, params: dict[str, str]):
    """The ParallelStyle of fused experts `pattern` whose parameters the plan packs and splits: `[E, out, in]`
    parameters packed column-wise and split row-wise, or `[E, in, out]` ones (Llama 4) packed row-wise and split
    column-wise; either way the intermediate dim is split (dim 1 of `[E, 2I, H]`, dim 2 of `[E, H, 2I]`)."""
    for packing, splitting, packed_dim, split_dim in ((PACKED_COLWISE, "rowwise", 1, 2),
                                                     (PACKED_ROWWISE, "colwise", 2, 1)):
        packed = {name: packed_dim for name, kind in params.items() if kind == packing}
        split = {name: split_dim for name, kind in params.items() if kind == splitting}
        if packed and split and len(packed) + len(split) == len(params):
            return ExpertsParallel(packed=packed, split=split)
    raise UnsupportedModelError(f"{type(config).__name__}: fused experts {pattern} with parameter styles {params} "
                                "(hfsplit shards one packed_colwise and one rowwise parameter, or one packed_rowwise "
                                "and one colwise); use tp=1")


class RopeGradSummed(ParallelStyle):
    """MLA's `kv_a_proj_with_mqa` (the plan's `mla_kv_a_proj`): whole on every rank, its output `[kv_pass; k_rot]`
    as it is, the gradient of its last `rope_dim` columns summed over the TP group. kv_pass reaches this rank's heads
    through the column-wise kv_b_proj, whose input gradient torch already sums; k_rot, the key's rope part shared by
    every head, goes straight to this rank's heads, so each rank's backward gives only its heads' share of it."""

    def __init__(self, rope_dim: int):
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        group, rope_dim = device_mesh.get_group(), self.rope_dim
        module.register_forward_hook(lambda _m, _i, out: rope_grad_summed(out, rope_dim, group))
        return module


def rope_grad_summed(out: torch.Tensor, rope_dim: int, group) -> torch.Tensor:
    """`out` as it is, the gradient of its last `rope_dim` columns summed over `group` (see `RopeGradSummed`)."""
    kv_pass, k_rot = out.split([out.shape[-1] - rope_dim, rope_dim], dim=-1)
    return torch.cat([kv_pass, GradSummedOverTP.apply(k_rot, group)], dim=-1)


class GradSummedOverTP(torch.autograd.Function):
    """Identity forward; the gradient summed over the TP group (all-reduce) backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def mark_grad_summed(body: nn.Module, config) -> None:
    """Flag the replicated modules whose gradient is partial on each TP rank and must be summed over the
    TP group (Qwen3's per-head q/k norms see only this rank's heads); `SplitModel.sync_grads` sums them."""
    import fnmatch

    patterns = [p for p, kind in tp_plan_of(config).items() if kind == REPLICATED_SUMMED]
    for name, sub in body.named_modules():
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            _GRAD_SUMMED.add(sub)


def grad_summed_over_tp(module: nn.Module) -> bool:
    """Whether `module`'s parameter gradients are summed over the TP group (see `mark_grad_summed`)."""
    return module in _GRAD_SUMMED


def mark_tp_sharded(param: torch.Tensor, *, dim: int) -> None:
    """Record that `param`, a plain tensor (not a DTensor), holds this rank's piece of a tensor split
    along `dim` over the TP group (LoRA adapters of sharded layers); see `tp_shard_dim`."""
    _SHARD_DIM[param] = dim


def tp_shard_dim(param: torch.Tensor) -> Optional[int]:
    """The dim along which a plain (non-DTensor) parameter is split over the TP group, if any."""
    return _SHARD_DIM.get(param)


# The two public registries above, keyed by object identity (a tensor's == is elementwise);
# entries go with their parameters and modules.
_SHARD_DIM: WeakIdKeyDictionary = WeakIdKeyDictionary()
_GRAD_SUMMED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def shard_stages(modules: Sequence[nn.Module], step: Step, inputs) -> Step:
    """The step (on meta, so each rank then reads only its slices): every stage module sharded over this
    rank's TP mesh."""
    for module in modules:
        apply_tp(module, tp_mesh=inputs.ctx.tp_mesh, body_name=module.body_name)
    return step


def apply_tp(module: nn.Module, *, tp_mesh, body_name: str) -> nn.Module:
    """Shard `module` (a StageModule, still on meta) over `tp_mesh` per the model's TP plan."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    body = getattr(module, body_name)
    plan = {}
    embeddings = embedding_patterns(module.config)
    for pattern, style in block_styles(module.config).items():
        # Skip patterns this stage has nothing for (parallelize_module warns on unmatched ones).
        if pattern in embeddings:
            if module.has_embed:
                plan[f"{body_name}.{embedding_path(module, body, named=pattern)}"] = style
            continue
        if pattern.startswith("layers.") and module.layer_range[0] == module.layer_range[1]:
            continue
        plan[f"{body_name}.{pattern}"] = style
    if module.lm_head is not None:
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(module, tp_mesh, plan)
    mark_grad_summed(body, module.config)
    if module.shares_embedding:
        # parallelize_module replaced each module's parameter separately; both are Shard(0) over the vocabulary.
        module.lm_head.weight = body.embed_tokens.weight
    return module


def embedding_path(module: nn.Module, body: nn.Module, *, named: str = DEFAULT_EMBEDDING) -> str:
    """Where the stage's input embedding sits under `body` ("embed_tokens"; a followed stage's model may name it
    otherwise); `named`, the plan's own name for it, must be that module (a tied lm_head is sharded as it is)."""
    embedding = module.body.embed_tokens
    found = next((name for name, sub in body.named_modules() if sub is embedding), None)
    if found is None:
        raise UnsupportedModelError(f"{type(module.config).__name__}: its input embedding is not under "
                                    f"{module.body_name}, where tensor parallelism shards it; use tp=1")
    if named != DEFAULT_EMBEDDING and found != named:
        raise UnsupportedModelError(f"{type(module.config).__name__}: its tensor-parallel plan shards {named} over "
                                    f"the vocabulary, not its input embedding {found}; use tp=1")
    return found


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` gathered to its full shape when it is a DTensor; unchanged otherwise."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local piece of a DTensor (a plain tensor passes through), for in-place collectives."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def shard_layout(t: torch.Tensor) -> Optional[tuple[int, int]]:
    """(dim, packed) of a TP-sharded DTensor: this rank holds part `tp_rank` of each of `packed` equal blocks along
    `dim` (packed=1: a plain `Shard(dim)`; 2: fused experts' `[gate_r; up_r]`, apply/tp_experts.py). None when
    it is not sharded."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    for p in t.placements if isinstance(t, DTensor) else ():
        if isinstance(p, _StridedShard):  # not a Shard subclass
            return p.dim, p.split_factor
        if isinstance(p, Shard):
            return p.dim, 1
    return None
