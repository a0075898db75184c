"""The registered objectives, by their `--objective` name. Adding one: its module, a line here, its line in
`hfsplit.plan.OBJECTIVE_COUNTS` (what the planner counts), its tests."""
from __future__ import annotations

from hfsplit.errors import HfsplitError
from hfsplit.objectives.dpo import Dpo
from hfsplit.objectives.grpo import Grpo
from hfsplit.objectives.sft import Sft
from hfsplit.training.objective import Objective

OBJECTIVES: dict[str, Objective] = {o.name: o for o in (Sft(), Dpo(), Grpo())}


def objective_of(name: str) -> Objective:
    """The objective registered as `name`; one line naming the choices otherwise."""
    if name not in OBJECTIVES:
        raise HfsplitError(f"--objective {name!r}: choose {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


def option_mixins() -> tuple[type, ...]:
    """The objectives' own option dataclasses, mixed into `FinetuneOptions`."""
    return tuple(o.options for o in OBJECTIVES.values() if o.options is not None)
