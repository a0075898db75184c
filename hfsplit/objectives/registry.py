"""The registered objectives, by their `--objective` name. Adding one: its module, its option fields in
`hfsplit.objectives.options`, its name here and its class in `registered`, its line in
`hfsplit.plan.OBJECTIVE_COUNTS` (what the planner counts), its tests.

The names and the option fields load without torch, so that the command line parses (and `hfsplit plan --help`
answers) before the objectives' modules do: those train (losses, rollouts, generation through transformers) and
load the first time `objective_of` is asked for one."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from hfsplit.errors import HfsplitError
from hfsplit.objectives.options import DpoOptions, DpoRules, GrpoOptions, GrpoRules
from hfsplit.training.option_fields import OptionRules

if TYPE_CHECKING:
    from hfsplit.training.objective import Objective

OBJECTIVES = ("sft", "dpo", "grpo")
# What each decides from the options alone (no torch); its Objective inherits these rules.
RULES = {"sft": OptionRules(), "dpo": DpoRules(), "grpo": GrpoRules()}


def objective_of(name: str) -> Objective:
    """The objective registered as `name`; one line naming the choices otherwise."""
    if name not in OBJECTIVES:
        raise HfsplitError(f"--objective {name!r}: choose {', '.join(OBJECTIVES)}")
    return registered()[name]


def option_rules_of(name: str) -> OptionRules:
    """What the objective registered as `name` decides from the options alone (its defaults, checks, packing), read
    without loading its module; one line naming the choices otherwise."""
    if name not in OBJECTIVES:
        raise HfsplitError(f"--objective {name!r}: choose {', '.join(OBJECTIVES)}")
    return RULES[name]


@functools.cache
def registered() -> dict[str, Objective]:
    """Every objective by its name, each module loaded on the first call."""
    from hfsplit.objectives.dpo import Dpo  # lazy: the command line parses its options without torch
    from hfsplit.objectives.grpo import Grpo  # lazy: the same (it generates through transformers)
    from hfsplit.objectives.sft import Sft  # lazy: the same

    objectives = {o.name: o for o in (Sft(), Dpo(), Grpo())}
    assert tuple(objectives) == OBJECTIVES, (tuple(objectives), OBJECTIVES)
    assert all(isinstance(objectives[n], type(RULES[n])) for n in OBJECTIVES)  # each inherits its own rules
    return objectives


def option_mixins() -> tuple[type, ...]:
    """The objectives' own option dataclasses, mixed into `FinetuneOptions`."""
    return (DpoOptions, GrpoOptions)
