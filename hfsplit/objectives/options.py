"""The objectives' own options, declared without torch: the fields each objective adds to `FinetuneOptions` (mixed
in by `hfsplit.objectives.registry.option_mixins`), how the shared --reference reads, and what each objective decides
from the options alone (`OptionRules`: its defaults, its refusals, its packing; its `Objective` inherits them).
`hfsplit plan --help`, `python -m hfsplit.finetune --help` and a refused option answer before any objective's module
(losses, rollouts, generation: torch and transformers) loads."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from hfsplit.errors import HfsplitError
from hfsplit.training.option_fields import OptionRules, option

TRL_COMPLETION_LENGTH = 512  # GRPOConfig.max_completion_length's default (TRL 1.x)


@dataclass
class DpoOptions:
    """DPO's own options (beside the shared --beta and --reference)."""

    dpo_loss: Literal["sigmoid", "ipo"] = option(
        "sigmoid", "objective", "DPO: the loss on the log-ratio margin, by TRL's loss_type names")


@dataclass
class GrpoOptions:
    """GRPO's own options, by TRL's GRPOConfig names and defaults (beside the shared --beta and --reference)."""

    num_generations: int = option(8, "objective", "GRPO: completions generated per prompt; a step's rows are its "
                                  "prompts × this (rows per step must be a multiple of it)")
    reward_funcs: Optional[list[str]] = option(
        None, "objective", "GRPO: reward functions as module:function or path/to/file.py:function, with TRL's "
        "signature (prompts, completions, completion_ids, the dataset's other columns as keywords; one float a "
        "completion); unset: the bundled tiny task's")
    reward_weights: Optional[list[float]] = option(
        None, "objective", "GRPO: the reward functions' weights in the summed reward; unset: 1 each")
    max_completion_length: Optional[int] = option(
        None, "objective", f"GRPO: new tokens a completion; unset: {TRL_COMPLETION_LENGTH} (TRL's), at most half --seq-len")
    temperature: float = option(1.0, "objective", "GRPO: the sampling temperature (and the log-probs' logits / it)")
    top_p: float = option(1.0, "objective", "GRPO: nucleus sampling's probability mass (1: off)")
    top_k: int = option(0, "objective", "GRPO: sample among the k likeliest tokens (0: off)")
    epsilon: float = option(0.2, "objective", "GRPO: the clipping range of the probability ratio (its lower side)")
    epsilon_high: Optional[float] = option(None, "objective", "GRPO: the upper clipping range; unset: --epsilon")
    num_iterations: int = option(1, "objective", "GRPO: optimizer steps on each rollout (TRL's μ)")
    loss_type: Literal["dapo", "grpo", "bnpo", "dr_grpo"] = option(
        "dapo", "objective", "GRPO: how the token losses are averaged, by TRL's names: dapo (over all completion "
        "tokens of the step), grpo (each completion's mean, then their mean), bnpo (as dapo over one step's batch), "
        "dr_grpo (the token sum over completions × --max-completion-length)")
    scale_rewards: Literal["group", "batch", "none"] = option(
        "group", "objective", "GRPO: divide advantages by the group's reward std (group), the batch's (batch), or not")


def reference_of(options) -> str:
    """The reference policy a run uses, where its objective has one: --reference, else adapters-off with adapters
    (the same stages, adapters disabled) and precomputed without (full fine-tuning)."""
    if options.reference is not None:
        return options.reference
    return "adapters-off" if options.method in ("lora", "qlora") else "precomputed"


class DpoRules(OptionRules):
    """`--objective dpo`'s options: one pair a micro-batch, its reference, pairs packed only when asked."""

    default_dataset = "tiny_preference.jsonl"

    def defaults(self, options) -> dict:
        # a padded pair is two rows of one micro-batch: one pair a micro-batch (a packed row holds whole pairs)
        return {"micro_batch_size": 1 if options.packing == "on" else 2, "beta": 0.1}

    def check_options(self, options) -> None:
        check_dpo_options(options)

    def packs(self, options) -> bool:
        return options.packing == "on"  # auto: a pair is two padded rows, as TRL lays them out

    def spec_fields(self, options) -> dict:
        return {"reference": reference_of(options)}


class GrpoRules(OptionRules):
    """`--objective grpo`'s options: a completion a row, a reference only with --beta."""

    default_dataset = "tiny_prompts.jsonl"

    def defaults(self, options) -> dict:
        out = {"micro_batch_size": 1, "beta": 0.0,
               "max_completion_length": min(TRL_COMPLETION_LENGTH, max(1, options.seq_len // 2))}
        if options.global_batch is None:  # a step trains whole groups: the pipeline's 4 × depth rarely divides them
            out["micro_batches"] = options.num_generations
        return out

    def check_options(self, options) -> None:
        check_grpo_options(options)

    def packs(self, options) -> bool:
        return False  # a completion a row (its prompt before it)

    def spec_fields(self, options) -> dict:
        return {"reference": "adapters-off" if options.beta else None,
                "rollout_tokens": options.max_completion_length}


def check_dpo_options(options) -> None:
    """One line when the DPO options contradict each other or the method."""
    _check_beta(options, zero=False)
    if options.reference == "adapters-off" and options.method not in ("lora", "qlora"):
        raise HfsplitError("--reference adapters-off disables LoRA adapters, and --method full has none; "
                           "use --reference precomputed (or leave it unset)")
    if options.micro_batch_size % 2 and options.packing != "on":  # a packed row holds whole pairs
        raise HfsplitError(f"--objective dpo puts each pair's chosen and rejected rows in one micro-batch: "
                           f"--micro-batch-size counts rows and must be even (got {options.micro_batch_size}), "
                           "or pass --packing on (a packed row holds whole pairs)")
    if options.chunked_loss is True and options.packing == "on":  # the chunked head sums log-probs by row
        raise HfsplitError("--objective dpo --chunked-loss sums each row's log-probs, and a packed row holds several "
                           "sequences: drop --chunked-loss or --packing on")


def _check_beta(options, *, zero: bool) -> None:
    """--beta a finite number above 0 (at least 0 where `zero`: GRPO's beta 0 means no reference)."""
    beta = options.beta
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not (0 <= beta if zero else 0 < beta) \
            or not beta < math.inf:
        raise HfsplitError(f"--beta must be a finite number {'at least' if zero else 'above'} 0 (got {beta!r})")


def check_grpo_options(options) -> None:
    """One line when the GRPO options contradict each other or the method."""
    _check_beta(options, zero=True)
    if options.beta and options.method == "full":
        raise HfsplitError("--objective grpo --beta > 0 pulls towards a reference policy: the same stages with their "
                           "LoRA adapters off; --method full has none (it would hold a second model): use --method "
                           "lora or --beta 0")
    if options.reference == "precomputed":
        raise HfsplitError("--objective grpo scores new completions every step: a precomputed reference cannot "
                           "hold them; leave --reference unset")
    if options.num_generations < 2:
        raise HfsplitError(f"--num-generations must be at least 2: the advantages compare a prompt's completions "
                           f"(got {options.num_generations})")
    for name in ("max_completion_length", "num_iterations"):
        if getattr(options, name) < 1:
            raise HfsplitError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(options, name)})")
    if not options.epsilon > 0 or (options.epsilon_high is not None and not options.epsilon_high > 0):
        raise HfsplitError("--epsilon and --epsilon-high must be above 0")
    if options.temperature <= 0:
        raise HfsplitError(f"--temperature must be above 0 (got {options.temperature}): GRPO samples")
    if options.packing == "on" or options.chunked_loss is True:
        raise HfsplitError("--objective grpo trains one completion a row on full logits: drop --packing on and "
                           "--chunked-loss")
    if options.eval_every:
        raise HfsplitError("--eval-every under --objective grpo is not supported yet (TRL's evaluation generates "
                           "and scores held-out prompts): drop --eval-every")
    if options.max_completion_length >= options.seq_len:
        raise HfsplitError(f"--seq-len {options.seq_len} holds a prompt and its completion: raise it above "
                           f"--max-completion-length {options.max_completion_length}")
