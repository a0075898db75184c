"""Group relative policy optimisation (issue 31), with TRL's `GRPOTrainer` semantics and names.

Each step draws prompts (a "prompt" column, standard or conversational), generates `num_generations` completions of
each on the split stages (`hfsplit.objectives.rollout`), scores them with the reward functions (`module:function`,
TRL's signature, several, weighted), and turns the rewards into group-normalised advantages
((r − group mean) / (group std + 1e-4) under `scale_rewards="group"`). The update is the clipped policy-gradient
loss over the completion tokens, through the training pipeline: each completion is one row, prompt then completion,
the prompt's labels -100. `num_iterations` reuses a rollout for that many optimizer steps against the log-probs of
the policy that generated it; `beta` > 0 adds the KL to the reference (the same stages with their adapters off),
`loss_type` normalises as TRL's values do (default "dapo", TRL 1.16's: one token mean over the whole batch).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hfsplit.errors import HfsplitError
from hfsplit.models.loss import token_logps
from hfsplit.objectives.rewards import (BUNDLED_REWARDS, RewardFunctions, group_advantages, load_reward_functions,
                                        reward_metrics)
from hfsplit.objectives.options import GrpoRules
from hfsplit.objectives.rollout import generate
from hfsplit.training.data import DatasetError, load_examples, pad_id, rendered_chat
from hfsplit.training.batches import MicroBatches
from hfsplit.training.objective import Objective, StepRows, replica_rows
from hfsplit.training.packing import IGNORE_INDEX, TokenRows, padded_rows
from hfsplit.training.preference import adapters_disabled

LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")
TARGETS = ("labels", "old", "reference", "advantage", "weight")  # the channels of a GRPO target, in order
FIGURES = ("clip_ratio/high_mean", "clip_ratio/low_mean", "clip_ratio/region_mean", "entropy", "kl", "tokens")


@dataclass
class Rollout:
    """One generation batch, ready for the update: its rows (prompt + completion), each position's target channels
    (`TARGETS`, shifted: position i describes token i + 1) and its figures."""

    rows: TokenRows
    targets: torch.Tensor  # (rows, seq, len(TARGETS)) fp32
    metrics: dict[str, float]
    tokens: int  # completion tokens
    old: Optional[torch.Tensor] = None  # this rank's per-token log-probs of the first update (num_iterations > 1)


class Grpo(GrpoRules, Objective):
    """`--objective grpo`."""

    name = "grpo"
    def load_rows(self, options, tokenizer, *, source: str, packing: bool) -> TokenRows:
        return load_prompt_rows(source, tokenizer, seq_len=options.seq_len,
                                room=options.max_completion_length)

    def batches(self, options, rows, *, micro_batches: int):
        """Each step's prompts: the step's rows (`micro_batches` of --micro-batch-size) over --num-generations."""
        per_step = options.micro_batch_size * micro_batches
        if per_step % options.num_generations:
            raise HfsplitError(f"--objective grpo: a step trains {per_step} rows (--micro-batch-size "
                               f"{options.micro_batch_size} × {micro_batches} micro-batches over the replicas), not a "
                               f"multiple of --num-generations {options.num_generations}; make them divide")
        return prompt_batches(rows, prompts=per_step // options.num_generations, seed=options.seed)

    def loss(self, options, model):
        return GrpoLoss(options, model.config)

    def prepare(self, run, *, progress: bool) -> None:
        run.loss_fn.rewards = load_reward_functions(run.options.reward_funcs or BUNDLED_REWARDS,
                                                    run.options.reward_weights)
        run.loss_fn.eos = eos_ids(run.tokenizer, run.model.config)

    def step_rows(self, run, batch: dict) -> StepRows:
        loss = run.loss_fn
        if loss.rollout is None or run.scheduler.last_epoch % run.options.num_iterations == 0:
            loss.rollout = make_rollout(run, batch)
            loss.iteration = 0
        else:
            loss.iteration += 1
        rollout, mine = loss.rollout, replica_rows(run)
        targets = rollout.targets[mine].clone()
        if loss.iteration and rollout.old is not None:  # later iterations: the generating policy's log-probs
            targets[..., TARGETS.index("old")] = rollout.old
        loss.seen = []
        rows = rollout.rows
        return StepRows(rows.input_ids[mine], targets, rows.positions()[mine], divisor=1,
                        tokens=int(rows.real_tokens().sum()), trained_tokens=rollout.tokens,
                        positions=rows.input_ids.numel())

    def step_metrics(self, run) -> dict[str, float]:
        loss = run.loss_fn
        calls = run.rows_per_replica // run.options.micro_batch_size
        local = loss.step_figures(calls=calls, keep_old=loss.iteration == 0 and run.options.num_iterations > 1)
        if loss.iteration == 0 and run.options.num_iterations > 1 and "old" in local:
            loss.rollout.old = local.pop("old")
        sums = {k: run.model.reduce_loss(torch.tensor(float(local.get(k, 0.0)))) for k in FIGURES}  # collective
        tokens = max(sums.pop("tokens"), 1.0)
        figures = {name: value / tokens for name, value in sums.items()}
        if not run.options.beta:
            figures.pop("kl", None)
        return {**loss.rollout.metrics, **figures}

    def bar(self, metrics: dict) -> dict[str, str]:
        return {"reward": f"{metrics.get('reward', float('nan')):.3f}",
                "len": f"{metrics.get('completions/mean_length', float('nan')):.1f}"}



@dataclass(frozen=True)
class PromptRows(TokenRows):
    """The prompts, one a row (labels all -100), with each row's dataset record (its prompt and other columns,
    which the reward functions take) and its token ids unpadded."""

    records: tuple = ()
    prompt_ids: tuple = ()
    conversational: bool = False


def load_prompt_rows(source: str, tokenizer, *, seq_len: int, room: int) -> PromptRows:
    """The prompt dataset `source` (TRL's "prompt" column: text, or messages rendered by the chat template with the
    generation prompt), tokenized as TRL does; a prompt leaving fewer than `room` tokens of `seq_len` is refused by
    row."""
    dataset = load_examples(source)
    if "prompt" not in dataset.column_names:
        raise DatasetError(f"{source}: --objective grpo needs a prompt column (TRL's prompt-only format); found "
                           f"{', '.join(dataset.column_names)}")
    records = list(dataset)
    conversational = bool(records) and isinstance(records[0]["prompt"], list)
    ids = []
    for index, record in enumerate(records):
        text = rendered_chat(tokenizer, record["prompt"], add_generation_prompt=True) if conversational \
            else record["prompt"]
        ids.append(tokenizer(text, add_special_tokens=not conversational)["input_ids"])
        if len(ids[-1]) + room > seq_len:
            raise DatasetError(f"{source} row {index}: the prompt is {len(ids[-1])} tokens, and with "
                               f"--max-completion-length {room} beyond --seq-len {seq_len}; raise --seq-len")
    table = padded_rows([(p, [IGNORE_INDEX] * len(p)) for p in ids], seq_len=seq_len, pad=pad_id(tokenizer))
    return PromptRows(table.input_ids, table.labels, table.position_ids, table.lengths, examples=len(ids),
                      records=tuple(records), prompt_ids=tuple(tuple(p) for p in ids), conversational=conversational)


def prompt_batches(rows: PromptRows, *, prompts: int, seed: int):
    """Endless, resumable batches of `prompts` prompts a step (`MicroBatches` of one-row micro-batches)."""
    return MicroBatches(rows, micro_batch_size=1, num_micro_batches=prompts, seed=seed)


def make_rollout(run, batch: dict) -> Rollout:
    """Generate the step's completions (each data-parallel replica its share of the prompts, `rollout.generate`, every
    rank then holding all of them), score them on rank 0 (broadcast), and lay out the update's rows and targets; with
    beta > 0 the reference's log-probs of them."""
    options, rows, loss = run.options, run.batches.rows, run.loss_fn
    index = batch["index"].tolist()
    prompts = [list(rows.prompt_ids[i]) for i in index]
    completions = sample_completions(run, prompts, seed=options.seed * 100003 + run.scheduler.last_epoch)
    records = [rows.records[i] for i in index for _ in range(options.num_generations)]
    texts = run.tokenizer.batch_decode(completions, skip_special_tokens=True)
    if rows.conversational:
        texts = [[{"role": "assistant", "content": t}] for t in texts]
    table = scored(loss.rewards, records, texts, completions)
    advantages, metrics = group_advantages(table, loss.rewards.weights, groups=options.num_generations,
                                           scale=options.scale_rewards), \
        reward_metrics(table, loss.rewards, groups=options.num_generations)
    metrics.update(completion_metrics(completions, eos=loss.eos, limit=options.max_completion_length))
    grouped = [p for p in prompts for _ in range(options.num_generations)]
    update = padded_rows([(p + c, [IGNORE_INDEX] * len(p) + c) for p, c in zip(grouped, completions)],
                         seq_len=options.seq_len, pad=pad_id(run.tokenizer))
    targets = rollout_targets(update, advantages, loss_type=options.loss_type,
                              limit=options.max_completion_length)
    if options.beta:
        targets[..., TARGETS.index("reference")] = reference_logps(run, update)
    return Rollout(update, targets, metrics, tokens=sum(len(c) for c in completions))


def sample_completions(run, prompts: list[list[int]], *, seed: int) -> list[list[int]]:
    """`num_generations` sampled completions of each prompt (its sequences next to each other), each cut after its
    first end-of-sequence token (kept), as TRL keeps them."""
    options, loss = run.options, run.loss_fn
    pad = pad_id(run.tokenizer)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = generate(run.model, ids, attention_mask=mask, max_new_tokens=options.max_completion_length,
                       do_sample=True, temperature=options.temperature, top_k=options.top_k, top_p=options.top_p,
                       num_return_sequences=options.num_generations, eos_token_id=loss.eos.tolist(),
                       pad_token_id=pad, seed=seed)
    return [cut_at_eos(row, loss.eos) for row in out[:, width:].tolist()]


def eos_ids(tokenizer, config) -> torch.Tensor:
    """The end-of-sequence tokens generation stops at: the tokenizer's and the model config's."""
    ids = {getattr(tokenizer, "eos_token_id", None)}
    eos = getattr(config, "eos_token_id", None)
    ids |= set(eos) if isinstance(eos, (list, tuple)) else {eos}
    return torch.tensor(sorted(i for i in ids if i is not None), dtype=torch.long)


def cut_at_eos(tokens: list[int], eos: torch.Tensor) -> list[int]:
    """`tokens` up to and including the first end-of-sequence token."""
    for i, token in enumerate(tokens):
        if token in eos.tolist():
            return tokens[:i + 1]
    return tokens


def scored(rewards: RewardFunctions, records: list[dict], completions: list, completion_ids: list) -> torch.Tensor:
    """The rewards table (completions × functions) computed on global rank 0 and sent to every rank."""
    table = torch.zeros(len(records), len(rewards.functions), dtype=torch.float32)
    if not dist.is_initialized() or dist.get_rank() == 0:
        table = rewards.table(records, completions, completion_ids)
    if dist.is_initialized():
        dist.broadcast(table, src=0)
    return table


def completion_metrics(completions: list[list[int]], *, eos: torch.Tensor, limit: int) -> dict[str, float]:
    """TRL's completion-length figures: mean, min and max length (the EOS counted) and the share cut at the limit."""
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.float32)
    clipped = torch.tensor([not c or c[-1] not in eos.tolist() for c in completions], dtype=torch.float32)
    return {"completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(), "completions/clipped_ratio": clipped.mean().item()}


def rollout_targets(rows: TokenRows, advantages: torch.Tensor, *, loss_type: str, limit: int) -> torch.Tensor:
    """Each position's target channels (`TARGETS`), shifted as the loss reads them (position i: token i + 1): the
    label (-100 off the completions), the old log-prob (NaN: the current one, detached), the reference's (0), the
    row's advantage, and the token's weight in the loss, which makes `loss_type`'s average a plain weighted sum."""
    counted = (rows.labels != IGNORE_INDEX).float()
    lengths = counted.sum(-1, keepdim=True)
    weight = {"dapo": counted / counted.sum().clamp(min=1), "bnpo": counted / counted.sum().clamp(min=1),
              "grpo": counted / lengths.clamp(min=1) / len(rows),
              "dr_grpo": counted / (len(rows) * limit)}[loss_type]
    shift = (lambda t: F.pad(t, (0, 1))[..., 1:])  # noqa: E731  (token i's value onto position i - 1)
    labels = rows.labels.float()
    channels = {"labels": labels, "old": torch.full_like(labels, math.nan), "reference": torch.zeros_like(labels),
                "advantage": advantages[:, None].expand_as(labels).float(), "weight": shift(weight)}
    return torch.stack([channels[name] for name in TARGETS], dim=-1)


def reference_logps(run, rows: TokenRows) -> torch.Tensor:
    """The reference's per-token log-probs of `rows` (the stages with their adapters off, no gradients), shifted as
    the targets are; zeros off the last stage (only its targets are read)."""
    with torch.no_grad(), adapters_disabled(run.model.stages):
        logps = run.model.forward(rows.input_ids, position_ids=rows.positions(), reduce=run.loss_fn.token_logps,
                                  targets=rows.labels)
    return logps.float().cpu() if logps is not None else torch.zeros(rows.labels.shape)


class GrpoLoss:
    """The pipeline's loss for GRPO on the last stage: TRL's `_compute_loss` from a micro-batch's logits and its
    targets (`rollout_targets`), the token weights already holding the loss type's normalisation. Keeps each
    call's figures (KL, entropy, clipped ratios) for the step's metrics, and its log-probs for later iterations.
    `rewards`, `rollout` and `iteration`: the run's reward functions and current generation batch."""

    def __init__(self, options, config):
        self.beta, self.temperature = float(options.beta), float(options.temperature)
        self.low = float(options.epsilon)
        self.high = float(options.epsilon_high if options.epsilon_high is not None else options.epsilon)
        self.eos = eos_ids(None, config)
        self.rewards: Optional[RewardFunctions] = None
        self.rollout: Optional[Rollout] = None
        self.iteration = 0
        self.seen: list[dict] = []
        self.token_logps = self._token_logps  # one object: the forward's schedules are cached by it

    def _token_logps(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_logps(logits.float() / self.temperature, labels)

    def __call__(self, logits: torch.Tensor, target: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        target = target.to(logits.device)
        labels, old, ref, advantage, weight = target.unbind(-1)
        labels = labels.long()
        mask = (F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:] != IGNORE_INDEX).float()
        logps = self._token_logps(logits, labels)
        old = torch.where(torch.isnan(old), logps.detach(), old)
        ratio = torch.exp(logps - old)
        clipped = torch.clamp(ratio, 1 - self.low, 1 + self.high)
        per_token = -torch.min(ratio * advantage, clipped * advantage)
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        if self.beta:
            per_token = per_token + self.beta * kl * ratio  # TRL's use_bias_correction_kl
        self.seen.append(self._figures(logits, logps, ratio, advantage, kl * ratio, mask))
        return (torch.where(mask > 0, per_token, 0.0) * weight).sum()

    @torch.no_grad()
    def _figures(self, logits, logps, ratio, advantage, kl, mask) -> dict:
        """Token sums of the KL, the entropy and the clipped shares (TRL's `clip_ratio/*`) over `mask`."""
        probs = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        entropy = -(probs.exp() * probs).sum(-1)
        low = ((ratio < 1 - self.low) & (advantage < 0)).float()
        high = ((ratio > 1 + self.high) & (advantage > 0)).float()
        total = lambda t: float((t * mask).sum())  # noqa: E731
        return {"kl": total(kl), "entropy": total(entropy), "clip_ratio/low_mean": total(low),
                "clip_ratio/high_mean": total(high), "clip_ratio/region_mean": total(torch.maximum(low, high)),
                "tokens": float(mask.sum()), "old": logps.detach().float().cpu()}

    def step_figures(self, *, calls: int, keep_old: bool) -> dict:
        """The step's token sums over its last `calls` calls (its micro-batches), on this rank (empty off the last
        stage); with `keep_old` their log-probs joined (the rows of this replica, in order) under "old"."""
        seen, self.seen = self.seen[-calls:], []
        if not seen:
            return {}
        out = {name: sum(s[name] for s in seen) for name in seen[0] if name != "old"}
        if keep_old:
            out["old"] = torch.cat([s["old"] for s in seen])
        return out


