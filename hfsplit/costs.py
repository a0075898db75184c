"""Cost model: bytes and FLOPs of one decoder block, the embeddings and the head.

Sizes come from the real transformers model class built on the meta device, never
from hand formulas. Activation bytes are measured by tracing one block at the real
dimensions under FakeTensorMode (no allocation), so they follow whatever the
attention implementation and MLP really keep for backward.

The planner relies on exactly the public names below.
"""
from __future__ import annotations

import functools
import math
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import PlanError
from .models import (  # noqa: F401  (re-exported: the planner's and older callers' names)
    FAMILIES, REPLICATED_SUMMED, SUPPORTED_MODEL_TYPES, TP_STYLES, BlockLinear, Family, block_linear_names, block_linears,
    check_causal_lm, check_supported, decoder_layout, meta_model, one_layer_config, routed_expert_numel, tp_degree_error,
    tp_style_of, tp_supported, valid_tp_degrees,
)
from .expert_lora import expert_lora_numel, expert_parameters
from .layer_kinds import kind_config, layer_kinds
from .plan import Method, TrainingSpec  # noqa: F401 (re-exported: TrainingSpec lives with the Plan)

@dataclass(frozen=True)
class PartCost:
    """Costs of one part (the embeddings, one decoder block, or norm + head) on one rank.

    All byte figures are for one tensor-parallel rank (already divided by the TP degree
    where the part is sharded).

    Args:
        param_bytes: weights (frozen + trainable) in the model dtype.
        grad_bytes: gradients of the trainable parameters.
        optimizer_bytes: AdamW moments (fp32) plus fp32 master weights under mixed precision.
        activation_bytes: bytes kept for backward per micro-batch (0 for inference).
        workspace_bytes: transient peak while the part runs once (not multiplied by in-flight micro-batches).
        flops: forward + backward (+ recompute) FLOPs per micro-batch.
        comm_bytes: bytes all-reduced across the TP group per micro-batch (forward + backward).
        deferred_bytes: what a split backward (zero-bubble schedules) keeps from the part's input pass to its
            weight pass: the gradient of each trainable weight's output (see `_deferred_grad_bytes`).
    """

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    workspace_bytes: int
    flops: float
    comm_bytes: int = 0
    deferred_bytes: int = 0

    @property
    def state_bytes(self) -> int:
        """Bytes held for the whole step whatever the schedule: weights, grads, optimizer."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class ModelCosts:
    """Per-part costs of a model for one training spec and TP degree.

    Args:
        num_layers: decoder blocks.
        tp: tensor-parallel degree these figures are for.
        embed: input embeddings (first stage).
        block: one decoder block (all blocks are alike).
        head: final norm + lm_head (+ loss) on the last stage. With tied embeddings the
            head's param_bytes include the shared matrix again, since the last stage holds a copy.
        tied: whether lm_head shares the embedding matrix.
        boundary_bytes: one micro-batch's hidden states, what a stage sends its pipeline neighbour.
        layer_blocks: each layer's own block cost where the layers are of several kinds (Qwen3-MoE's
            `mlp_only_layers`, `hfsplit.layer_kinds`); empty when every layer costs `block` (layer 0's kind).
    """

    num_layers: int
    tp: int
    embed: PartCost
    block: PartCost
    head: PartCost
    tied: bool
    spec: TrainingSpec = field(default_factory=TrainingSpec)
    boundary_bytes: int = 0
    layer_blocks: tuple[PartCost, ...] = ()


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LORA_ADAPTER_DTYPE = torch.float32  # peft's autocast_adapter_dtype=True (its default) upcasts bf16/fp16 adapters
_ADAMW_MOMENT_BYTES = 8  # exp_avg + exp_avg_sq, fp32
_MASTER_WEIGHT_BYTES = 4  # fp32 master copy under mixed precision


def model_costs(config, spec: TrainingSpec, tp: int = 1) -> ModelCosts:
    """Costs of `config`'s model under `spec` with tensor-parallel degree `tp`.

    Args:
        config: a transformers config of a decoder-only causal LM (see `hfsplit.checkpoint.load_config`).
        spec: what one step does.
        tp: tensor-parallel degree; must be one of `valid_tp_degrees(config, tp)`.
    """
    why = tp_degree_error(config, tp)
    if why:
        raise PlanError(why)
    if spec.method not in ("inference", "lora", "qlora", "full"):
        raise PlanError(f"TrainingSpec.method {spec.method!r}: use 'inference', 'lora', 'qlora' or 'full'")
    if spec.method == "qlora" and tp > 1:
        raise PlanError(f"tp={tp} with QLoRA: a bitsandbytes 4-bit weight cannot be sharded by tensor parallelism "
                        "here; use tp=1 (the planner splits QLoRA runs over pipeline stages × data parallelism)")
    _dtype(spec.dtype)  # fail early on an unknown dtype
    return _with_layer_kinds(config, _model_costs(_keyed(config), spec, tp), spec, tp)


def _with_layer_kinds(config, costs: ModelCosts, spec: TrainingSpec, tp: int) -> ModelCosts:
    """`costs` with each layer's block costed by its own kind, where the layers are not all alike."""
    kinds = layer_kinds(config)
    if kinds is None:
        return costs
    if spec.method in ("lora", "qlora") and spec.lora_targets is None:  # the default every kind shares
        spec = replace(spec, lora_targets=tuple(block_linear_names(config)))
        costs = replace(_model_costs(_keyed(config), spec, tp), spec=costs.spec)
    blocks = {}
    for kind in set(kinds):
        blocks[kind] = _model_costs(_keyed(kind_config(config, kind)), spec, tp).block
    return replace(costs, layer_blocks=tuple(blocks[kind] for kind in kinds))


def estimate_peak_bytes(costs: ModelCosts) -> int:
    """Estimated peak of one training step of the whole model in one process (no pipeline), without reserve.

    Training is a steady-state step: AdamW state already exists and `zero_grad(set_to_none=True)`
    freed the gradients, so the peak is the largest of: forward + loss, each part's backward
    (its activations freed as its gradients appear) and the optimizer step. Inference is one
    forward without a KV cache (`use_cache=False`).
    """
    embed, head = costs.embed, costs.head
    blocks = list(costs.layer_blocks) or [costs.block] * costs.num_layers
    shared = embed if costs.tied else None  # the tied matrix is held once in one process

    def total(field_name: str) -> int:
        value = getattr(embed, field_name) + sum(getattr(b, field_name) for b in blocks) + getattr(head, field_name)
        return value - (getattr(shared, field_name) if shared is not None else 0)

    params, grads, optim = total("param_bytes"), total("grad_bytes"), total("optimizer_bytes")
    if costs.spec.method == "inference":
        # The model's forward keeps `inputs_embeds` (the embedding output) alive to the end.
        return params + embed.workspace_bytes + max(*(b.workspace_bytes for b in blocks), head.workspace_bytes)

    held = params + optim
    activations = embed.activation_bytes + sum(b.activation_bytes for b in blocks) + head.activation_bytes
    phases = [held + activations + head.workspace_bytes]  # forward done, loss computed
    # Backward walks head → blocks → embed; each part's activations go as its gradients arrive.
    order = [head] + blocks[::-1] + [embed]
    live_acts, live_grads = activations, 0
    for part in order:
        grad = part.grad_bytes
        if part is embed and shared is not None:
            grad = 0  # accumulates into the head's gradient of the shared matrix
        phases.append(held + live_acts + live_grads + grad + part.workspace_bytes)
        live_acts -= part.activation_bytes
        live_grads += grad
    phases.append(params + grads + optim + _optimizer_step_bytes(costs, optim))
    return max(phases)


# --- internals -------------------------------------------------------------------------------

_CONFIGS: dict[str, object] = {}


def _config_key(config) -> str:
    return config.to_json_string(use_diff=False)


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise PlanError(f"TrainingSpec.dtype {name!r}: use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _optimizer_step_bytes(costs: ModelCosts, optimizer_bytes: int) -> int:
    """Transient of AdamW's step: the foreach implementation (default on GPUs) builds one fp32
    temporary per trainable parameter (the square root of the second moment)."""
    master = costs.spec.method == "full" and costs.spec.dtype != "float32"
    per_param = _ADAMW_MOMENT_BYTES + (_MASTER_WEIGHT_BYTES if master else 0)
    return optimizer_bytes // per_param * 4


def _one_layer_config(config, *, tp: int = 1):
    """A copy of `config` with one decoder block whose heads and MLP width are those of one TP rank."""
    cfg = one_layer_config(config)
    if tp > 1:
        heads = config.num_attention_heads
        cfg.num_attention_heads = heads // tp
        cfg.num_key_value_heads = (getattr(config, "num_key_value_heads", None) or heads) // tp
        cfg.intermediate_size = config.intermediate_size // tp
        if getattr(config, "moe_intermediate_size", None):  # each expert's width, split as the dense MLP's
            cfg.moe_intermediate_size = config.moe_intermediate_size // tp
        cfg.head_dim = _head_dim(config)  # hidden_size // heads would change once heads are divided
    return cfg  # attention as transformers picks it by default (sdpa where the class supports it)


@dataclass(frozen=True)
class _Linear:
    name: str  # relative to the block
    in_features: int
    out_features: int
    shard: Optional[str]  # "col" (output dim split), "row" (input dim split) or None (replicated)


@dataclass(frozen=True)
class _Layout:
    """Parameter counts of the real model class, read from a meta-device instance."""

    embed_numel: int  # everything ahead of the blocks (GPT-2's positional embedding too)
    head_numel: int  # final norm + lm_head, the tied matrix included
    norm_numel: int  # everything behind the blocks but lm_head (replicated under TP)
    block_numel_replicated: int  # block parameters not split by TP (norms, rowwise biases)
    block_numel_sharded: int  # block parameters split by TP (before division)
    linears: tuple[_Linear, ...]
    tied: bool


def _shard(style: Optional[str]) -> Optional[str]:
    if style and "colwise" in style:
        return "col"
    if style and "rowwise" in style:
        return "row"
    return None


def _parts(model) -> tuple[list, torch.nn.Module, list, torch.nn.Module]:
    """(modules ahead of the blocks, the first block, modules behind them, lm_head) of a causal LM."""
    layout = decoder_layout(model)
    before = [model.get_submodule(name) for name in layout.before]
    after = [model.get_submodule(name) for name in layout.after]
    return before, model.get_submodule(layout.layers)[0], after, model.get_output_embeddings()


def _numel(modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


@functools.lru_cache(maxsize=32)
def _layout(key: str) -> _Layout:
    from .trace_cache import cached_layout  # building the meta model imports the modeling code: ~1 s

    return cached_layout(key, _build_layout)


def _build_layout(key: str) -> _Layout:
    config = _CONFIGS[key]
    model = meta_model(_one_layer_config(config))
    before, block, after, lm_head = _parts(model)
    tied = lm_head.weight is model.get_input_embeddings().weight
    replicated = sharded = 0
    for name, module in block.named_modules():
        shard = _shard(tp_style_of(config, f"layers.0.{name}")) if name else None
        for pname, p in module.named_parameters(recurse=False):
            # fused experts: the plan styles each 3-D parameter itself (packed_colwise, rowwise)
            own = _shard(tp_style_of(config, f"layers.0.{name}.{pname}")) if name else None
            # A rowwise layer's bias is added after the all-reduce, so each rank holds it whole.
            if own or shard == "col" or (shard == "row" and pname == "weight"):
                sharded += p.numel()
            else:
                replicated += p.numel()
    linears = tuple(_Linear(lin.name, lin.in_features, lin.out_features, _shard(lin.tp_style))
                    for lin in block_linears(config))
    return _Layout(
        embed_numel=_numel(before),
        head_numel=_numel(after) + _numel([lm_head]),
        norm_numel=_numel(after),
        block_numel_replicated=replicated,
        block_numel_sharded=sharded,
        linears=linears,
        tied=tied,
    )


def _lora_targets(layout: _Layout, spec: TrainingSpec, experts=()) -> list[_Linear]:
    """The block's linears LoRA wraps (`experts`: names of fused expert parameters, targeted apart)."""
    if spec.lora_targets is None:
        return list(layout.linears)
    # peft matches a target name against the end of the module path
    def matches(lin: _Linear, target: str) -> bool:
        return lin.name == target or lin.name.endswith("." + target)

    missing = [t for t in spec.lora_targets if t not in experts and not any(matches(lin, t) for lin in layout.linears)]
    if missing:
        raise PlanError(f"LoRA target(s) {', '.join(missing)} name no module of the model; "
                        f"linear layers here: {', '.join(sorted({lin.name.rsplit('.', 1)[-1] for lin in layout.linears}))}")
    return [lin for lin in layout.linears if any(matches(lin, t) for t in spec.lora_targets)]


def _lora_numel(layout: _Layout, spec: TrainingSpec, tp: int, config) -> int:
    """Adapter elements of one block: its targeted linears' and (MoE) its targeted fused experts'."""
    numel = expert_lora_numel(config, spec.lora_targets, spec.lora_r)
    for lin in _lora_targets(layout, spec, expert_parameters(config)):
        in_f = lin.in_features // tp if lin.shard == "row" else lin.in_features  # A is r × in
        out_f = lin.out_features // tp if lin.shard == "col" else lin.out_features  # B is out × r
        numel += spec.lora_r * (in_f + out_f)
    return numel


@functools.lru_cache(maxsize=256)
def _model_costs(key: str, spec: TrainingSpec, tp: int) -> ModelCosts:
    config = _CONFIGS[key]
    layout = _layout(key)
    size = _dtype(spec.dtype).itemsize
    block_numel = layout.block_numel_replicated + layout.block_numel_sharded // tp
    # hfsplit.parallel.tensor shards the embedding and lm_head over the vocabulary (the
    # final norm stays whole), so each TP rank holds 1/tp of both matrices.
    head_numel = layout.norm_numel + (layout.head_numel - layout.norm_numel) // tp
    numels = {"embed": layout.embed_numel // tp, "block": block_numel, "head": head_numel}
    lora_numel = _lora_numel(layout, spec, tp, config) if spec.method in ("lora", "qlora") else 0

    from .trace_cache import block_trace, ends_trace  # traced once per config and shape, kept on disk
    traced = _traced_spec(spec)
    trace = block_trace(key, traced, tp)
    ends = ends_trace(key, traced)
    tokens = spec.micro_batch_size * spec.seq_len
    hidden_bytes = tokens * config.hidden_size * size

    def state(part: str) -> tuple[int, int, int]:
        params = numels[part] * size
        if spec.method == "full":
            master = _MASTER_WEIGHT_BYTES if spec.dtype != "float32" else 0
            return params, numels[part] * size, numels[part] * (_ADAMW_MOMENT_BYTES + master)
        if spec.method in ("lora", "qlora") and part == "block":
            adapter = _LORA_ADAPTER_DTYPE.itemsize
            params = quantized_block_bytes(layout, spec, config) if spec.method == "qlora" else params
            return params + lora_numel * adapter, lora_numel * adapter, lora_numel * _ADAMW_MOMENT_BYTES
        return params, 0, 0

    passes = 1 if spec.method == "inference" else 3  # backward ≈ 2 × forward
    ckpt = spec.activation_checkpointing and spec.method != "inference"

    # Block FLOPs: every matmul parameter (base + adapter) × 2 per token, plus QKᵀ and AV.
    matmul_numel = sum(
        lin.in_features * lin.out_features // (tp if lin.shard else 1) for lin in layout.linears
    ) + _routed_lora_numel(lora_numel, config, spec) + routed_expert_numel(config) // tp  # MoE: the top-k experts
    heads_dim = config.num_attention_heads // tp * _head_dim(config)
    block_fwd = 2.0 * matmul_numel * tokens + 4.0 * spec.micro_batch_size * spec.seq_len**2 * heads_dim
    block_flops = block_fwd * (passes + (1 if ckpt else 0))
    head_flops = 2.0 * config.hidden_size * config.vocab_size * tokens * (passes + spec.chunked_loss)  # + recompute
    # Two all-reduces (after attention and after the MLP) each way; recompute repeats the forward ones.
    all_reduces = 2 if spec.method == "inference" else 4 + (2 if ckpt else 0)
    comm = all_reduces * hidden_bytes if tp > 1 else 0

    block_acts, block_ws = _block_memory(trace, spec, ckpt=ckpt, hidden_bytes=hidden_bytes, tp=tp)
    if spec.method == "qlora":  # bitsandbytes dequantizes every weight in each pass of each micro-batch
        from .quantize import with_dequantize
        experts = _experts_4bit(config, spec)  # their dequantized matrices: in the trace (trace_moe)
        block_ws, block_flops = with_dequantize(block_ws, block_flops, layout.linears, spec, itemsize=size,
                                                experts=[shape for _, shape in experts.values()])
        split = split_lora_activation_bytes(config, spec, itemsize=size)  # kept per micro-batch, recomputed if ckpt
        block_acts, block_ws = (block_acts, block_ws + split) if ckpt else (block_acts + split, block_ws)
    embed = PartCost(*state("embed"), ends.embed_activations, ends.embed_workspace, 0.0)
    block = PartCost(*state("block"), block_acts, block_ws, block_flops, comm)
    head = PartCost(*state("head"), ends.head_activations, ends.head_workspace, head_flops)
    return _with_deferred_grads(ModelCosts(config.num_hidden_layers, tp, embed, block, head, layout.tied, spec,
                                           boundary_bytes=hidden_bytes), layout, config)


def _block_memory(trace: _BlockTrace, spec: TrainingSpec, *, ckpt: bool, hidden_bytes: int, tp: int) -> tuple[int, int]:
    """A block's (kept activations, workspace) from its trace, before QLoRA's dequantized weight."""
    if spec.method == "inference":
        return 0, trace.inference_peak
    # The single-process trace has no collectives: backward's input-gradient all-reduce
    # (`_c10d_functional.all_reduce`, DTensor's Partial -> Replicate) copies the partial sum out of place, and
    # both are alive at once (measured: +1 hidden state at that op, LoRA tp=2 with checkpointing).
    reduce_copy = hidden_bytes if tp > 1 else 0
    if ckpt:  # only the block input is kept; backward recomputes the block's activations transiently
        return hidden_bytes, trace.activations + trace.workspace + reduce_copy
    return trace.activations, trace.workspace + reduce_copy


def _with_deferred_grads(costs: ModelCosts, layout: _Layout, config) -> ModelCosts:
    """`costs` with each part's `deferred_bytes` set."""
    deferred = _deferred_grad_bytes(layout, costs.spec, config, costs.tp)
    return replace(costs, **{name: replace(getattr(costs, name), deferred_bytes=deferred[name]) for name in deferred})


def _deferred_grad_bytes(layout: _Layout, spec: TrainingSpec, config, tp: int) -> dict[str, int]:
    """Bytes per part that torch's split backward (`stage_backward_input`, then `stage_backward_weight`) keeps
    between its two passes: each trainable weight's gradient needs the gradient of that weight's output, so
    the input pass keeps one per trainable matmul or norm (activations it also needs are already kept).
    Measured: tests/parallel/test_apply.py, full fine-tuning under ZB-V, whose rank 0 held 6.7 MiB beyond the
    plan during its last stage's input pass; this counts 6.5 MiB there (a block's 5, the head's 1.5)."""
    if spec.method == "inference":
        return {"embed": 0, "block": 0, "head": 0}
    tokens, hidden = spec.micro_batch_size * spec.seq_len, config.hidden_size

    def out(lin: _Linear) -> int:
        return lin.out_features // tp if lin.shard == "col" else lin.out_features

    if spec.method != "full":  # LoRA: B's output is its base layer's, A's is the rank; adapters in their dtype
        adapters = sum(out(lin) + spec.lora_r for lin in _lora_targets(layout, spec, expert_parameters(config)))
        return {"embed": 0, "block": adapters * tokens * _LORA_ADAPTER_DTYPE.itemsize, "head": 0}
    size = _dtype(spec.dtype).itemsize
    norms = layout.block_numel_replicated // hidden  # the norms (a whole bias: a row too many)
    block = sum(out(lin) for lin in layout.linears) + norms * hidden
    head = config.vocab_size // tp + (hidden if layout.norm_numel else 0)  # lm_head's logits, the final norm
    return {"embed": hidden * tokens * size, "block": block * tokens * size, "head": head * tokens * size}


def _traced_spec(spec: TrainingSpec) -> TrainingSpec:
    """The spec a run's parts are traced with: QLoRA's activations as LoRA's, under autocast where the run
    autocasts (`TrainingSpec.autocast_dtype`; other methods never do), its `quantize_experts` whether the traced
    experts are 4-bit (each grouped matmul holding their dequantized matrices). With 4-bit experts their LoRA is applied
    split (`hfsplit.quantized_experts`), not by peft's dense ΔW the trace would build: the trace adapts the other
    targets and `split_lora_activation_bytes` adds what the split adapters keep."""
    if spec.method == "qlora":
        targets = spec.lora_targets
        if spec.experts_in_4bit and targets is not None and _EXPERT_NAMES & set(targets):
            targets = tuple(t for t in targets if t not in _EXPERT_NAMES) or None
        return replace(spec, method="lora", autocast=spec.autocast_dtype is not None, lora_targets=targets,
                       quantize_experts=spec.experts_in_4bit)
    return replace(spec, autocast=None, quantize_experts=False)


def _traces_4bit_experts(spec: TrainingSpec) -> bool:
    """Whether a traced spec is a QLoRA run's with 4-bit experts: `_traced_spec` sets `autocast` to a bool only for
    QLoRA (None for every other method, and in a spec nobody traced) and `quantize_experts` to `experts_in_4bit`."""
    return spec.autocast is not None and spec.quantize_experts


# The fused expert parameter names LoRA may target (transformers' experts modules; expert_lora.expert_parameters).
_EXPERT_NAMES = frozenset({"gate_up_proj", "up_proj", "down_proj"})


def _experts_4bit(config, spec: TrainingSpec) -> dict:
    """{name: (path, shape)} of the fused expert parameters a `spec` run holds in 4 bits ({} for none)."""
    return expert_parameters(config) if spec.experts_in_4bit else {}


def split_lora_activation_bytes(config, spec: TrainingSpec, *, itemsize: int) -> int:
    """Bytes one block's split LoRA on 4-bit experts keeps for backward per micro-batch: for each targeted expert
    parameter, the routed rows it reads (tokens × top-k × its input width, kept for A's gradient: the frozen 4-bit
    matmul keeps none), their rank-r projection (for B's gradient), B's contiguous copy in the compute dtype (its
    per-expert slices are strided across experts), and A's copy where the adapters' fp32 differs from it."""
    experts = _experts_4bit(config, spec)
    targeted = [experts[t][1] for t in dict.fromkeys(spec.lora_targets or ()) if t in experts]
    if not targeted:
        return 0
    rows = spec.micro_batch_size * spec.seq_len * (getattr(config, "num_experts_per_tok", 0) or 0)
    transposed = _is_transposed(config)
    cast = itemsize != _LORA_ADAPTER_DTYPE.itemsize
    total = 0
    for experts, d1, d2 in targeted:
        width, out = (d1, d2) if transposed else (d2, d1)
        total += rows * (width + spec.lora_r) * itemsize + experts * spec.lora_r * (out + (width if cast else 0)) * itemsize
    return total


def _is_transposed(config) -> bool:
    """Whether `config`'s fused experts hold `[E, in, out]` (gpt-oss), read from the real class on meta."""
    model = meta_model(one_layer_config(config))
    return any(getattr(sub, "is_transposed", False) for sub in _parts(model)[1].modules())


def _routed_lora_numel(lora_numel: int, config, spec: TrainingSpec) -> int:
    """Adapter elements a token's matmuls pass through: split LoRA on 4-bit experts runs only the routed experts'
    slices (top-k of E), peft's dense ΔW every expert's."""
    if not spec.experts_in_4bit or spec.method != "qlora":
        return lora_numel
    experts = expert_lora_numel(config, spec.lora_targets, spec.lora_r)
    count = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 1
    return lora_numel - experts + experts * (getattr(config, "num_experts_per_tok", 0) or 0) // count


def weight_bytes(config, spec: TrainingSpec) -> int:
    """Bytes of the model's weights held once, without a trace: every split of a `spec` run holds at least
    this much across its devices (TP replicates norms, adapters and optimizer state come on top)."""
    layout = _layout(_keyed(config))
    kinds = layer_kinds(config)
    blocks = ([_block_weight_bytes(kind_config(config, k), spec) for k in kinds] if kinds
              else [_block_weight_bytes(config, spec)] * config.num_hidden_layers)
    ends = layout.embed_numel + layout.head_numel - (layout.embed_numel if layout.tied else 0)
    return sum(blocks) + ends * _dtype(spec.dtype).itemsize


def _keyed(config) -> str:
    key = _config_key(config)
    _CONFIGS.setdefault(key, config)
    return key


def _block_weight_bytes(config, spec: TrainingSpec) -> int:
    layout = _layout(_keyed(config))
    if spec.method == "qlora":
        return quantized_block_bytes(layout, spec, config)
    return (layout.block_numel_replicated + layout.block_numel_sharded) * _dtype(spec.dtype).itemsize


def quantized_block_bytes(layout: _Layout, spec: TrainingSpec, config) -> int:
    """Exact bytes of one block under bitsandbytes (tp=1): its linears' quantized weights and state, an MoE's fused
    experts' where they are 4-bit (`TrainingSpec.experts_in_4bit`, each expert quantized alone), the rest (norms,
    biases, the router) in the spec's dtype."""
    from .quantize import quantized_experts_bytes, quantized_linear_bytes

    experts = [shape for _, shape in _experts_4bit(config, spec).values()]
    weights = sum(lin.in_features * lin.out_features for lin in layout.linears)
    rest = layout.block_numel_replicated + layout.block_numel_sharded - weights - sum(map(math.prod, experts))
    return rest * _dtype(spec.dtype).itemsize + sum(
        quantized_linear_bytes(lin.in_features, lin.out_features, quant_type=spec.bnb_4bit_quant_type,
                               double_quant=spec.bnb_4bit_use_double_quant, load_in_8bit=spec.load_in_8bit)
        for lin in layout.linears) + sum(
        quantized_experts_bytes(*shape, quant_type=spec.bnb_4bit_quant_type, double_quant=spec.bnb_4bit_use_double_quant)
        for shape in experts)


@contextmanager
def _grouped_experts_on_fake_tensors(*, dequantized: bool = False):
    """MoE blocks traced as they run: transformers' grouped experts (`grouped_mm`, the tokens × top-k routed rows
    only). Torch's meta kernel of `grouped_mm` takes bf16 only, so other dtypes go through transformers' fallback op
    (its fake kernel takes every dtype), wrapped by `trace_moe` to save for backward what torch's op saves: with
    frozen experts, not the routed rows. The `batched_mm` alternative would gather each routed row's expert
    matrices (5-17x the measured peak). `dequantized`: 4-bit experts, every call through `trace_moe`, which holds
    the dequantized matrices for the call as `hfsplit.quantized_experts` does."""
    try:
        from transformers.integrations import moe
    except ImportError:  # a transformers without fused experts: nothing to route
        yield
        return
    from .trace_moe import grouped_mm_as_torch_saves

    grouped_mm = moe._grouped_mm
    moe._grouped_mm = lambda input, weight, offs: (
        grouped_mm(input, weight, offs) if not dequantized and weight.dtype == torch.bfloat16
        and moe._can_use_grouped_mm(input, weight, offs) else grouped_mm_as_torch_saves(input, weight, offs,
                                                                                       dequantized=dequantized))
    try:
        yield
    finally:
        moe._grouped_mm = grouped_mm


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# --- measurement under FakeTensorMode ---------------------------------------------------------


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages created inside the mode and still alive, and their peak."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.history: list[int] = [0]  # live bytes at the start and after each new storage: peak = max(history)
        self._seen: set[int] = set()

    def reset_peak(self) -> None:
        self.peak = self.live
        self.history = [self.live]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Views and in-place results alias an input: nothing new, even when that input
        # (a parameter) was created before the mode and is not counted.
        inputs = {id(t.untyped_storage()) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in inputs:
                self._track(t.untyped_storage())
        return out

    def _track(self, storage) -> None:
        sid = id(storage)
        if sid in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen.add(sid)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self.history.append(self.live)
        weakref.finalize(storage, self._free, sid, nbytes)

    def _free(self, sid: int, nbytes: int) -> None:
        self._seen.discard(sid)
        self.live -= nbytes


class _SavedBytes:
    """Sums the unique storages autograd saves for backward, parameters excluded."""

    def __init__(self, exclude: list[torch.Tensor]):
        self._exclude = {id(t.untyped_storage()) for t in exclude}
        self._storages: dict[int, object] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if id(storage) not in self._exclude:
            self._storages[id(storage)] = storage  # holding it keeps ids unique
        return t

    def add(self, t: torch.Tensor) -> None:
        self.pack(t)

    @property
    def bytes(self) -> int:
        return sum(s.nbytes() for s in self._storages.values())

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def release(self) -> int:
        """The bytes saved so far, and the storages let go (autograd alone holds them from here)."""
        nbytes = self.bytes
        self._storages.clear()
        return nbytes


@dataclass(frozen=True)
class _BlockTrace:
    activations: int  # saved for backward by one block
    workspace: int  # transient beyond the saved activations and the block's own gradients
    inference_peak: int  # peak of a no-grad forward, input and output included (0 in a training trace)


@dataclass(frozen=True)
class _EndsTrace:
    embed_activations: int
    embed_workspace: int
    head_activations: int
    head_workspace: int


class _Captured(Exception):
    pass


def _fake_model(key: str, spec: TrainingSpec, tp: int, mode: FakeTensorMode):
    """A one-block model of the real class with fake (unallocated) weights, and the kwargs its model
    forward passes to the block (rotary embeddings, mask), captured by running it once."""
    config = _CONFIGS[key]
    model = meta_model(_one_layer_config(config, tp=tp), dtype=_dtype(spec.dtype))
    base = getattr(model, model.base_model_prefix)
    block = _parts(model)[1]
    if spec.method == "lora":
        _add_lora(block, key, spec)
    with mode:
        _to_fake(model)
        kwargs, ids = _block_kwargs(base, block, spec)
    from .trace_masks import mask_as_run

    return model, block, mask_as_run(model.config, kwargs, batch=spec.micro_batch_size, seq=spec.seq_len), ids


def _add_lora(block, key: str, spec: TrainingSpec, *, use_peft: bool = False) -> None:
    """The spec's LoRA adapters on `block`: peft's own with `use_peft` (tests compare), else `trace_lora`'s,
    which trace alike without importing peft (and through it bitsandbytes and torch._inductor)."""
    experts = expert_parameters(_CONFIGS[key])
    targets = [lin.name.rsplit(".", 1)[-1] for lin in _lora_targets(_layout(key), spec, experts)]
    parameters = [experts[t][0] for t in spec.lora_targets or () if t in experts]
    if parameters:  # adapters on fused experts: peft's own ParamWrapper (trace_lora builds linears' only)
        use_peft = True
    if not use_peft:
        from .trace_lora import inject_trace_adapters

        return inject_trace_adapters(block, targets, r=spec.lora_r, adapter_dtype=_LORA_ADAPTER_DTYPE,
                                     cast_input=_traced_autocast(spec) is None)
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=spec.lora_r, target_modules=targets, target_parameters=parameters or None),
                            block)
    for name, module in block.named_modules():
        if name.endswith(("lora_A", "lora_B")):
            module.to(_LORA_ADAPTER_DTYPE)
        if hasattr(module, "lora_A"):  # as hfsplit.parallel.autocast turns it off
            module.cast_input_dtype_enabled = _traced_autocast(spec) is None


def _traced_autocast(spec: TrainingSpec):
    """The dtype a traced block's forward autocasts to, or None: `_model_costs` sets a traced spec's `autocast`
    to whether the run autocasts (`TrainingSpec.autocast_dtype` of the spec it plans)."""
    return _dtype(spec.dtype) if spec.autocast and spec.dtype != "float32" else None


def _block_kwargs(base, block, spec: TrainingSpec):
    captured = {}

    def capture(module, args, kwargs):
        captured.update(kwargs)
        raise _Captured

    handle = block.register_forward_pre_hook(capture, with_kwargs=True)
    ids = torch.zeros(spec.micro_batch_size, spec.seq_len, dtype=torch.long)
    try:
        with torch.no_grad():
            base(input_ids=ids, use_cache=False)
    except _Captured:
        pass
    finally:
        handle.remove()
    captured.pop("hidden_states", None)
    captured.pop("past_key_values", None)
    captured.pop("past_key_value", None)
    return captured, ids


def _to_fake(model: torch.nn.Module) -> None:
    """Replace meta parameters and buffers with fake CPU tensors of the caller's FakeTensorMode.

    Built on meta first because peft cannot swap fake parameters; replaced entry by entry
    because `to_empty` swaps tensors, which transformers' weak references forbid.
    """
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype)


def _set_trainable(module: torch.nn.Module, spec: TrainingSpec) -> None:
    for name, p in module.named_parameters():
        p.requires_grad_(spec.method == "full" or (spec.method == "lora" and "lora_" in name))


def _hidden(output):
    """A block's hidden states: some blocks (GPT-2's) return them first in a tuple."""
    return output[0] if isinstance(output, tuple) else output


@dataclass(frozen=True)
class _BlockEvents:
    """One block trace before its figures are combined: the live bytes at each new storage of the no-grad
    forward, the training forward and backward (`_LiveBytes.history`), and the byte counts they are taken
    against. Each entry is a sum of tensor sizes, so `hfsplit.trace_tp` derives other TP degrees from two."""

    inference: tuple[int, ...]
    forward: tuple[int, ...] = ()
    backward: tuple[int, ...] = ()
    activations: int = 0  # saved for backward, parameters excluded
    grads: int = 0  # the block's parameter gradients
    out_bytes: int = 0  # the block's output, which belongs to the next part's activations

    def trace(self) -> _BlockTrace:
        inference_peak = max(self.inference)
        if not self.forward:
            return _BlockTrace(0, 0, inference_peak)
        acts = self.activations
        workspace = max(max(self.forward) - acts, max(self.backward) - acts - self.grads - self.out_bytes)
        return _BlockTrace(acts, max(workspace, 0), inference_peak)


@functools.lru_cache(maxsize=256)
def _trace_block(key: str, spec: TrainingSpec, tp: int) -> _BlockTrace:
    return _block_events(key, spec, tp).trace()


@functools.lru_cache(maxsize=64)
def _block_events(key: str, spec: TrainingSpec, tp: int) -> _BlockEvents:
    config = _CONFIGS[key]
    dtype = _dtype(spec.dtype)
    shape = (spec.micro_batch_size, spec.seq_len, config.hidden_size)
    mode = FakeTensorMode()
    model, block, kwargs, _ = _fake_model(key, spec, tp, mode)
    with mode, _grouped_experts_on_fake_tensors(dequantized=_traces_4bit_experts(spec)):
        _set_trainable(block, spec)
        params = list(block.parameters())

        if spec.method == "inference":  # only inference plans read the no-grad peak: training skips that pass
            with _LiveBytes() as live, torch.no_grad():
                x = torch.empty(shape, dtype=dtype)  # held, as a caller holds a block's input
                y = _hidden(block(x, **kwargs))
                del x, y
            return _BlockEvents(tuple(live.history))

        saved = _SavedBytes(exclude=params)
        with _LiveBytes() as live:
            x = torch.empty(shape, dtype=dtype, requires_grad=True)
            cast = _traced_autocast(spec)
            with saved.hooks(), torch.autocast("cpu", dtype=cast, enabled=cast is not None):
                y = _hidden(block(x, **kwargs))
            forward = tuple(live.history)
            # autograd frees each node's saved tensors as its backward runs: held on (`saved` does, for unique
            # ids, and every saved tensor's hooks hold `saved`) all of them would count at the backward peak
            activations = saved.release()
            grad_out = torch.empty_like(y)
            live.reset_peak()
            y.backward(grad_out)
            backward = tuple(live.history)
        grads = sum(p.grad.untyped_storage().nbytes() for p in params if p.grad is not None)
        return _BlockEvents((0,), forward, backward, activations, grads, y.untyped_storage().nbytes())


@functools.lru_cache(maxsize=256)
def _trace_ends(key: str, spec: TrainingSpec) -> _EndsTrace:
    config = _CONFIGS[key]
    dtype = _dtype(spec.dtype)
    shape = (spec.micro_batch_size, spec.seq_len, config.hidden_size)
    mode = FakeTensorMode()
    model, _, _, ids = _fake_model(key, spec, 1, mode)
    with mode:
        _, _, after, lm_head = _parts(model)
        embed, norm = model.get_input_embeddings(), torch.nn.Sequential(*[m for m in after if _numel([m])])
        _set_trainable(model, spec)
        train = spec.method != "inference"

        # Embeddings: the lookup output is the first block's input, counted there.
        saved = _SavedBytes(exclude=list(embed.parameters()))
        with _LiveBytes() as live, torch.set_grad_enabled(train), saved.hooks():
            h = embed(ids)
        embed_fwd = live.peak
        embed_bwd = 0
        if spec.method == "full":
            with _LiveBytes() as live:
                h.backward(torch.empty_like(h))
            embed_bwd = live.peak - embed.weight.grad.untyped_storage().nbytes()
            embed.weight.grad = None
        embed_acts = saved.bytes if train else 0
        embed_ws = max(embed_fwd - embed_acts, embed_bwd)

        # Head: the final norm, lm_head and the loss. The logits stay alive with the model output.
        head_params = list(norm.parameters()) + list(lm_head.parameters())
        saved = _SavedBytes(exclude=head_params)
        with _LiveBytes() as live:
            x = torch.empty(shape, dtype=dtype, requires_grad=train)
            with torch.set_grad_enabled(train), saved.hooks():
                # the family's logit scaling / soft-capping makes logits-sized temporaries of its own
                head = lambda h: FAMILIES.get(config.model_type, Family()).output_side(config, lm_head(h))  # noqa: E731
                if train and spec.chunked_loss:  # the stage outputs the normed states; the loss runs lm_head per chunk
                    from .parallel.chunked_loss import chunked_causal_lm_loss

                    logits = norm(x)
                    loss = chunked_causal_lm_loss(logits, ids, head=head, vocab_size=config.vocab_size)
                else:
                    logits = head(norm(x))
                    if train:
                        loss = model.loss_function(logits=logits, labels=ids, vocab_size=config.vocab_size)
            head_fwd = live.peak
            if not train:
                return _EndsTrace(0, embed_ws, 0, head_fwd)
            saved.add(logits)
            live.reset_peak()
            loss.backward()
            head_bwd = live.peak
        head_acts = saved.bytes
        grads = sum(p.grad.untyped_storage().nbytes() for p in head_params if p.grad is not None)
        head_ws = max(head_fwd - head_acts, head_bwd - head_acts - grads)
        return _EndsTrace(embed_acts, max(embed_ws, 0), head_acts, max(head_ws, 0))
