"""Rank-side measurement of torch.distributed.pipelining's receive buffers against the plan (started by
tests/parallel/launcher.py): the stage's peak in a steady-state step and what stays alive between steps, counted
from before the first step (the buffers are made in the first step and reused after, so a tracker started later
never sees them)."""
from __future__ import annotations

import torch

from tests.parallel.apply_cases import LiveStorages, _built, _held_bytes


def recv_buffers(schedule_obj) -> dict:
    """Bytes of the activation and gradient receive buffers a built schedule's stages hold."""
    stages = getattr(schedule_obj, "_stages", None) or [schedule_obj._stage]
    act = grad = 0
    ptrs = []
    for st in stages:
        for infos in st.args_recv_info.values():
            for i in infos:
                if not i.is_root_arg and i.buffer is not None:
                    act += i.buffer.untyped_storage().nbytes()
                    ptrs.append(i.buffer.untyped_storage().data_ptr())
        for infos in st.grad_recv_info.values():
            for i in infos:
                if i.buffer is not None:
                    grad += i.buffer.untyped_storage().nbytes()
                    ptrs.append(i.buffer.untyped_storage().data_ptr())
    return {"act": act, "grad": grad, "ptrs": ptrs}


def step_and_between(*, checkpoint: str, seq_len: int, micro_batch_size: int, micro_batches: int, schedule: str,
                     ac=True, method: str = "lora", steps: int = 3) -> dict:
    from hfsplit.models.loss import causal_lm_loss
    from hfsplit.plan import rank_total

    model, optimizer = _built(checkpoint, method=method, tp=1, pp=2, seq_len=seq_len, ac=ac,
                              micro_batch_size=micro_batch_size, micro_batches=micro_batches, schedule=schedule)
    ids = torch.randint(3, model.config.vocab_size, (micro_batch_size * micro_batches, seq_len),
                        generator=torch.Generator().manual_seed(0))
    loss_fn = causal_lm_loss(model.config.vocab_size)
    base = _held_bytes(model, optimizer)  # weights only (no AdamW state yet)
    live = LiveStorages()
    out = {"between": [], "peak": [], "old_peak": 0, "ptrs": []}
    with live:
        for step in range(steps):
            start = live.live
            held = _held_bytes(model, optimizer)
            live.peak = live.live
            model.step(ids, ids, loss_fn)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            out["peak"].append(base + live.peak)
            out["between"].append(base + live.live)
            if step == 1:
                out["old_peak"] = held + (live.peak - start)  # what apply_cases._train measures
            sched = next(iter(model._schedules.values()))
            out["ptrs"].append(recv_buffers(sched)["ptrs"])
    bufs = recv_buffers(next(iter(model._schedules.values())))
    mine = [model.plan.stages[i].memory for i in model.stage_indices]
    out.update(planned=rank_total(mine), planned_acts=sum(m.activations for m in mine),
               planned_state=sum(m.weights + m.gradients + m.optimizer for m in mine),
               act_bufs=bufs["act"], grad_bufs=bufs["grad"], schedule=model.plan.schedule,
               same_ptrs=out["ptrs"][1] == out["ptrs"][2], m=micro_batches)
    out.pop("ptrs")
    return out


def sweep(*, checkpoint: str, seq_len: int, micro_batch_size: int, runs: list, ac=True) -> list:
    return [step_and_between(checkpoint=checkpoint, seq_len=seq_len, micro_batch_size=micro_batch_size,
                             micro_batches=m, schedule=s, ac=ac) for s, m in runs]
