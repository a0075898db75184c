"""What an objective's generation costs (GRPO's rollouts, issue 31), beside the update the cost model traces.

An objective that declares `generation` (`hfsplit.plan.ObjectiveCounts`) generates each step's rows before it
trains on them: one replica's rows (`micro_batch_size` × its micro-batches) are sampled on its stages, each up to
`seq_len` positions (prompt and `rollout_tokens` new ones). The plan counts it as split generation runs it
(issue 31 item 2: every stage keeps its layers' KV cache of every sequence, the micro-batches flowing together):

- memory, a phase of its own before the update (its peak against the update's, not beside it): each stage's KV
  cache of its layers for all the replica's rows (`kv_cache_bytes` per block and micro-batch), the prefill's block
  workspace, and on the last stage one decode step's logits of every row with their fp32 copy and sampling
  probabilities;
- time: every position through the stages' blocks once, a no-grad forward's share of their training compute (the
  prompt's prefill, then a decode step a new token), the head on the new positions only (generation keeps one
  position's logits a step), and each new token's hidden states through every pipeline link once. Balanced for
  the update alone, the stage holding the head takes fewer blocks and the rollout waits on the others, so the
  split search also tries splits balanced for the rollout (`search.balanced_times`) and keeps the fastest step.
"""
from __future__ import annotations

FP32 = 4


def rollout_rows(spec, micro_batches: int) -> int:
    """Sequences one replica generates per step: its rows."""
    return spec.micro_batch_size * micro_batches if spec.counts.generation else 0


def rollout_bytes(costs, layers: int, *, has_head: bool, micro_batches: int) -> int:
    """Peak bytes the step's rollout takes on one rank of a stage of `layers` blocks (0 without generation)."""
    spec = costs.spec
    rows = rollout_rows(spec, micro_batches)
    if not rows:
        return 0
    kv = layers * costs.kv_bytes * micro_batches
    if not has_head:
        return kv + costs.block.workspace_bytes
    per_token = costs.logits_bytes // max(1, spec.micro_batch_size * spec.seq_len)  # one position's logits
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}.get(spec.dtype, 4)
    return kv + costs.block.workspace_bytes + rows * per_token * (1 + 2 * FP32 // itemsize)


def rollout_seconds(compute_s: float, *, spec, step_message_s: float) -> float:
    """Seconds of the step's rollout: `compute_s` of the stages' forwards (every position through the blocks once,
    the prompt's prefill and a decode step a new token, the head on the new positions only:
    `hfsplit.planning.stage_costs.generation_forward_s`), and each new token `step_message_s` of pipeline
    messages."""
    if not spec.counts.generation:
        return 0.0
    return compute_s + spec.rollout_tokens * step_message_s
