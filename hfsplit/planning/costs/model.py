"""Cost model: bytes and FLOPs of one decoder block, the embeddings and the head, per TP rank.

Sizes come from the real transformers model class built on the meta device (`hfsplit.planning.costs.layout`),
never from hand formulas. Activation bytes are measured by tracing one block at the real dimensions under
FakeTensorMode (`hfsplit.planning.costs.trace`, cached by `hfsplit.planning.costs.traces`), so they follow
whatever the attention implementation and MLP really keep for backward.

The planner relies on exactly the public names below.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field, replace

from hfsplit.errors import PlanError
from hfsplit.models.boundary import boundary_width
from hfsplit.models.expert_lora import default_lora_targets, expert_lora_numel, expert_parameters
from hfsplit.models.families import tp_degree_error, tp_whole_parts
from hfsplit.models.layer_kinds import kind_config, layer_kinds
from hfsplit.models.layout import block_linear_names, routed_expert_numel
from hfsplit.plan import TrainingSpec
from hfsplit.planning.costs.cache import read_cache, write_cache
from hfsplit.planning.costs.optimizer import moments_bytes, shared_bytes
from hfsplit.planning.costs.quantized import (
    DEQUANTIZE_FLOPS_PER_VALUE, experts_4bit, quantized_block_bytes, routed_lora_numel,
    split_lora_activation_bytes, with_dequantize,
)
from hfsplit.planning.costs.layout import (
    CONFIGS, LORA_ADAPTER_DTYPE, Layout, Linear, dtype_of, head_dim, keyed, layout_of, lora_targets,
)
from hfsplit.planning.costs.masks import attended_positions, stage_mask_bytes
from hfsplit.planning.costs.trace import BlockTrace
from hfsplit.planning.costs.tp import block_comm_bytes, gather_transient_bytes, rank_out_features
from hfsplit.planning.costs.traces import block_trace, ends_trace


@dataclass(frozen=True)
class PartCost:
    """Costs of one part (the embeddings, one decoder block, or norm + head) on one rank.

    All byte figures are for one tensor-parallel rank (already divided by the TP degree
    where the part is sharded).

    Args:
        param_bytes: weights (frozen + trainable) in the model dtype.
        grad_bytes: gradients of the trainable parameters.
        optimizer_bytes: AdamW moments (fp32, or bitsandbytes' 8-bit with their absmax:
            `hfsplit.planning.costs.optimizer`) plus fp32 master weights under mixed precision.
        activation_bytes: bytes kept on the device for backward per micro-batch (inference: a block's KV cache of
            generation, `kv_cache_bytes`).
        workspace_bytes: transient peak while the part runs once (not multiplied by in-flight micro-batches).
        flops: forward + backward (+ recompute) FLOPs per micro-batch.
        comm_bytes: bytes all-reduced across the TP group per micro-batch (forward + backward).
        deferred_bytes: what a split backward (zero-bubble schedules) keeps from the part's input pass to its
            weight pass: the gradient of each trainable weight's output (see `_deferred_grad_bytes`).
        offload_bytes: bytes kept in host memory for backward per micro-batch (offloaded checkpointing: the
            block's input), which cross the host link twice (out in forward, back before the recompute).
        trainable_numel: values of the part's trainable tensors (the optimizer's step temporaries follow them).
        optimizer_shared_bytes: what the optimizer of a stage holding this part keeps once, whatever the number
            of such parts (bitsandbytes' 8-bit code maps): counted once per stage, not in `optimizer_bytes`.
        host_bytes: weights the part keeps in host RAM instead of `param_bytes` (the input embedding table under
            `TrainingSpec.host_embedding`): not device memory.
    """

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    workspace_bytes: int
    flops: float
    comm_bytes: int = 0
    deferred_bytes: int = 0
    offload_bytes: int = 0
    trainable_numel: int = 0
    optimizer_shared_bytes: int = 0
    host_bytes: int = 0

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
        boundary_bytes: what a stage sends its pipeline neighbour for one micro-batch: its hidden states, with
            the hidden streams and per-layer inputs some models carry (`hfsplit.models.boundary.boundary_width`).
        layer_blocks: each layer's own block cost where the layers are of several kinds (Qwen3-MoE's
            `mlp_only_layers`, `hfsplit.models.layer_kinds`); empty when every layer costs `block` (layer 0's kind).
        stage_inputs: what every stage holds per micro-batch besides its parts: the position ids (the pipeline
            keeps a micro-batch's keyword inputs until its backward) and the attention masks its forward builds
            (`hfsplit.planning.costs.masks.stage_mask_bytes`): transient while the stage's forward runs, kept per
            micro-batch in flight under activation checkpointing (each checkpointed block saves its inputs).
        logits_bytes: one micro-batch's logits on one TP rank in the compute dtype (`hfsplit.planning.reference`).
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
    stage_inputs: PartCost = PartCost(0, 0, 0, 0, 0, 0.0)
    logits_bytes: int = 0  # one micro-batch's logits on one TP rank, in the compute dtype (a reference pass counts them)
    kv_bytes: int = 0  # one micro-batch's KV cache of one block on one TP rank, where the objective generates
    hidden_bytes: int = 0  # one micro-batch's hidden state, a TP all-reduce's message (0: boundary_bytes, the same)


_MASTER_WEIGHT_BYTES = 4  # fp32 master copy under mixed precision


def model_costs(config, spec: TrainingSpec, tp: int = 1) -> ModelCosts:
    """Costs of `config`'s model under `spec` with tensor-parallel degree `tp`.

    Args:
        config: a transformers config of a decoder-only causal LM (see `hfsplit.checkpoint.load_config`).
        spec: what one step does.
        tp: tensor-parallel degree; must be one of `valid_tp_degrees(config, tp)`.
    """
    return _costs_of(keyed(config), spec, tp)


@functools.lru_cache(maxsize=1024)
def _costs_of(key: str, spec: TrainingSpec, tp: int) -> ModelCosts:
    """`model_costs` of the config under `key`, kept: a search asks for the same costs many times (the layer kinds,
    the LoRA targets of each kind read the config each time; a no-fit diagnosis asks again for every change)."""
    config = CONFIGS[key]
    why = tp_degree_error(config, tp)
    if why:
        raise PlanError(why)
    if spec.method not in ("inference", "lora", "qlora", "full"):
        raise PlanError(f"TrainingSpec.method {spec.method!r}: use 'inference', 'lora', 'qlora' or 'full'")
    if spec.method == "qlora" and tp > 1:
        raise PlanError(f"tp={tp} with QLoRA: a bitsandbytes 4-bit weight cannot be sharded by tensor parallelism "
                        "here; use tp=1 (the planner splits QLoRA runs over pipeline stages × data parallelism)")
    dtype_of(spec.dtype)  # fail early on an unknown dtype
    kinds = layer_kinds(config)
    first = _spec_of_kind(config, kinds[0], spec) if kinds else spec  # layer 0's kind holds what it holds
    return _with_layer_kinds(config, replace(_model_costs(keyed(config), first, tp), spec=spec), spec, tp)


def _with_layer_kinds(config, costs: ModelCosts, spec: TrainingSpec, tp: int) -> ModelCosts:
    """`costs` with each layer's block costed by its own kind, where the layers are not all alike."""
    kinds = layer_kinds(config)
    if kinds is None:
        return costs
    if spec.method in ("lora", "qlora") and spec.lora_targets is None:  # the default every kind shares
        spec = replace(spec, lora_targets=tuple(default_lora_targets(config)))
        costs = replace(_model_costs(keyed(config), _spec_of_kind(config, kinds[0], spec), tp), spec=costs.spec)
    blocks = {kind: _model_costs(keyed(kind_config(config, kind)), _spec_of_kind(config, kind, spec), tp).block
              for kind in set(kinds)}
    return replace(costs, layer_blocks=tuple(blocks[kind] for kind in kinds))


def _spec_of_kind(config, kind: str, spec: TrainingSpec) -> TrainingSpec:
    """`spec` for a block of `kind`: a kind holds the LoRA targets of its own layers only (the full attention's
    `q_proj`, not the linear attention's `in_proj_qkvz`; a dense first layer no expert parameter); each target must
    be held by some kind of the model (PlanError naming those none holds)."""
    if not spec.lora_targets:
        return spec
    kinds = sorted(set(layer_kinds(config) or ()))
    held = {k: _held_targets(config, k) for k in kinds}
    nowhere = [t for t in spec.lora_targets if not any(t in names for names in held.values())]
    if nowhere:
        raise PlanError(f"LoRA target(s) {', '.join(nowhere)} name no module of the model; linear layers here: "
                        f"{', '.join(sorted(set().union(*held.values())))}")
    return replace(spec, lora_targets=tuple(t for t in spec.lora_targets if t in held[kind]))


def _held_targets(config, kind: str) -> set[str]:
    """The LoRA target names a block of `kind` holds: its linears' names and its fused expert parameters'."""
    one = kind_config(config, kind)
    return set(block_linear_names(one)) | set(expert_parameters(one))


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
        return params + embed.workspace_bytes + max(*(b.workspace_bytes for b in blocks), head.workspace_bytes) \
            + costs.stage_inputs.workspace_bytes

    held = params + optim
    activations = embed.activation_bytes + sum(b.activation_bytes for b in blocks) + head.activation_bytes \
        + costs.stage_inputs.activation_bytes
    # forward done, loss computed (the masks of the forward counted as still alive)
    phases = [held + activations + head.workspace_bytes + costs.stage_inputs.workspace_bytes]
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
    phases.append(params + grads + optim + _optimizer_step_bytes(costs))
    return max(phases)


# --- internals -------------------------------------------------------------------------------


def _optimizer_step_bytes(costs: ModelCosts) -> int:
    """Transient of AdamW's step: the foreach implementation (default on GPUs) builds one fp32
    temporary per trainable parameter (the square root of the second moment)."""
    parts = [costs.embed, costs.head] + (list(costs.layer_blocks) or [costs.block] * costs.num_layers)
    shared = costs.embed.trainable_numel if costs.tied else 0  # the tied matrix is held once in one process
    return 4 * (sum(part.trainable_numel for part in parts) - shared)


def _lora_numel(layout: Layout, spec: TrainingSpec, tp: int, config) -> int:
    """Adapter elements of one block: its targeted linears' and (MoE) its targeted fused experts'."""
    numel = expert_lora_numel(config, spec.lora_targets, spec.lora_r)
    for lin in lora_targets(layout, spec, expert_parameters(config)):
        in_f = lin.in_features // tp if lin.shard == "row" else lin.in_features  # A is r × in
        out_f = lin.out_features // tp if lin.shard == "col" else lin.out_features  # B is out × r
        numel += spec.lora_r * (in_f + out_f)
    return numel


def _trainable_tensors(layout: Layout, spec: TrainingSpec, tp: int, config, part: str) -> tuple[int, ...]:
    """Values of each trainable tensor of one `part` ("embed", "block", "head") on one TP rank: every parameter
    under full fine-tuning, a block's LoRA A and B matrices (those of fused experts too) under LoRA."""
    if spec.method == "full":
        params = {"embed": layout.embed_params, "block": layout.block_params, "head": layout.head_params}[part]
        return tuple(n // tp if split else n for n, split in params)
    if spec.method not in ("lora", "qlora") or part != "block":
        return ()
    r, out = spec.lora_r, []
    for lin in lora_targets(layout, spec, expert_parameters(config)):
        in_f = lin.in_features // tp if lin.shard == "row" else lin.in_features
        out_f = lin.out_features // tp if lin.shard == "col" else lin.out_features
        out += [r * in_f, out_f * r]
    experts = expert_parameters(config)
    for e, out_f, in_f in (experts[t][1] for t in dict.fromkeys(spec.lora_targets or ()) if t in experts):
        out += [r * e * in_f, out_f * r * e]  # peft's ParamWrapper: A [r·E, in], B [out, r·E]
    return tuple(out)


def _part_state(layout: Layout, spec: TrainingSpec, tp: int, config, part: str, numel: int) -> dict:
    """One part's `PartCost` state fields on one rank holding `numel` parameter values: param, grad and optimizer
    bytes, its trainable values and what its optimizer holds once."""
    size = dtype_of(spec.dtype).itemsize
    trainable = _trainable_tensors(layout, spec, tp, config, part)
    params, grads, optim, values = numel * size, 0, 0, 0
    if spec.method == "full":
        master = _MASTER_WEIGHT_BYTES if spec.full_autocast_dtype else 0  # the run's fp32 masters
        # the gradients are the masters' (fp32), not the 16-bit copies autocast computes with: counted in `dtype`
        # they left full fine-tuning in bf16 2 bytes a parameter short on CUDA (1.10-1.14x the plan on an H200:
        # docs/benchmarks/gpu.md)
        grads = numel * dtype_of(spec.weights_dtype).itemsize
        optim, values = moments_bytes(trainable, spec.optim) + master * numel, numel
    elif spec.method in ("lora", "qlora") and part == "block":
        values = sum(trainable)
        params = quantized_block_bytes(layout, spec, config) if spec.method == "qlora" else params
        params, grads = params + values * LORA_ADAPTER_DTYPE.itemsize, values * LORA_ADAPTER_DTYPE.itemsize
        optim = moments_bytes(trainable, spec.optim)
    return dict(param_bytes=params, grad_bytes=grads, optimizer_bytes=optim, trainable_numel=values,
                optimizer_shared_bytes=shared_bytes(trainable, spec.optim))


@functools.lru_cache(maxsize=256)
def _model_costs(key: str, spec: TrainingSpec, tp: int) -> ModelCosts:
    config = CONFIGS[key]
    layout = layout_of(key)
    size = dtype_of(spec.dtype).itemsize
    block_numel = layout.block_numel_replicated + layout.block_numel_sharded // tp
    # hfsplit.apply.tp shards the embedding and lm_head over the vocabulary (the final norm stays whole)
    head_numel = layout.norm_numel + (layout.head_numel - layout.norm_numel) // tp
    numels = {"embed": layout.embed_numel // tp, "block": block_numel, "head": head_numel}
    lora_numel = _lora_numel(layout, spec, tp, config) if spec.method in ("lora", "qlora") else 0

    traced = _traced_spec(spec)
    trace = block_trace(key, traced, tp)
    ends = ends_trace(key, traced)
    tokens = spec.micro_batch_size * spec.seq_len
    hidden_bytes = tokens * config.hidden_size * size
    boundary_bytes = tokens * boundary_width(config) * size  # Gemma 3n/4 send more than the hidden state

    def state(part: str) -> dict:
        return _part_state(layout, spec, tp, config, part, numels[part])

    passes = 1 if spec.method == "inference" else 3  # backward ≈ 2 × forward
    ckpt = spec.checkpointing != "off"

    # Block FLOPs: every matmul parameter (base + adapter) × 2 per token, plus QKᵀ and AV.
    matmul_numel = sum(
        lin.in_features * lin.out_features // (tp if lin.shard else 1) for lin in layout.linears
    ) + routed_lora_numel(lora_numel, config, spec) + routed_expert_numel(config) // tp  # MoE: the top-k experts
    heads_dim = config.num_attention_heads // _head_split(config, tp) * head_dim(config)
    # QKᵀ and AV over the pairs a row attends: seq² (a mask or sdpa's causal flag), or each packed example's l²
    # where packed rows run example by example (sdpa: hfsplit.models.varlen)
    pairs = attended_positions(_attention_config(key), seq=spec.seq_len, packed=spec.packing)
    block_fwd = 2.0 * matmul_numel * tokens + 4.0 * spec.micro_batch_size * pairs * heads_dim
    block_flops = block_fwd * (passes + (1 if ckpt else 0)) + _tiled_mlp_flops(layout, spec, tp, tokens)
    head_flops = 2.0 * config.hidden_size * config.vocab_size * head_tokens(spec) * (passes + spec.chunked_loss)
    comm = block_comm_bytes(layout, config, spec, tp, hidden_bytes=hidden_bytes, feature_bytes=tokens * size)

    block_acts, block_ws, offload = _block_memory(trace, spec, hidden_bytes=hidden_bytes, tp=tp,
                                                  gathered=gather_transient_bytes(layout, config, tp, tokens * size))
    if spec.method == "inference":  # what generation keeps per block: held, like kept activations, per micro-batch
        block_acts = kv_cache_bytes(config, spec, tp)
    if spec.method == "qlora":  # bitsandbytes dequantizes every weight in each pass of each micro-batch
        experts = experts_4bit(config, spec)  # their dequantized matrices: in the trace (costs.moe)
        block_ws, block_flops = with_dequantize(block_ws, block_flops, layout.linears, spec, itemsize=size,
                                                experts=[shape for _, shape in experts.values()])
        block_flops += _tiled_dequantize_flops(layout, spec)
        split = split_lora_activation_bytes(config, spec, itemsize=size)  # kept per micro-batch, recomputed if ckpt
        block_acts, block_ws = (block_acts, block_ws + split) if ckpt else (block_acts + split, block_ws)
    embed = _on_host(PartCost(**state("embed"), activation_bytes=ends.embed_activations,
                              workspace_bytes=ends.embed_workspace, flops=0.0), spec, tp)
    block = PartCost(**state("block"), activation_bytes=block_acts, workspace_bytes=block_ws, flops=block_flops,
                     comm_bytes=comm, offload_bytes=offload)
    head = PartCost(**state("head"), activation_bytes=ends.head_activations, workspace_bytes=ends.head_workspace,
                    flops=head_flops)
    return _with_deferred_grads(ModelCosts(config.num_hidden_layers, tp, embed, block, head, layout.tied, spec,
                                           boundary_bytes=boundary_bytes, hidden_bytes=hidden_bytes,
                                           stage_inputs=_stage_inputs(key, spec, ckpt),
                                           logits_bytes=tokens * (config.vocab_size // tp) * size,
                                           kv_bytes=kv_cache_bytes(config, spec, tp) if spec.counts.generation else 0),
                                layout, config)


def _on_host(embed: PartCost, spec: TrainingSpec, tp: int) -> PartCost:
    """The embeddings' costs where their table stays in host RAM (`TrainingSpec.host_embedding`): its bytes leave the
    device; the looked-up rows (the part's workspace) still reach it. Under TP the table is a DTensor sharded over the
    devices' mesh, and stays there (the search never plans it on the host: `search.best_plan`)."""
    if not spec.host_embedding or tp > 1:
        return embed
    return replace(embed, param_bytes=0, host_bytes=embed.param_bytes)


def _mlp_linears(layout: Layout) -> list[Linear]:
    return [lin for lin in layout.linears if lin.name.startswith("mlp.")]


def _tiled_mlp_flops(layout: Layout, spec: TrainingSpec, tp: int, tokens: int) -> float:
    """What a tiled MLP (`hfsplit.models.tiled_mlp`) adds a micro-batch: each slice recomputes its MLP forward in its
    own backward, once more than the block's checkpoint does (0 untiled, or for inference)."""
    if spec.tiled_mlp <= 1 or spec.method == "inference":
        return 0.0
    return 2.0 * tokens * sum(lin.in_features * lin.out_features // (tp if lin.shard else 1)
                              for lin in _mlp_linears(layout))


def _tiled_dequantize_flops(layout: Layout, spec: TrainingSpec) -> float:
    """QLoRA under a tiled MLP: bitsandbytes dequantizes the MLP's weights for each slice, in forward, in the block's
    recompute, in the slice's own recompute and in its backward, where an untiled MLP dequantizes them once per pass
    (`with_dequantize` counts those)."""
    if spec.tiled_mlp <= 1 or spec.load_in_8bit:
        return 0.0
    passes = 3 if spec.activation_checkpointing else 2
    values = sum(lin.in_features * lin.out_features for lin in _mlp_linears(layout))
    return DEQUANTIZE_FLOPS_PER_VALUE * values * (spec.tiled_mlp * (passes + 1) - passes)


def kv_cache_bytes(config, spec: TrainingSpec, tp: int) -> int:
    """Bytes of one block's KV cache on one TP rank when a micro-batch generates up to `spec.seq_len` tokens: keys
    and values of every position for this rank's key-value heads, in `spec.dtype` (transformers' DynamicCache;
    sliding-window layers are counted whole, an upper bound)."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_rank = max(1, kv_heads // _head_split(config, tp))
    return 2 * spec.micro_batch_size * spec.seq_len * per_rank * head_dim(config) * dtype_of(spec.dtype).itemsize


def _head_split(config, tp: int) -> int:
    """Over how many ranks a block's attention heads are split (1 where the plan gathers them whole)."""
    return 1 if "attention" in tp_whole_parts(config) else tp


def _stage_inputs(key: str, spec: TrainingSpec, ckpt: bool) -> PartCost:
    """`ModelCosts.stage_inputs`: a micro-batch's int64 position ids and the masks a stage builds for it."""
    positions = spec.micro_batch_size * spec.seq_len * 8
    masks = _stage_mask_bytes(key, spec)
    if spec.method == "inference":
        return PartCost(0, 0, 0, 0, masks + positions, 0.0)
    return PartCost(0, 0, 0, positions + (masks if ckpt else 0), 0 if ckpt else masks, 0.0)


def _stage_mask_bytes(key: str, spec: TrainingSpec) -> int:
    """`stage_mask_bytes` of `spec`'s micro-batch, cached on disk: building the masks imports transformers'
    masking code, and with it torch's compiler front end (1.8 s measured), which a warm plan need not pay."""
    shape = f"{key}|batch={spec.micro_batch_size}|seq={spec.seq_len}|packed={spec.packing}|{spec.dtype}"
    record = read_cache("stage-masks", shape)
    if record is None:
        record = {"bytes": stage_mask_bytes(_attention_config(key), batch=spec.micro_batch_size, seq=spec.seq_len,
                                            packed=spec.packing, dtype=dtype_of(spec.dtype))}
        write_cache("stage-masks", shape, record)
    return record["bytes"]


@functools.lru_cache(maxsize=32)
def _attention_config(key: str):
    """The config of `key` with the attention implementation its model's class picks, from the (disk-cached) layout:
    a warm plan then never imports the modeling code (~1.6 s measured for Llama-3.1-70B)."""
    config = copy.copy(CONFIGS[key])
    config._attn_implementation = layout_of(key).attn_implementation
    return config


def _block_memory(trace: BlockTrace, spec: TrainingSpec, *, hidden_bytes: int, tp: int,
                  gathered: int = 0) -> tuple[int, int, int]:
    """A block's (kept activations, workspace, host bytes) from its trace, before QLoRA's dequantized weight;
    `gathered`: what a gathered output's all-gather holds beyond the trace (`gather_transient_bytes`)."""
    if spec.method == "inference":
        return 0, trace.inference_peak, 0
    # The single-process trace has no collectives: backward's input-gradient all-reduce
    # (`_c10d_functional.all_reduce`, DTensor's Partial -> Replicate) copies the partial sum out of place, and
    # both are alive at once (measured: +1 hidden state at that op, LoRA tp=2 with checkpointing).
    reduce_copy = hidden_bytes if tp > 1 else 0
    # A gathered output's all-gather buffers add to the recompute's peak; without recompute backward's peak stays
    # above them (measured, Phi-3 LoRA tp=2: the run held 1.19 of the plan with checkpointing before they were
    # counted, 0.92 without; see tests/parallel/test_apply.py).
    recompute = trace.activations + trace.workspace + gathered + reduce_copy
    if spec.checkpointing == "on":  # only the block input is kept; backward recomputes the block's activations
        return hidden_bytes, recompute, 0
    if spec.checkpointing == "offload":  # the input waits in host memory; on the device while the block
        # recomputes, its input brought back and the next block's already on its way (`apply.offload`)
        return 0, recompute + 2 * hidden_bytes, hidden_bytes
    return trace.activations, trace.workspace + reduce_copy, 0


def _with_deferred_grads(costs: ModelCosts, layout: Layout, config) -> ModelCosts:
    """`costs` with each part's `deferred_bytes` set."""
    deferred = _deferred_grad_bytes(layout, costs.spec, config, costs.tp)
    return replace(costs, **{name: replace(getattr(costs, name), deferred_bytes=deferred[name]) for name in deferred})


def head_tokens(spec: TrainingSpec) -> int:
    """Positions of a micro-batch the head runs on: every one, but where an inference plan is for generating
    `rollout_tokens` new tokens a sequence, those only (`generate` keeps one position's logits a step: the prompt's
    last, then each new one); counting the head on every position there split a model for generation as for
    training, its last stage the lighter (docs/benchmarks/generate.md)."""
    if spec.method == "inference" and spec.rollout_tokens:
        return spec.micro_batch_size * min(spec.rollout_tokens, spec.seq_len)
    return spec.micro_batch_size * spec.seq_len


def _deferred_grad_bytes(layout: Layout, spec: TrainingSpec, config, tp: int) -> dict[str, int]:
    """Bytes per part that torch's split backward (`stage_backward_input`, then `stage_backward_weight`) keeps
    between its two passes: each trainable weight's gradient needs the gradient of that weight's output, so
    the input pass keeps one per trainable matmul or norm (activations it also needs are already kept).
    Measured: tests/parallel/test_apply.py, full fine-tuning under ZB-V, whose rank 0 held 6.7 MiB beyond the
    plan during its last stage's input pass; this counts 6.5 MiB there (a block's 5, the head's 1.5)."""
    if spec.method == "inference":
        return {"embed": 0, "block": 0, "head": 0}
    tokens, hidden = spec.micro_batch_size * spec.seq_len, config.hidden_size

    def out(lin: Linear) -> int:
        return rank_out_features(lin, config, tp)

    if spec.method != "full":  # LoRA: B's output is its base layer's, A's is the rank; adapters in their dtype
        adapters = sum(out(lin) + spec.lora_r for lin in lora_targets(layout, spec, expert_parameters(config)))
        return {"embed": 0, "block": adapters * tokens * LORA_ADAPTER_DTYPE.itemsize, "head": 0}
    size = dtype_of(spec.dtype).itemsize
    norms = layout.block_numel_replicated // hidden  # the norms (a whole bias: a row too many)
    block = sum(out(lin) for lin in layout.linears) + norms * hidden
    head = config.vocab_size // tp + (hidden if layout.norm_numel else 0)  # lm_head's logits, the final norm
    return {"embed": hidden * tokens * size, "block": block * tokens * size, "head": head * tokens * size}


def _traced_spec(spec: TrainingSpec) -> TrainingSpec:
    """The spec a run's parts are traced with: QLoRA's activations as LoRA's, under autocast where the run
    autocasts (`TrainingSpec.autocast_dtype`; other methods never do), its `quantize_experts` whether the traced
    experts are 4-bit (each grouped matmul holding their dequantized matrices). With 4-bit experts their LoRA is applied
    split (`hfsplit.apply.quantized_experts`), not by peft's dense ΔW the trace would build: the trace adapts the
    other targets and `split_lora_activation_bytes` adds what the split adapters keep."""
    if spec.method == "qlora":
        targets = spec.lora_targets
        if spec.experts_in_4bit and targets is not None and _EXPERT_NAMES & set(targets):
            targets = tuple(t for t in targets if t not in _EXPERT_NAMES) or None
        return replace(spec, method="lora", autocast=spec.autocast_dtype is not None, lora_targets=targets,
                       quantize_experts=spec.experts_in_4bit)
    return replace(spec, autocast=None, quantize_experts=False)


# The fused expert parameter names LoRA may target (transformers' experts modules; expert_lora.expert_parameters).
_EXPERT_NAMES = frozenset({"gate_up_proj", "up_proj", "down_proj"})


def weight_bytes(config, spec: TrainingSpec) -> int:
    """Bytes of the model's weights held once, without a trace: every split of a `spec` run holds at least
    this much across its devices (TP replicates norms, adapters and optimizer state come on top; an input embedding
    table in host RAM, `TrainingSpec.host_embedding`, is not on them)."""
    layout = layout_of(keyed(config))
    kinds = layer_kinds(config)
    blocks = ([_block_weight_bytes(kind_config(config, k), spec) for k in kinds] if kinds
              else [_block_weight_bytes(config, spec)] * config.num_hidden_layers)
    ends = layout.embed_numel + layout.head_numel - (layout.embed_numel if layout.tied or spec.host_embedding else 0)
    return sum(blocks) + ends * dtype_of(spec.dtype).itemsize


def _block_weight_bytes(config, spec: TrainingSpec) -> int:
    layout = layout_of(keyed(config))
    if spec.method == "qlora":
        return quantized_block_bytes(layout, spec, config)
    return (layout.block_numel_replicated + layout.block_numel_sharded) * dtype_of(spec.dtype).itemsize
