"""What an objective's generation costs (GRPO's rollouts, issue 31), beside the update the cost model traces.

An objective that declares `generation` (`hfsplit.plan.ObjectiveCounts`) generates each step's rows before it
trains on them: one replica's rows (`micro_batch_size` × its micro-batches) are sampled on its stages, each up to
`seq_len` positions (prompt and `rollout_tokens` new ones). The plan counts it as split generation runs it
(issue 31 item 2: every stage keeps its layers' KV cache of every sequence, the micro-batches flowing together):

- memory, a phase of its own before the update (its peak against the update's, not beside it): each stage's KV
  cache of its layers for all the replica's rows (`kv_cache_bytes` per block and micro-batch), the prefill's block
  workspace, and on the last stage one decode step's logits of every row with their fp32 copy and sampling
  probabilities;
- time: the prompts' pass (prefill), a no-grad forward's share of the blocks' training compute on the prompt
  positions, run in chunks along the sequence so the stages work at once (`prefill_chunks_for`, as `generate`
  runs it); then a decode step a new token, each the compute of one position a row (the head's included: one
  position's logits a step) or, where the devices' memory bandwidth is known (a budget of GPU kinds), the time to
  read the stage's weights and KV cache, whichever is longer: a decode step of a few rows reads every weight for
  little arithmetic, so on GPUs it is bound by the bytes, not the FLOPs; and each new token's hidden states
  through every pipeline link once. Balanced for the update alone, the stage holding the head takes fewer blocks
  and the rollout waits on the others, so the split search also tries splits balanced for the rollout
  (`search.balanced_times`) and keeps the fastest step.
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


MIN_CHUNK = 64  # a prefill chunk's fewest positions: shorter ones would spend more on each pass than they overlap


def prefill_chunks_for(*, prompt_length: int, micro_batches: int, pp: int) -> int:
    """How many passes along the sequence generation runs the prompts in by default (`SplitModel.generate`'s
    `prefill_chunks`), as the plan counts them: enough that micro-batches × chunks is four times the pipeline ranks
    (a fill of at most a fifth of the prefill), none under `MIN_CHUNK` positions."""
    wanted = -(-4 * pp // max(1, micro_batches))
    return max(1, min(wanted, prompt_length // MIN_CHUNK))


def rollout_micro_batches(spec, micro_batches: int, pp: int) -> int:
    """Micro-batches generation cuts one replica's rollout rows into: one a pipeline rank (`SplitModel.generate`'s
    default, the fewest that keep every stage working: each more re-reads a stage's weights every step), at most one
    a row."""
    return max(1, min(rollout_rows(spec, micro_batches), pp))


def rollout_seconds(*, prefill_s: float, decode_step_s: float, spec, m: int, p: int, step_message_s: float) -> float:
    """Seconds of the step's rollout on one replica of `p` pipeline ranks whose update runs `m` micro-batches, from
    its slowest rank's `prefill_s` (the prompts of one of the update's micro-batches through its stages) and
    `decode_step_s` (a new token of one of generation's micro-batches, `rollout_micro_batches`:
    `hfsplit.planning.stage_costs`):
    - the prompts, cut into generation's micro-batches × chunks passes (`prefill_chunks_for`), fill the pipeline
      once: p − 1 passes idle;
    - each new token, every micro-batch through every rank, where a micro-batch's next token waits for its last
      one to come round: with fewer micro-batches than ranks, a rank idles while the others run theirs;
    - and each new token's hidden states over the pipeline links (`step_message_s`)."""
    if not spec.counts.generation:
        return 0.0
    cut = rollout_micro_batches(spec, m, p)
    passes = cut * prefill_chunks_for(prompt_length=spec.seq_len - spec.rollout_tokens, micro_batches=cut, pp=p)
    prefill = prefill_s * m * (passes + p - 1) / passes
    return prefill + spec.rollout_tokens * (decode_step_s * max(cut, p) + step_message_s)
