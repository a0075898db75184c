"""What torch.distributed.pipelining's stages hold beside the activations the cost model traces.

A `PipelineStage` makes, when its schedule first runs, one receive buffer per micro-batch of the step
(`args_recv_info[mb]` on a stage after the first, `grad_recv_info[mb]` on a stage before the last when training),
one hidden state each, and keeps them for its lifetime: the schedule is cached per input shape, so they stay
between steps and are reused. A micro-batch in flight reads its activation buffer as its stage input, which the
first block's traced activations already count; the others are extra. The gradient buffers are all extra. And a
stage before the last keeps each micro-batch's output (torch's `fwd_cache`) until that micro-batch's backward:
nothing on the stage saves it, so the traced blocks do not count it either; a neighbour on the same rank (a V's
turn) takes it as its input instead, counted there.

Measured on CPU ranks (tests/parallel/test_apply.py::test_pipeline_buffers_reach_the_plan, pp=2 LoRA with
checkpointing, hidden 256 × seq 512 × 2 rows: 1 MiB a buffer): the first rank's peak grew by 1 MiB per
micro-batch under 1F1B and 2 MiB under GPipe, what stays alive between steps by 1 MiB per micro-batch on each
rank, the buffers' storages the same from step to step.

A neighbour on the same rank (a V's turn) is given the previous stage's output itself instead of a received copy,
but torch keeps it (and the gradient passed back) in the same per-micro-batch slots until the next step overwrites
it: measured under ZBVZeroBubble × 8, the rank holding the turn keeps 16 MiB more between steps than the other, so
the same counts apply there. Under Interleaved1F1B and ZBVZeroBubble the runs still exceed the plan (measured/planned
1.26-1.30 under Interleaved1F1B × 8 with checkpointing, 1.09-1.15 under ZBV × 8 without; 2.2-2.4 and 1.3-1.6 before
these buffers were counted). A likely cause, not modelled yet: torch's `_PipelineScheduleRuntime` waits its send
works only at the step's end (`while send_ops: ...` in schedules.py), which keeps each sent tensor that long.
"""
from __future__ import annotations


def pipeline_buffer_bytes(boundary: int, *, has_embed: bool, has_head: bool, in_flight: int, micro_batches: int,
                          training: bool, output_sent: bool = True) -> int:
    """Bytes a stage's PipelineStage holds at its peak beyond the traced activations of its `in_flight`
    micro-batches: the activation buffers of the micro-batches not in flight (a stage after the first), and when
    `training` the gradient buffers of all `micro_batches` and the kept outputs of those in flight (a stage before
    the last; the outputs only where `output_sent`, the next stage on another rank). `boundary`: one micro-batch's
    hidden state."""
    if not training:
        return 0
    held = 0 if has_embed else max(micro_batches - in_flight, 0)
    if not has_head:
        held += micro_batches + (in_flight if output_sent else 0)
    return held * boundary
