"""The objectives' own options, declared without torch: the fields each objective adds to `FinetuneOptions` (mixed
in by `hfsplit.objectives.registry.option_mixins`) and how the shared --reference reads. `hfsplit plan --help`
lists them before any objective's module (losses, rollouts, generation: torch and transformers) loads."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from hfsplit.training.option_fields import option


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
    max_completion_length: int = option(512, "objective", "GRPO: new tokens per completion at most")
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
