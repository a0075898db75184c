"""Reward functions for objectives that score their own completions (GRPO), as TRL takes them: plain Python
functions `f(prompts, completions, completion_ids, **columns) -> list[float | None]` given as `module:function`
(or `path/to/file.py:function`), several of them weighted; the rewards' group-normalised advantages and TRL's
reward figures; and the bundled tiny task's verifiable rewards (`hfsplit/training/bundled/tiny_prompts.jsonl`:
"a+b=" prompts with their `answer`).
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from hfsplit.errors import HfsplitError

BUNDLED_REWARDS = ("hfsplit.objectives.rewards:answer_correct", "hfsplit.objectives.rewards:digits_only")


def answer_correct(prompts, completions, answer, **kwargs) -> list[float]:
    """1 where the completion starts with the example's `answer` (spaces aside), else 0: the tiny task's check."""
    return [float(_text(c).strip().startswith(str(a))) for c, a in zip(completions, answer)]


def digits_only(prompts, completions, **kwargs) -> list[float]:
    """The share of the completion's non-space characters that are digits (0 for an empty one): a format reward
    that rises well before the answers are right."""
    shares = []
    for completion in completions:
        text = re.sub(r"\s", "", _text(completion))
        shares.append(sum(ch.isdigit() for ch in text) / len(text) if text else 0.0)
    return shares


def _text(completion) -> str:
    """A completion's text: itself, or its messages' contents joined (conversational)."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content") or "") for m in completion)


@dataclass
class RewardFunctions:
    """The run's reward functions, their names (TRL's: each function's `__name__`) and weights."""

    functions: tuple[Callable, ...]
    names: tuple[str, ...]
    weights: torch.Tensor

    def table(self, records: Sequence[dict], completions: Sequence, completion_ids: Sequence) -> torch.Tensor:
        """(completions, functions) rewards, NaN where a function returned None; each function gets the prompts,
        the completions, their token ids and every other column of the records as keyword lists."""
        columns = {key: [r[key] for r in records] for key in records[0] if key not in ("prompt", "completion")}
        prompts = [r["prompt"] for r in records]
        table = torch.zeros(len(records), len(self.functions), dtype=torch.float32)
        for i, (function, name) in enumerate(zip(self.functions, self.names)):
            values = function(prompts=prompts, completions=list(completions), completion_ids=list(completion_ids),
                              **columns)
            if len(values) != len(records):
                raise HfsplitError(f"reward function {name} returned {len(values)} rewards for {len(records)} "
                                   "completions: return one a completion")
            table[:, i] = torch.tensor([math.nan if v is None else float(v) for v in values])
        return table


def load_reward_functions(specs: Sequence[str], weights: Optional[Sequence[float]] = None) -> RewardFunctions:
    """The functions named `module:function` or `file.py:function`, with their weights (None: 1 each); one line
    naming what is missing otherwise."""
    functions = tuple(reward_function(s) for s in specs)
    if weights is not None and len(weights) != len(functions):
        raise HfsplitError(f"--reward-weights gives {len(weights)} weights for {len(functions)} reward functions: "
                           "give one a function")
    values = torch.tensor([float(w) for w in weights] if weights is not None else [1.0] * len(functions))
    return RewardFunctions(functions, tuple(f.__name__ for f in functions), values)


def reward_function(spec: str) -> Callable:
    """The function `spec` names: `package.module:function` (imported) or `path/to/file.py:function` (loaded)."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise HfsplitError(f"--reward-funcs {spec!r}: give module:function or path/to/file.py:function")
    try:
        if where.endswith(".py"):
            if not Path(where).is_file():
                raise HfsplitError(f"--reward-funcs {spec!r}: no file {where}")
            loaded = importlib.util.spec_from_file_location(Path(where).stem, where)
            module = importlib.util.module_from_spec(loaded)
            loaded.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ImportError as exc:
        raise HfsplitError(f"--reward-funcs {spec!r}: cannot import {where} ({exc})") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise HfsplitError(f"--reward-funcs {spec!r}: {where} has no function {name}")
    return function


def group_advantages(table: torch.Tensor, weights: torch.Tensor, *, groups: int, scale: str) -> torch.Tensor:
    """TRL's advantages ("sum_then_normalize"): each completion's weighted reward sum (NaN where every function
    returned None) less its group's mean, over the group's std (n − 1) + 1e-4 under `scale` "group", the batch's
    under "batch", not divided under "none"; 0 where unscorable. Each prompt's `groups` completions are adjacent."""
    rewards = weighted(table, weights)
    grouped = rewards.view(-1, groups)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(groups)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(groups)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def weighted(table: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each completion's weighted reward sum, NaN where every function returned None."""
    rewards = (table * weights[None]).nansum(dim=1)
    rewards[torch.isnan(table).all(dim=1)] = math.nan
    return rewards


def nanstd(values: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """The standard deviation (n − 1) of the non-NaN values, as TRL's `nanstd`."""
    mean = torch.nanmean(values, dim=dim, keepdim=dim is not None)
    count = (~torch.isnan(values)).sum(dim=dim) if dim is not None else (~torch.isnan(values)).sum()
    squares = torch.nansum((values - mean) ** 2, dim=dim) if dim is not None else torch.nansum((values - mean) ** 2)
    return torch.sqrt(squares / (count - 1))


def reward_metrics(table: torch.Tensor, rewards: RewardFunctions, *, groups: int) -> dict[str, float]:
    """TRL's reward figures of a generation batch: `rewards/<name>/mean` and `/std` per function, `reward` and
    `reward_std` of the weighted sums, `frac_reward_zero_std` (the groups whose rewards are all alike)."""
    out = {}
    for i, name in enumerate(rewards.names):
        out[f"rewards/{name}/mean"] = torch.nanmean(table[:, i]).item()
        out[f"rewards/{name}/std"] = nanstd(table[:, i]).item()
    summed = weighted(table, rewards.weights)
    std = nanstd(summed.view(-1, groups), dim=1)
    out.update({"reward": torch.nanmean(summed).item(), "reward_std": nanstd(summed).item(),
                "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean().item()})
    return out
