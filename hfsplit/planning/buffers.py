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
the same counts apply there.

Under Interleaved1F1B and ZBVZeroBubble (and every schedule with several stages a rank) torch runs the step in
its `_PipelineScheduleRuntime`, which waits its send works only at the step's end (`while send_ops: ...` in
schedules.py), and a gloo send work holds the tensor it sends. So every output a stage sent (a detached view of its
`fwd_cache` entry, freed by that micro-batch's backward otherwise) and every input gradient it sent back (popped
from `bwd_cache`, freed at once otherwise) stays alive until the step ends: all `micro_batches` of each, where
1F1B and GPipe wait each send by the next micro-batch. A V's turn passes both on the rank: nothing sent, nothing
held. Measured on the same pp=2 LoRA runs with torch's sends waited at once instead (a test-only patch), the peaks
fell by 16-19 MiB under Interleaved1F1B × 8 and 5-7 MiB under ZBV × 8, to measured/planned 0.96-0.99 and
1.04-1.08. Counted at each stage's peak as if the whole step's sends were held then (the rank peaks before its
last sends, so this is an upper bound), measured/planned is 0.94-0.97 under Interleaved1F1B × 8 with
checkpointing and 0.97-1.02 under ZBVZeroBubble × 8 without (1.26-1.30 and 1.09-1.15 before; 2.2-2.4 and 1.3-1.6
before the receive buffers were counted). The bound shows most where a rank peaks early in the step: hidden 128
(1/4 MiB a buffer), checkpointing on, Interleaved1F1B × 2 reads 0.97 / 0.87 (rank 0 / 1; 1.03 / 0.96 before) and
× 4 0.95 / 0.90 (1.08 / 1.08 before); ZBVZeroBubble × 4 without checkpointing 0.96 / 1.02 (1.01 / 1.09 before).
"""
from __future__ import annotations


def pipeline_buffer_bytes(boundary: int, *, has_embed: bool, has_head: bool, in_flight: int, micro_batches: int,
                          training: bool, output_sent: bool = True, gradient_sent: bool = False,
                          sends_held: bool = False) -> int:
    """Bytes a stage's PipelineStage holds at its peak beyond the traced activations of its `in_flight`
    micro-batches: the activation buffers of the micro-batches not in flight (a stage after the first), and when
    `training` the gradient buffers of all `micro_batches` and the kept outputs of those in flight (a stage before
    the last; the outputs only where `output_sent`, the next stage on another rank). Where `sends_held` (torch's
    multi-stage runtime), the outputs of all `micro_batches` and, where `gradient_sent` (the previous stage on
    another rank), their input gradients too. `boundary`: one micro-batch's hidden state."""
    if not training:
        return 0
    held = 0 if has_embed else max(micro_batches - in_flight, 0)
    # The runtime waits its sends at the step's end and each send work keeps its tensor: every micro-batch's sent
    # output outlives its backward, and every sent gradient is kept rather than freed once sent (see above).
    outputs = micro_batches if sends_held else in_flight
    if not has_head:
        held += micro_batches + (outputs if output_sent else 0)
    if sends_held and gradient_sent and not has_embed:
        held += micro_batches
    return held * boundary
