"""Activation bytes measured, not modelled: one block (and the embeddings and head) traced at the real dimensions
under FakeTensorMode, no memory allocated, so the figures follow whatever the attention implementation and MLP
really keep for backward.

Each traced figure is cached, in memory and on disk (`hfsplit.planning.costs.traces`); other TP degrees are
derived from two traces (`hfsplit.planning.costs.tp`).
"""
from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from hfsplit.models.boundary import block_inputs, hidden_shape
from hfsplit.models.expert_lora import expert_parameters
from hfsplit.models.families import FAMILIES, Family
from hfsplit.models.layout import decoder_layout, meta_model
from hfsplit.models.tiled_mlp import tile_mlps
from hfsplit.models.loss import chunked_causal_lm_loss, chunked_sequence_logps, dpo_head_loss
from hfsplit.plan import TrainingSpec
from hfsplit.planning.costs.layout import (
    CONFIGS, LORA_ADAPTER_DTYPE, dtype_of, layout_of, lora_targets, numel, parts, rank_layer_config,
)
from hfsplit.planning.costs.lora import inject_trace_adapters
from hfsplit.planning.costs.masks import mask_as_run, traced_rows
from hfsplit.planning.costs.moe import grouped_mm_as_torch_saves


class LiveBytes(TorchDispatchMode):
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


class SavedBytes:
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
class BlockTrace:
    activations: int  # saved for backward by one block
    workspace: int  # transient beyond the saved activations and the block's own gradients
    inference_peak: int  # peak of a no-grad forward, input and output included (0 in a training trace)


@dataclass(frozen=True)
class EndsTrace:
    embed_activations: int
    embed_workspace: int
    head_activations: int
    head_workspace: int


def _fake_model(key: str, spec: TrainingSpec, tp: int, mode: FakeTensorMode):
    """A one-block model of the real class with fake (unallocated) weights, and the kwargs its model
    forward passes to the block (rotary embeddings, mask), captured by running it once."""
    config = CONFIGS[key]
    model = meta_model(rank_layer_config(config, tp=tp), dtype=dtype_of(spec.dtype))
    base = model.get_submodule(decoder_layout(model).base)
    block = parts(model)[1]
    if spec.method == "lora":
        _add_lora(block, key, spec)
    if spec.tiled_mlp > 1 and spec.method != "inference":  # traced as it runs: a slice of the sequence at a time
        tile_mlps([block], chunks=spec.tiled_mlp)
    with mode:
        _to_fake(model)
        kwargs, ids = _block_kwargs(base, block, spec)
        rows = traced_rows(model.config, batch=spec.micro_batch_size, seq=spec.seq_len, packed=spec.packing)

    masked = mask_as_run(model.config, kwargs, batch=spec.micro_batch_size, seq=spec.seq_len, packed=spec.packing)
    masked = {**masked, "attention_mask": rows} if rows is not None else masked
    return model, block, masked, ids


def _add_lora(block, key: str, spec: TrainingSpec, *, use_peft: bool = False) -> None:
    """The spec's LoRA adapters on `block`: peft's own with `use_peft` (tests compare), else `trace_lora`'s,
    which trace alike without importing peft (and through it bitsandbytes and torch._inductor)."""
    experts = expert_parameters(CONFIGS[key])
    targets = [lin.name.rsplit(".", 1)[-1] for lin in lora_targets(layout_of(key), spec, experts)]
    parameters = [experts[t][0] for t in spec.lora_targets or () if t in experts]
    if parameters:  # adapters on fused experts: peft's own ParamWrapper (trace_lora builds linears' only)
        use_peft = True
    if not use_peft:
        return inject_trace_adapters(block, targets, r=spec.lora_r, adapter_dtype=LORA_ADAPTER_DTYPE,
                                     cast_input=_traced_autocast(spec) is None)
    from peft import LoraConfig, inject_adapter_in_model  # lazy: ~3 s import (inductor)

    inject_adapter_in_model(LoraConfig(r=spec.lora_r, target_modules=targets, target_parameters=parameters or None),
                            block)
    for name, module in block.named_modules():
        if name.endswith(("lora_A", "lora_B")):
            module.to(LORA_ADAPTER_DTYPE)
        if hasattr(module, "lora_A"):  # as hfsplit.apply.autocast turns it off
            module.cast_input_dtype_enabled = _traced_autocast(spec) is None


def _traced_autocast(spec: TrainingSpec):
    """The dtype a traced block's forward autocasts to, or None: `_model_costs` sets a traced spec's `autocast`
    to whether the run autocasts (`TrainingSpec.autocast_dtype` of the spec it plans)."""
    return dtype_of(spec.dtype) if spec.autocast and spec.dtype != "float32" else None


def _block_kwargs(base, block, spec: TrainingSpec):
    ids = torch.zeros(spec.micro_batch_size, spec.seq_len, dtype=torch.long)
    return block_inputs(base, block, ids), ids


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


def set_trainable(module: torch.nn.Module, spec: TrainingSpec) -> None:
    """Gradients on what `spec` trains: everything (full) or the adapters (LoRA)."""
    for name, p in module.named_parameters():
        p.requires_grad_(spec.method == "full" or (spec.method == "lora" and "lora_" in name))


def _hidden(output):
    """A block's hidden states: some blocks (GPT-2's) return them first in a tuple."""
    return output[0] if isinstance(output, tuple) else output


@dataclass(frozen=True)
class BlockEvents:
    """One block trace before its figures are combined: the live bytes at each new storage of the no-grad
    forward, the training forward and backward (`LiveBytes.history`), and the byte counts they are taken
    against. Each entry is a sum of tensor sizes, so `hfsplit.planning.costs.tp` derives other TP degrees from two."""

    inference: tuple[int, ...]
    forward: tuple[int, ...] = ()
    backward: tuple[int, ...] = ()
    activations: int = 0  # saved for backward, parameters excluded
    grads: int = 0  # the block's parameter gradients
    out_bytes: int = 0  # the block's output, which belongs to the next part's activations

    def trace(self) -> BlockTrace:
        inference_peak = max(self.inference)
        if not self.forward:
            return BlockTrace(0, 0, inference_peak)
        acts = self.activations
        workspace = max(max(self.forward) - acts, max(self.backward) - acts - self.grads - self.out_bytes)
        return BlockTrace(acts, max(workspace, 0), inference_peak)


@functools.lru_cache(maxsize=256)
def trace_block(key: str, spec: TrainingSpec, tp: int) -> BlockTrace:
    return block_events(key, spec, tp).trace()


@functools.lru_cache(maxsize=64)
def block_events(key: str, spec: TrainingSpec, tp: int) -> BlockEvents:
    config = CONFIGS[key]
    dtype = dtype_of(spec.dtype)
    shape = hidden_shape(config, spec.micro_batch_size, spec.seq_len)
    mode = FakeTensorMode()
    model, block, kwargs, _ = _fake_model(key, spec, tp, mode)
    with mode, _grouped_experts_on_fake_tensors(dequantized=_traces_4bit_experts(spec)):
        set_trainable(block, spec)
        params = list(block.parameters())

        if spec.method == "inference":  # only inference plans read the no-grad peak: training skips that pass
            with LiveBytes() as live, torch.no_grad():
                x = torch.empty(shape, dtype=dtype)  # held, as a caller holds a block's input
                y = _hidden(block(x, **kwargs))
                del x, y
            return BlockEvents(tuple(live.history))

        saved = SavedBytes(exclude=params)
        with LiveBytes() as live:
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
        return BlockEvents((0,), forward, backward, activations, grads, y.untyped_storage().nbytes())


@functools.lru_cache(maxsize=256)
def trace_ends(key: str, spec: TrainingSpec) -> EndsTrace:
    config = CONFIGS[key]
    dtype = dtype_of(spec.dtype)
    shape = (spec.micro_batch_size, spec.seq_len, config.hidden_size)
    mode = FakeTensorMode()
    model, _, _, ids = _fake_model(key, spec, 1, mode)
    with mode:
        _, _, after, lm_head = parts(model)
        # the final norm; Gemma 3n's AltUp unembedding projections (a ModuleList over its extra streams, ahead of the
        # norm) are not traced: their parameters are the head's, their activations (3 hidden states) go uncounted
        kept = [m for m in after if numel([m]) and not isinstance(m, torch.nn.ModuleList)]
        embed, norm = model.get_input_embeddings(), torch.nn.Sequential(*kept)
        set_trainable(model, spec)
        train = spec.method != "inference"

        # Embeddings: the lookup output is the first block's input, counted there.
        saved = SavedBytes(exclude=list(embed.parameters()))
        with LiveBytes() as live, torch.set_grad_enabled(train), saved.hooks():
            h = embed(ids)
        embed_fwd, embed_bwd = live.peak, 0
        if spec.method == "full":
            with LiveBytes() as live:
                h.backward(torch.empty_like(h))
            embed_bwd = live.peak - embed.weight.grad.untyped_storage().nbytes()
            embed.weight.grad = None
        embed_acts = saved.bytes if train else 0
        embed_ws = max(embed_fwd - embed_acts, embed_bwd)

        # Head: the final norm, lm_head and the loss. The logits stay alive with the model output.
        head_params = list(norm.parameters()) + list(lm_head.parameters())
        saved = SavedBytes(exclude=head_params)
        with LiveBytes() as live:
            x = torch.empty(shape, dtype=dtype, requires_grad=train)
            with torch.set_grad_enabled(train), saved.hooks():
                # the family's logit scaling / soft-capping makes logits-sized temporaries of its own
                head = lambda h: FAMILIES.get(config.model_type, Family()).output_side(config, lm_head(h))  # noqa: E731
                if train and spec.chunked_loss:  # the stage outputs the normed states; the loss runs lm_head per chunk
                    logits = norm(x)
                    if spec.counts.head == "sequences":  # each row's response log-prob chunk by chunk, then its loss
                        loss = dpo_head_loss(logits, ids, logps=functools.partial(chunked_sequence_logps, head=head,
                                                                                  vocab_size=config.vocab_size))
                    else:
                        loss = chunked_causal_lm_loss(logits, ids, head=head, vocab_size=config.vocab_size)
                else:
                    logits = head(norm(x))
                    if train and spec.counts.head == "sequences":  # each row's response log-prob, then its loss
                        loss = dpo_head_loss(logits, ids)
                    elif train:
                        loss = model.loss_function(logits=logits, labels=ids, vocab_size=config.vocab_size)
            head_fwd = live.peak
            if not train:
                return EndsTrace(0, embed_ws, 0, head_fwd)
            saved.add(logits)
            live.reset_peak()
            loss.backward()
            head_bwd = live.peak
        head_acts = saved.bytes
        grads = sum(p.grad.untyped_storage().nbytes() for p in head_params if p.grad is not None)
        head_ws = max(head_fwd - head_acts, head_bwd - head_acts - grads)
        return EndsTrace(embed_acts, max(embed_ws, 0), head_acts, max(head_ws, 0))


def _traces_4bit_experts(spec: TrainingSpec) -> bool:
    """Whether a traced spec is a QLoRA run's with 4-bit experts: `hfsplit.planning.costs.model` traces QLoRA as
    LoRA with `autocast` a bool (None for every other method, and in a spec nobody traced) and `quantize_experts`
    set to `experts_in_4bit`."""
    return spec.autocast is not None and spec.quantize_experts


@contextmanager
def _grouped_experts_on_fake_tensors(*, dequantized: bool = False):
    """MoE blocks traced as they run: transformers' grouped experts (`grouped_mm`, the tokens × top-k routed rows
    only). Torch's meta kernel of `grouped_mm` takes bf16 only, so other dtypes go through transformers' fallback op
    (its fake kernel takes every dtype), wrapped by `hfsplit.planning.costs.moe` to save for backward what torch's
    op saves: with frozen experts, not the routed rows. The `batched_mm` alternative would gather each routed row's
    expert matrices (5-17x the measured peak). `dequantized`: 4-bit experts, every call through the wrapper, which
    holds the dequantized matrices for the call as `hfsplit.apply.quantized_experts` does."""
    try:
        from transformers.integrations import moe
    except ImportError:  # a transformers without fused experts: nothing to route
        yield
        return

    grouped_mm = moe._grouped_mm
    moe._grouped_mm = lambda input, weight, offs: (
        grouped_mm(input, weight, offs) if not dequantized and weight.dtype == torch.bfloat16
        and moe._can_use_grouped_mm(input, weight, offs) else grouped_mm_as_torch_saves(input, weight, offs,
                                                                                       dequantized=dequantized))
    try:
        yield
    finally:
        moe._grouped_mm = grouped_mm
