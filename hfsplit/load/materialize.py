"""Materialise a planned model: meta-device skeleton → real weights, block by block.

The single-process path places whole blocks on local devices, like a transformers
`device_map`, reading each block's tensors straight onto its device. Host RAM peaks at
what is planned on the CPU plus one read chunk, never the whole checkpoint.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Mapping, Optional, Union

import torch

from hfsplit.apply.quantize import Staging, check_quantization, quantize_module, quantizes
from hfsplit.apply.steps import apply_plan_to_model
from hfsplit.budget import BudgetSpec, check_devices_here, local_max_memory, parse_max_memory, torch_device
from hfsplit.checkpoint.quantized import quantization_of_checkpoint
from hfsplit.checkpoint.reader import CheckpointReader
from hfsplit.checkpoint.resolve import load_config, resolve_file
from hfsplit.errors import CheckpointError, ConvertedOnLoadError
from hfsplit.load.launch import spec_of_intent, split_from_pretrained
from hfsplit.models.families import FAMILIES, check_causal_lm
from hfsplit.models.layout import decoder_layout, holds_experts, meta_model, recompute_buffers
from hfsplit.models.masks import causal_masks, layer_attention_type
from hfsplit.models.varlen import IMPLEMENTATION as VARLEN_IMPLEMENTATION, enabled as varlen_enabled, is_packed
from hfsplit.parallel.mesh import World, launcher_world
from hfsplit.planning.planner import make_plan

logger = logging.getLogger(__name__)

# Fewer blocks than this load too fast for a progress bar to help.
_PROGRESS_MIN_BLOCKS = 8

DeviceMap = Mapping[str, Union[int, str, torch.device]]


def from_pretrained(
    name_or_path: Union[str, os.PathLike],
    max_memory: BudgetSpec = None,
    *,
    dtype: Union[torch.dtype, str, None] = None,
    plan=None,
    training: str = "inference",
    attn_implementation: Optional[str] = None,
    revision: Optional[str] = None,
    quantization_config=None,
    **planner_options,
):
    """Load a causal LM split over the local devices, reading only what each device needs.

    Args:
        name_or_path: a local model folder or a hub name ("org/model").
        max_memory: per-device budget (see `hfsplit.budget.parse_max_memory`); default: what
            the local devices have free.
        dtype: weights dtype (torch dtype or name); default "auto" like transformers: the
            config's dtype, else the checkpoint's.
        plan: a `Plan` (tp=1) or an accelerate-style device map `{"model.layers.3": 0, ...}`;
            default: `make_plan(..., tp=1)`.
        training: "inference" (the weights, generation's KV cache and one forward's activations), "lora" or "full":
            what the plan budgets memory for, on one process and under a launcher alike.
        attn_implementation: passed to the model ("sdpa", "eager", ...).
        revision: hub revision.
        quantization_config: transformers' `BitsAndBytesConfig`: each decoder block's linears are quantized on
            their device right after the block is read (embeddings, norms, lm_head stay 16-bit); planned as QLoRA.
        planner_options: further `make_plan` options (seq_len etc. go in `spec`).

    Under a distributed launch (more than one rank: torchrun, accelerate launch) this returns this
    rank's `hfsplit.parallel.split_model.SplitModel` instead: the plan spans all ranks, each rank reads and
    holds only its stage's (and TP slice's) bytes. It has the same surface: `hf_device_map` (every stage's
    modules → "rank:device"), `hfsplit_plan`, `config`, `generation_config`, `forward`, `generate` (pipelined over
    the stages, transformers' arguments) and `save_pretrained` (collective); a transformers attribute of the whole
    model raises `SplitAttributeError` saying why. The default budget is an equal share of what each host's
    devices have free, as the recipe's. An inference plan budgets generation's KV cache for micro_batches ×
    micro-batch size sequences of `seq_len` tokens: state the rollout with `spec=TrainingSpec(method="inference",
    seq_len=..., micro_batch_size=...)` and `global_batch=` (or `micro_batches=`).

    Returns:
        The model with real weights, `hf_device_map` and `hfsplit_plan` set, in eval mode.

    Raises:
        UnsupportedModelError: the architecture cannot be split.
        CheckpointError: the checkpoint is missing tensors or disagrees with its config.
        PlanError: nothing fits the budget.
    """
    world = launcher_world()
    if world.launched:
        return split_across_ranks(str(name_or_path), max_memory, world=world, dtype=dtype, plan=plan,
                                  training=training, quantization_config=quantization_config, **planner_options)
    return load_whole_blocks(str(name_or_path), max_memory, dtype=dtype, plan=plan, training=training,
                             attn_implementation=attn_implementation, revision=revision,
                             quantization_config=quantization_config, **planner_options)


def load_whole_blocks(source: str, max_memory: BudgetSpec, *, dtype, plan, training: str,
                      attn_implementation: Optional[str], revision: Optional[str], quantization_config=None,
                      **planner_options):
    """The single-process `from_pretrained`: whole blocks placed by the plan, the model's own forward."""
    check_placement_here(max_memory, plan)
    config = load_config(source, revision=revision)
    check_causal_lm(config)  # whole blocks run inside the model's own forward: any causal LM loads right
    try:
        model, reader = meta_model_and_reader(config, source, dtype=dtype, attn_implementation=attn_implementation,
                                              revision=revision)
    except ConvertedOnLoadError:
        wanted = resolve_dtype(dtype, config)
        model = meta_model(config, dtype=wanted, attn_implementation=attn_implementation)
        return load_with_transformers(source, config, model, max_memory, plan=plan, training=training, dtype=wanted,
                                      attn_implementation=attn_implementation, revision=revision, **planner_options)
    # pre-quantized: load its packed weights as stored, as transformers does
    quantization_config = quantization_of_checkpoint(source, quantization_config, config=config, method="qlora"
                                                     if quantization_config or training == "inference" else training)
    if plan is None:
        plan = plan_for(config, source, max_memory, training=training, dtype=model.dtype,
                        quantization=quantization_config, **planner_options)
    device_map = device_map_of(plan, model)
    check_device_map(model, device_map)
    with reader:
        experts = plan.spec.quantize_experts if hasattr(plan, "spec") else True
        materialize_blocks(model, reader, device_map, after_block=quantizer_of(quantization_config, reader,
                                                                                experts=experts))
    tie_on_same_device(model, device_map, training=training)
    restore_nonpersistent_buffers(model, device_map)
    check_no_meta(model)
    model = dispatch(model, device_map)
    isolate_packed_rows(model)
    model.hf_device_map = dict(device_map)
    model.hfsplit_plan = apply_plan_to_model(model, plan if not isinstance(plan, Mapping) else None)
    load_generation_config(model, source, revision)
    if quantization_config is not None:  # what peft and transformers read to pick their bitsandbytes paths
        model.is_loaded_in_4bit = not quantization_config.load_in_8bit
        model.is_loaded_in_8bit = bool(quantization_config.load_in_8bit)
    return model.eval()


def check_placement_here(max_memory: BudgetSpec, plan) -> None:
    """Refuse a budget or a device map naming a device this machine lacks, before a byte is read (a plan made
    elsewhere, `hfsplit plan` for GPUs that are not here, places nothing until it loads)."""
    if max_memory is not None:
        check_devices_here(parse_max_memory(max_memory))
    if isinstance(plan, Mapping):
        check_devices_here({str(d).removeprefix("cuda:"): 0 for d in plan.values()}, what="device map")
    elif plan is not None:
        check_devices_here({d: s.budget for s in plan.stages for g in s.devices for d in g}, what="plan")


def split_across_ranks(source: str, max_memory, *, world: World, dtype, plan, training: str,
                       quantization_config=None, **planner_options):
    """Under a distributed launch: this rank's SplitModel of the plan spanning `world`'s ranks, planned for
    `training` (inference by default, as the single-process path)."""
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    return split_from_pretrained(source, max_memory, plan=plan, dtype=dtype if isinstance(dtype, torch.dtype) else None,
                                 quantization_config=quantization_config, training=training,
                                 world_size=world.world_size, **planner_options)


# ---- steps ------------------------------------------------------------------------------


def meta_model_and_reader(config, source: str, *, dtype, attn_implementation, revision):
    """(meta model in the dtype to load, open checkpoint reader): "auto"/None takes the config's dtype,
    else the checkpoint's own floating dtype. The reader validates every tensor first."""
    wanted = resolve_dtype(dtype, config)
    model = meta_model(config, dtype=wanted, attn_implementation=attn_implementation)
    reader = CheckpointReader.open(source, model=model, revision=revision)
    if wanted is None:
        stored = checkpoint_float_dtype(reader, model)
        if stored is not None and stored != model.dtype:
            # Rebuilt rather than cast: buffers transformers keeps in fp32 (rotary inv_freq) stay fp32.
            model = meta_model(config, dtype=stored, attn_implementation=attn_implementation)
    return model, reader


def load_with_transformers(source: str, config, model: torch.nn.Module, max_memory: BudgetSpec, *, plan, training: str,
                           dtype: Optional[torch.dtype], attn_implementation: Optional[str], revision: Optional[str],
                           **planner_options):
    """Load a checkpoint whose tensors transformers merges on load (MoE experts stored one by one) with
    transformers itself, onto hfsplit's planned whole-module placement: its loader does the merging."""
    from transformers import AutoModelForCausalLM

    if plan is None:
        plan = plan_for(config, source, max_memory, training=training, dtype=model.dtype, **planner_options)
    device_map = device_map_of(plan, model)
    check_device_map(model, device_map)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation is not None else {}
    loaded = AutoModelForCausalLM.from_pretrained(source, device_map=dict(device_map), dtype=dtype or "auto",
                                                  revision=revision, trust_remote_code=False, **kwargs)  # no prompt
    isolate_packed_rows(loaded)
    loaded.hf_device_map = dict(device_map)  # transformers sets it only for more than one device
    loaded.hfsplit_plan = plan if not isinstance(plan, Mapping) else None
    return loaded.eval()


def resolve_dtype(dtype: Union[torch.dtype, str, None], config) -> Optional[torch.dtype]:
    """The torch dtype to build the model in; None means "as the checkpoint stores it"."""
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None)
        if dtype is None:
            return None
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype {dtype!r}: use a torch dtype or its name, e.g. 'bfloat16'")
        dtype = getattr(torch, dtype)
    return dtype


def checkpoint_float_dtype(reader: CheckpointReader, model: torch.nn.Module) -> Optional[torch.dtype]:
    """The stored dtype of the model's first floating parameter (transformers' dtype="auto" fallback)."""
    for name, param in model.named_parameters():
        if param.is_floating_point():
            return reader.dtype(name)
    return None


def plan_for(config, source: str, max_memory: BudgetSpec, *, training: str, dtype: torch.dtype, quantization=None,
             **options):
    """The planner's single-process (tp=1) plan for this model and budget (QLoRA with `quantization`)."""
    spec = options.pop("spec", None) or spec_of_intent(training, dtype=dtype, quantization=quantization)
    budget = max_memory if max_memory is not None else local_max_memory()
    if not isinstance(config.name_or_path, str) or not config.name_or_path:
        config.name_or_path = source
    return make_plan(config, budget, spec=spec, tp=1, single_process=True, **options)


def device_map_of(plan, model: torch.nn.Module) -> dict[str, Union[int, str]]:
    """The `{module prefix: device}` map of a Plan over `model`'s own modules, or the map itself when one
    was given."""
    if isinstance(plan, Mapping):
        return dict(plan)
    return plan.device_map(decoder_layout(model))


def check_device_map(model: torch.nn.Module, device_map: DeviceMap) -> None:
    """Every parameter and buffer falls under exactly one device-map prefix."""
    for prefix in device_map:
        try:
            model.get_submodule(prefix)
        except AttributeError:
            raise ValueError(f"device map names {prefix!r}, which {type(model).__name__} lacks") from None
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)] + [n for n, _ in model.named_buffers()]
    orphans = [n for n in names if block_of(n, device_map) is None]
    if orphans:
        raise ValueError(f"device map places no block holding {orphans[:5]}; add their module prefixes")


def block_of(name: str, device_map: DeviceMap) -> Optional[str]:
    """The device-map prefix that owns tensor `name` (longest match)."""
    best = None
    for prefix in device_map:
        if prefix == "" or name == prefix or name.startswith(prefix + "."):
            if best is None or len(prefix) > len(best):
                best = prefix
    return best


def quantizer_of(quantization_config, reader=None, *, experts: bool = True):
    """`after_block` for `materialize_blocks`: quantize a decoder block's linears on its device (QLoRA), or
    read them as `reader`'s pre-quantized checkpoint stores them; with `experts` (4-bit), an MoE block's fused
    experts too, each read and quantized alone."""
    return None if quantization_config is None else BlockQuantizer(quantization_config, reader, experts=experts)


class BlockQuantizer:
    """Quantizes each decoder block right after it is read (embeddings, norm and lm_head stay 16-bit, as in
    transformers' bitsandbytes integration). Its blocks' 16-bit linear weights are read into one staging
    buffer that every block reuses (`empty`), not mapped from the file nor given fresh tensors: mapped pages
    stay in the process's RSS until the file closes, and freed per-weight tensors stay in glibc's heap between
    the quantized bytes kept, so either way the 16-bit model piled up in host RAM while loading. Fused MoE experts
    (4-bit, `experts`) stay on the meta device until the block is read, then are read and quantized expert by
    expert (`hfsplit.apply.quantized_experts.quantize_block_experts`)."""

    def __init__(self, quantization_config, reader=None, *, experts: bool = True):
        self.config, self.reader = quantization_config, reader
        self.per_expert = experts and not quantization_config.load_in_8bit
        self.checked: set = set()
        self.staging = None

    @staticmethod
    def quantizes(prefix: str) -> bool:
        return ".layers." in f".{prefix}."

    def empty(self, module: torch.nn.Module, device: torch.device) -> None:
        """`module.to_empty(device)`, except that plain linears' weights are views of the staging buffer."""
        from torch import nn

        linears = [sub for name, sub in module.named_modules() if quantizes(name, sub)]
        numel = sum(sub.weight.numel() for sub in linears)
        dtype = linears[0].weight.dtype if linears else torch.float32
        staging = self.staging
        fits = staging is not None and staging.buffer.numel() >= numel
        if not fits or (staging.buffer.dtype, staging.buffer.device) != (dtype, device):
            staging = self.staging = Staging(numel, dtype=dtype, device=device)  # grown for a larger block
        staging.reset()
        for sub in linears:
            sub.weight = nn.Parameter(staging.take(tuple(sub.weight.shape)), requires_grad=False)
        for sub in module.modules():  # the rest (norms, biases, buffers) as to_empty gives them
            for table in (sub._parameters, sub._buffers):
                for key, value in table.items():
                    if self.per_expert and table is sub._parameters and value is not None and value.dim() == 3 \
                            and holds_experts(sub):
                        continue  # fused experts: read expert by expert when the block is quantized
                    if value is not None and value.is_meta:
                        fresh = torch.empty_like(value, device=device)
                        table[key] = nn.Parameter(fresh, requires_grad=value.requires_grad) \
                            if isinstance(value, nn.Parameter) else fresh

    def __call__(self, prefix: str, module: torch.nn.Module, device: torch.device) -> None:
        if not self.quantizes(prefix):
            return
        if device not in self.checked:
            check_quantization(self.config, device=device)
            self.checked.add(device)
        quantize_module(module, self.config, device=device, prefix=prefix, reader=self.reader, experts=self.per_expert)


def materialize_blocks(model: torch.nn.Module, reader: CheckpointReader, device_map: DeviceMap,
                       after_block=None) -> None:
    """Give each block real storage on its device and read its tensors into it, in map order
    (`after_block(prefix, module, device)` runs once each block is read)."""
    blocks = list(device_map.items())
    retied = set(_tied_on_same_device(model, device_map))  # re-tied afterwards: no need to read them
    for prefix, device in _progress(blocks, desc="hfsplit: loading blocks"):
        module = model.get_submodule(prefix)
        target = torch_device(device)
        # A block quantized as read goes through the quantizer's staging buffer, never mapped (BlockQuantizer).
        mapping = not isinstance(after_block, BlockQuantizer) or not after_block.quantizes(prefix)
        if mapping:
            module.to_empty(device=target, recurse=True)
        else:
            after_block.empty(module, target)
        persistent = module.state_dict(prefix=f"{prefix}." if prefix else "", keep_vars=True)
        with torch.no_grad():
            for name, tensor in persistent.items():
                # nested blocks load their own tensors
                # (a pre-quantized weight is read by `after_block`, packed as stored)
                if tensor.is_meta:  # fused experts left for the quantizer (BlockQuantizer.empty)
                    continue
                if name not in retied and block_of(name, device_map) == prefix and not reader.packed_state_keys(name):
                    if mapping and target.type == "cpu" and reader.dtype(name) == tensor.dtype:
                        # CPU weights in the stored dtype: a copy-on-write view of the file, no copy
                        tensor.data = reader.mapped(name)
                    else:
                        reader.read_into(name, tensor.data)
        if after_block is not None:
            after_block(prefix, module, target)


def tie_on_same_device(model: torch.nn.Module, device_map: DeviceMap, *, training: str = "inference") -> None:
    """Re-tie weights that `to_empty` separated, where both ends live on one device.

    Tied weights on different devices keep one copy each (both read from the same
    checkpoint tensor): a forward works, but full fine-tuning would update them apart.
    """
    same = _tied_on_same_device(model, device_map)
    for target, source in same.items():
        owner, leaf = _split(model, target)
        setattr(owner, leaf, model.get_parameter(source))
    apart = set(getattr(model, "all_tied_weights_keys", None) or {}) - set(same)
    if apart and training == "full":
        logger.warning("%s tied to the embeddings but planned on another device; full fine-tuning will "
                       "update the two copies separately", ", ".join(sorted(apart)))


def _tied_on_same_device(model: torch.nn.Module, device_map: DeviceMap) -> dict[str, str]:
    """Tied weights {target: source} whose two ends the map places on one device."""
    pairs = getattr(model, "all_tied_weights_keys", None) or {}
    return {target: source for target, source in pairs.items()
            if torch_device(device_map[block_of(target, device_map)])
            == torch_device(device_map[block_of(source, device_map)])}


def restore_nonpersistent_buffers(model: torch.nn.Module, device_map: DeviceMap) -> None:
    """Recompute buffers no checkpoint holds (rotary `inv_freq`), on their block's device.

    Meta initialisation left them empty; transformers recomputes them with the model's
    `_init_weights`, which for a rotary embedding recomputes inv_freq from the config.
    """
    recompute_buffers(model, getattr(model, "_init_weights", None))


def check_no_meta(model: torch.nn.Module) -> None:
    """Fail loudly if a tensor was left on the meta device (it would fail later, obscurely)."""
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(f"tensors left without values after loading: {left[:5]}")


def dispatch(model: torch.nn.Module, device_map: DeviceMap):
    """Attach accelerate's hooks to move activations between devices (nothing to do on one device)."""
    devices = {torch_device(d) for d in device_map.values()}
    if len(devices) == 1:
        return model
    from accelerate import dispatch_model

    return dispatch_model(model, device_map=dict(device_map))


def isolate_packed_rows(model: torch.nn.Module) -> None:
    """Make `model(input_ids, position_ids=...)` keep attention inside each example of a packed row.

    transformers' mask builders find packed examples from the position ids only without a cache, but its model
    forward makes a cache whenever `use_cache` is left to the config (True for every causal LM), so a packed
    row called as a transformers model is called attended across its examples unless the caller also passes
    `use_cache=False`. A call with position ids and neither a cache nor `use_cache` runs without a cache here;
    generation (which passes its cache) and every other call are unchanged. Under sdpa, for the families hfsplit
    splits, each attention module of a packed call is handed a `PackedRows` (each example on its own: `hfsplit.models.varlen`), and the decoder a
    zero-stride 4-D stand-in so that transformers builds no L × L mask. Otherwise a family whose forward builds
    its masks without the position ids (`Family.mask_ignores_positions`) is handed transformers' packed masks."""
    def no_cache_for_given_positions(module, args, kwargs):
        given_cache = any(kwargs.get(name) is not None for name in ("cache", "past_key_values"))
        if kwargs.get("position_ids") is not None and kwargs.get("use_cache") is None and not given_cache:
            kwargs["use_cache"] = False
        return args, kwargs

    def packed_masks_for_given_positions(module, args, kwargs):
        positions, given_cache = kwargs.get("position_ids"), kwargs.get("cache") is not None
        if positions is not None and not given_cache and kwargs.get("attention_mask") is None:
            kwargs["attention_mask"] = packed_masks(model, positions)
        return args, kwargs

    model.register_forward_pre_hook(no_cache_for_given_positions, with_kwargs=True)
    family = FAMILIES.get(model.config.model_type)
    # example by example only where it is tested: the declared families' decoders (`layers`, each `self_attn`);
    # any other model keeps transformers' own masks
    if model.config._attn_implementation == VARLEN_IMPLEMENTATION and family is not None:
        examples_by_layer(model)
    if family is not None and family.mask_ignores_positions:
        # on the decoder, not the causal LM: the LM's router loss reads its own 2-D attention mask
        model.get_decoder().register_forward_pre_hook(packed_masks_for_given_positions, with_kwargs=True)


def examples_by_layer(model: torch.nn.Module) -> None:
    """Packed calls of `model` under sdpa: the decoder gets a zero-stride 4-D mask, which transformers' mask
    builders return as given, carrying the call's `PackedRows` by layer type (built once per call); each layer's
    attention is handed its type's. The stand-in travels with the layer's arguments, so a checkpointed layer's
    recompute finds it too."""
    def decoder_call(module, args, kwargs):
        positions = kwargs.get("position_ids")
        given_cache = any(kwargs.get(name) is not None for name in ("cache", "past_key_values"))
        if (positions is None or given_cache or kwargs.get("attention_mask") is not None or not varlen_enabled()
                or not is_packed(positions)):
            return args, kwargs
        ids = kwargs.get("input_ids", args[0] if args else None)
        batch, seq = (ids if ids is not None else kwargs["inputs_embeds"]).shape[:2]
        stand_in = torch.ones((), dtype=torch.bool, device=positions.device).expand(batch, 1, seq, seq)
        stand_in.hfsplit_packed_rows = packed_masks(model, positions)
        kwargs["attention_mask"] = stand_in
        return args, kwargs

    def attention_call(index: int):
        def hook(module, args, kwargs):
            rows = getattr(kwargs.get("attention_mask"), "hfsplit_packed_rows", None)
            if rows is not None:
                kwargs["attention_mask"] = rows[layer_attention_type(model.config, index)]
            return args, kwargs
        return hook

    model.get_decoder().register_forward_pre_hook(decoder_call, with_kwargs=True)
    for index, layer in enumerate(model.get_decoder().layers):
        layer.self_attn.register_forward_pre_hook(attention_call(index), with_kwargs=True)


def packed_masks(model: torch.nn.Module, positions: torch.Tensor) -> dict:
    """transformers' masks by attention type for rows whose position ids restart at each example (under sdpa
    `PackedRows`)."""
    shape_only = torch.empty(*positions.shape, 1, dtype=model.dtype, device=positions.device)
    return causal_masks(model.config, hidden=shape_only, position_ids=positions)


def load_generation_config(model, source: str, revision: Optional[str]) -> None:
    """Use the checkpoint's generation_config.json, as transformers' from_pretrained does."""
    from transformers import GenerationConfig

    try:
        path = resolve_file(source, "generation_config.json", revision=revision)
    except CheckpointError:
        return
    model.generation_config = GenerationConfig.from_pretrained(str(path.parent))


# ---- helpers ----------------------------------------------------------------------------


def tensor_names_of(model: torch.nn.Module, prefixes) -> set[str]:
    """Checkpoint-backed tensor names (parameters, persistent buffers) under module `prefixes`."""
    prefixes = list(prefixes)
    return {n for n in model.state_dict(keep_vars=True)
            if any(n == p or n.startswith(p + ".") for p in prefixes)}


def _split(model: torch.nn.Module, name: str):
    module_name, _, leaf = name.rpartition(".")
    return model.get_submodule(module_name), leaf


def _progress(items, *, desc: str):
    from tqdm.auto import tqdm

    disable = len(items) < _PROGRESS_MIN_BLOCKS or not sys.stderr.isatty()
    return tqdm(items, desc=desc, unit="block", disable=disable)
