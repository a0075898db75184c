"""Rank-side checks that the run keeps the plan (started by tests/parallel/launcher.py)."""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


def step_memory_and_losses(*, checkpoint: str, method: str, tp: int, pp: int, seq_len: int, micro_batch_size: int,
                           micro_batches: int, steps: int, qlora_bf16: bool = False, packed: bool = False,
                           host_embedding: bool = False) -> dict:
    """For activation checkpointing off, on, then offloaded: the plan's figure for this rank's stage, the peak the
    live-tensor counter measures over one steady-state training step (host copies of the offload left out), the
    host bytes the offload held at its peak beside the plan's, the loss curve and what the run applied; with
    `qlora_bf16`, also `qlora_autocast_memory`'s figures (under that key); with `packed`, the same figures of packed
    rows (two examples a row, planned with packing; checkpointing off and on) under "packed", in the same launch;
    with `host_embedding`, offload with the first stage's embedding table in host RAM too ("host embedding")."""
    out = {}
    if packed:
        out["packed"] = memory_by_checkpointing(checkpoint=checkpoint, method=method, tp=tp, pp=pp, seq_len=seq_len,
                                               micro_batch_size=micro_batch_size, micro_batches=micro_batches,
                                               steps=steps, packing=True, modes=(False, True))
    modes = (False, True, "offload") + (("host embedding",) if host_embedding else ())
    out.update(memory_by_checkpointing(checkpoint=checkpoint, method=method, tp=tp, pp=pp, seq_len=seq_len,
                                      micro_batch_size=micro_batch_size, micro_batches=micro_batches, steps=steps,
                                      modes=modes))
    if qlora_bf16:
        out["qlora_bf16"] = qlora_autocast_memory(checkpoint=checkpoint, seq_len=seq_len, micro_batches=micro_batches,
                                                  micro_batch_size=micro_batch_size, steps=steps)
    return out


def memory_by_checkpointing(*, checkpoint: str, method: str, tp: int, pp: int, seq_len: int, micro_batch_size: int,
                           micro_batches: int, steps: int, packing: bool = False,
                           modes=(False, True, "offload")) -> dict:
    """{activation checkpointing: the plan's figure for this rank's stages, the measured peak, losses, what ran}.
    A mode "host embedding" is offload with the first stage's embedding table in host RAM (`--host-embedding on`):
    its `host_weights` are the bytes of the parameters the run put on the host, beside the plan's."""
    from hfsplit.planning.costs.masks import traced_positions

    out = {}
    for ac in modes:
        # offload under the schedule checkpointing ran (auto may pick another for it: Interleaved1F1B, whose
        # checkpointed ranks the planner misjudges either way, offload or not; see qlora_autocast_memory)
        schedule = out[True]["schedule"] if ac in ("offload", "host embedding") else "auto"
        model, optimizer = _built(checkpoint, method=method, tp=tp, pp=pp, seq_len=seq_len,
                                  ac="offload" if ac == "host embedding" else ac, micro_batch_size=micro_batch_size,
                                  micro_batches=micro_batches, packing=packing, schedule=schedule,
                                  host_embedding="on" if ac == "host embedding" else "off")
        ids = torch.randint(3, model.config.vocab_size, (micro_batch_size * micro_batches, seq_len),
                            generator=torch.Generator().manual_seed(0))
        positions = traced_positions(len(ids), seq_len, packed=packing)
        losses, peak, growth, offloaded = _train(model, optimizer, ids, steps=steps, positions=positions)
        # A rank of a V or interleaved schedule runs several stages: their figures add up (one reserve).
        from hfsplit.plan import rank_total

        mine = [model.plan.stages[i].memory for i in model.stage_indices]
        planned = rank_total(mine)
        out[ac] = {"planned": planned, "planned_activations": sum(m.activations for m in mine),
                   "planned_offload": sum(m.offload for m in mine), "offloaded": offloaded,
                   "planned_host_weights": sum(m.host_weights for m in mine), "host_weights": _host_bytes(model),
                   "host": str(model.ctx.host),
                   "schedule": model.plan.schedule,
                   "measured": peak, "growth": growth, "losses": losses,
                   "applied": model.plan.applied, "steps": model.plan.steps(),
                   "checkpointed_blocks": sum(getattr(b, "gradient_checkpointing", False)
                                              for s in model.stages for b in s.body.layers.values())}
        del model, optimizer
    return out


def qlora_autocast_memory(*, checkpoint: str, seq_len: int, micro_batch_size: int, micro_batches: int,
                          steps: int) -> dict:
    """bf16 QLoRA on pp=2 with checkpointing, its forwards under autocast (the default) and not, and under autocast
    with the blocks' inputs offloaded (key "offload"): per setting the plan's figure for this rank's stages, the
    measured peak (as `step_memory_and_losses`), the offload's host bytes beside the plan's, and the losses.

    1F1B, one stage per rank: under auto's Interleaved1F1B the last rank's figure adds the head's kept
    activations to its other virtual stage's recompute peak, which never coincide (0.78 measured/planned here
    with autocast, a planner question of its own, not autocast's)."""
    from hfsplit.plan import rank_total

    out = {}
    for autocast in (False, True, "offload"):
        model, optimizer = _built(checkpoint, method="qlora", tp=1, pp=2, seq_len=seq_len,
                                  ac="offload" if autocast == "offload" else True,
                                  micro_batch_size=micro_batch_size, micro_batches=micro_batches,
                                  dtype="bfloat16", autocast=bool(autocast), schedule="1F1B")
        ids = torch.randint(3, model.config.vocab_size, (micro_batch_size * micro_batches, seq_len),
                            generator=torch.Generator().manual_seed(0))
        losses, peak, growth, offloaded = _train(model, optimizer, ids, steps=steps)
        mine = [model.plan.stages[i].memory for i in model.stage_indices]
        out[autocast] = {"planned": rank_total(mine), "planned_offload": sum(m.offload for m in mine),
                         "offloaded": offloaded,
                         "measured": peak, "growth": growth, "losses": losses, "applied": model.plan.applied,
                         "steps": model.plan.steps()}
        del model, optimizer
    return out


def tiled_mlp_memory(*, checkpoint: str, seq_len: int, micro_batches: int, steps: int) -> dict:
    """A long sequence on pp=2 LoRA with the chunked loss, 1F1B: checkpointing on with the MLP whole, then tiled
    with the norm feeding the MLP tiled apart from it (as before `mlp_neighbours`: planned and run so), then tiled
    as it runs now (that norm inside the MLP's slices), then offloaded and tiled. Per setting: the plan's figure for
    this rank's stage, the measured peak (as `step_memory_and_losses`), the offload's host bytes beside the plan's,
    the losses and what ran."""
    from hfsplit.plan import rank_total

    out = {}
    for name, ac, tiled in (("whole", True, "off"), ("norm apart", True, "on"), ("tiled", True, "on"),
                            ("offload", "offload", "on")):
        with _norms_tiled_apart() if name == "norm apart" else contextlib.nullcontext():
            model, optimizer = _built(checkpoint, method="lora", tp=1, pp=2, seq_len=seq_len, ac=ac,
                                      micro_batch_size=1, micro_batches=micro_batches, schedule="1F1B",
                                      tiled_mlp=tiled, chunked_loss=True)
        ids = torch.randint(3, model.config.vocab_size, (micro_batches, seq_len),
                            generator=torch.Generator().manual_seed(0))
        losses, peak, growth, offloaded = _train(model, optimizer, ids, steps=steps)
        mine = [model.plan.stages[i].memory for i in model.stage_indices]
        out[name] = {"planned": rank_total(mine), "planned_offload": sum(m.offload for m in mine),
                     "offloaded": offloaded, "measured": peak, "growth": growth, "losses": losses,
                     "applied": model.plan.applied, "steps": model.plan.steps(),
                     "tiles": [getattr(b.mlp, "tiled_mlp_chunks", 0) for s in model.stages
                               for b in s.body.layers.values()]}
        del model, optimizer
    return out


@contextlib.contextmanager
def _norms_tiled_apart():
    """The tiled MLP as it was before the norm feeding the MLP ran in the MLP's slices (each norm in slices of its
    own), in the run and in the planner's trace alike (both wrap with `tile_mlps`), with the planner's figures
    traced afresh (a cache of its own, the in-memory traces cleared) on the way in and out."""
    import os
    import tempfile

    import hfsplit.models.tiled_mlp as tiled_mlp

    def clear():
        from hfsplit.planning.costs import model as costs_model, tp as costs_tp, trace, traces

        traces._MEMO.clear()
        for cached in (trace.trace_block, trace.block_events, costs_tp.block_profile, costs_model._model_costs,
                       costs_model._costs_of):
            cached.cache_clear()

    own, cache = tiled_mlp.mlp_neighbours, os.environ.get("HFSPLIT_CACHE")
    with tempfile.TemporaryDirectory() as folder:
        tiled_mlp.mlp_neighbours, os.environ["HFSPLIT_CACHE"] = (lambda block: (None, None)), folder
        clear()
        try:
            yield
        finally:
            tiled_mlp.mlp_neighbours = own
            os.environ.pop("HFSPLIT_CACHE") if cache is None else os.environ.update(HFSPLIT_CACHE=cache)
            clear()


def _built(checkpoint, *, method, tp, pp, seq_len, ac, micro_batch_size, micro_batches, dtype="float32",
           autocast=None, schedule="auto", packing=False, tiled_mlp="off", chunked_loss=False, host_embedding="off"):
    from hfsplit.plan import TrainingSpec
    from hfsplit.load.launch import split_from_pretrained
    from hfsplit.apply.quantize import quantization_config

    spec = TrainingSpec(method=method, seq_len=seq_len, micro_batch_size=micro_batch_size, dtype=dtype,
                        lora_r=8, activation_checkpointing=ac, autocast=autocast, packing=packing,
                        chunked_loss=chunked_loss)
    qconfig = quantization_config(compute_dtype=dtype) if method == "qlora" else None
    torch.manual_seed(0)
    model = split_from_pretrained(checkpoint, "2x4GiB", spec=spec, micro_batches=micro_batches, tp=tp, pp=pp,
                                  dp=1, world_size=2, activation_checkpointing=ac, quantization_config=qconfig,
                                  dtype=getattr(torch, dtype), schedule=schedule, tiled_mlp=tiled_mlp,
                                  host_embedding=host_embedding)
    # As the trainer builds it (foreach off on CPU: TP mixes DTensor and plain parameters).
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, optimizer


def _train(model, optimizer, ids, *, steps: int, positions=None):
    """`steps` (at least 3) optimizer steps; the peak over the second (AdamW state exists, as the plan
    assumes): the bytes held when it starts (weights, AdamW state, torch's receive buffers) plus the peak of the
    storages it creates.
    And the bytes the third step leaves alive beyond what the second left (a leak grows it; 0 when each step
    frees what the one before kept), from one tracker over both; and the host bytes the activation offload held
    at its peak in the second step (0 without offload)."""
    from hfsplit.models.loss import causal_lm_loss

    loss_fn = causal_lm_loss(model.config.vocab_size)
    losses, peak, left, offloaded = [], 0, [], 0
    live = LiveStorages()
    for step in range(steps):
        held = _held_bytes(model, optimizer)
        model.activation_offload_bytes(reset=True)
        with live if step in (1, 2) else contextlib.nullcontext():
            loss = model.step(ids, ids, loss_fn, position_ids=positions)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if step == 1:  # + torch's receive buffers, made in the first step (before the tracker) and alive since
            peak = held + live.peak + receive_buffer_bytes(model)
            offloaded = model.activation_offload_bytes()
        if step in (1, 2):
            left.append(live.live)
        losses.append(None if loss is None else float(loss))
    return losses, peak, left[1] - left[0], offloaded


def _on_host(model) -> list[torch.Tensor]:
    """The parameters the run put in host RAM: those of a module it marked so (`hfsplit_device`), each checked to be
    on that device (on a CPU rank the same device as the rank's: the mark is what tells them apart)."""
    found = []
    for module in (m for stage in model.stages for m in stage.modules()):
        if getattr(module, "hfsplit_device", None) is not None:
            for p in module.parameters(recurse=False):
                assert p.device == module.hfsplit_device == model.ctx.host, (p.device, module.hfsplit_device)
                found.append(p)
    return found


def _host_bytes(model) -> int:
    return sum(p.untyped_storage().nbytes() for p in _on_host(model))


def _held_bytes(model, optimizer) -> int:
    """Device bytes held through a step: the parameters (those in host RAM left out), AdamW's state, 4-bit states."""
    host = {id(p) for p in _on_host(model)}
    tensors = [p for p in model.parameters() if id(p) not in host]
    tensors += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    tensors += [t for p in model.parameters() for t in _quant_state(p)]
    storages = {}
    for t in tensors:
        for local in _locals(t):
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def _quant_state(p) -> list[torch.Tensor]:
    """The tensors a bitsandbytes 4-bit weight holds beside its packed bytes (absmax, codes, nested state)."""
    state = getattr(p, "quant_state", None)
    if state is None:
        return []
    nested = getattr(state, "state2", None)
    extra = [state.absmax, state.code, getattr(state, "offset", None)] + ([nested.absmax, nested.code] if nested else [])
    return [t for t in extra if isinstance(t, torch.Tensor)]


def _locals(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding `t`'s bytes (a DTensor's local piece)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if isinstance(t, DTensor):
        return [t._local_tensor]
    if is_traceable_wrapper_subclass(t):  # e.g. a functional collective's AsyncCollectiveTensor
        inner = getattr(t, "elem", None)
        return [inner] if isinstance(inner, torch.Tensor) else []
    return [t]


class LiveStorages(TorchDispatchMode):
    """Bytes of the real storages created while the mode is on and still alive, and their peak.

    A DTensor's op runs its local op outside this mode, so its result is counted through its local
    piece. Views and in-place results share an input's storage and count nothing. The host buffers of the
    activation offload are not the device's memory: created while `allocating_host_copy()`, they count nothing."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from hfsplit.apply.offload import allocating_host_copy

        out = func(*args, **(kwargs or {}))
        if allocating_host_copy():
            return out
        inputs = {local.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) for local in _locals(t)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for local in _locals(t):
                    storage = local.untyped_storage()
                    if storage.data_ptr() not in inputs and storage.nbytes():
                        self._track(storage)
        return out

    def _track(self, storage) -> None:
        key = id(storage)
        if key in self._seen:
            return
        self._seen.add(key)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, storage.nbytes())

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes


def pipeline_buffer_memory(*, checkpoint: str, seq_len: int, micro_batch_size: int, runs: list,
                           steps: int = 3) -> list:
    """For each (schedule, micro-batches[, checkpointing]) of `runs` on pp=2 LoRA (checkpointing on unless given): the plan's figure for this
    rank's stage, the peak of the second step and what is alive after each step, counted from before the first
    step (torch's receive buffers are made in the first step and reused after: `_train`'s tracker, started with
    the second, never sees them), the receive buffers the schedule's stages hold, and whether their storages are
    the same after the second and third steps."""
    from hfsplit.models.loss import causal_lm_loss
    from hfsplit.plan import rank_total

    out = []
    for schedule, micro_batches, *ac in runs:  # (schedule, micro-batches[, activation checkpointing: default on])
        model, optimizer = _built(checkpoint, method="lora", tp=1, pp=2, seq_len=seq_len, ac=ac[0] if ac else True,
                                  micro_batch_size=micro_batch_size, micro_batches=micro_batches, schedule=schedule)
        ids = torch.randint(3, model.config.vocab_size, (micro_batch_size * micro_batches, seq_len),
                            generator=torch.Generator().manual_seed(0))
        loss_fn = causal_lm_loss(model.config.vocab_size)
        weights, live, peaks, alive, storages = _held_bytes(model, optimizer), LiveStorages(), [], [], []
        with live:
            for _ in range(steps):
                live.peak = live.live
                model.step(ids, ids, loss_fn)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                peaks.append(weights + live.peak)
                alive.append(weights + live.live)
                storages.append(_recv_buffers(model))
        mine = [model.plan.stages[i].memory for i in model.stage_indices]
        out.append({"schedule": model.plan.schedule, "micro_batches": micro_batches, "planned": rank_total(mine),
                    "measured": peaks[1], "alive": alive, "activation_buffers": storages[-1]["activation"],
                    "gradient_buffers": storages[-1]["gradient"], "reused": storages[1] == storages[2]})
        del model, optimizer
    return out


def receive_buffer_bytes(model) -> int:
    """Bytes of the receive buffers every schedule the model has built holds (training's, DPO's reference pass's):
    made in the first step that ran each, alive since, so a tracker started later never sees them."""
    found = {}
    for schedule in model._schedules.values():
        for kind in _recv_buffers(model, schedule).values():
            found.update(kind)
    return sum(found.values())


def _recv_buffers(model, schedule=None) -> dict:
    """{"activation" / "gradient": {storage address: bytes}} of the receive buffers the PipelineStages of
    `schedule` (default: the first built, the training schedule's) hold."""
    schedule = schedule if schedule is not None else next(iter(model._schedules.values()))
    found = {"activation": {}, "gradient": {}}
    for stage in getattr(schedule, "_stages", None) or [schedule._stage]:
        for kind, infos in (("activation", stage.args_recv_info), ("gradient", stage.grad_recv_info)):
            for info in (i for per_mb in infos.values() for i in per_mb):
                if not info.is_root_arg and info.buffer is not None:
                    storage = info.buffer.untyped_storage()
                    found[kind][storage.data_ptr()] = storage.nbytes()
    return found
