"""Objectives as a seam (issue 31): each objective is one module behind one interface, registered by name; the
planner reads what it declares, the loop calls it, and neither names one."""
import ast
from pathlib import Path

import pytest

from hfsplit.cli.plan import main
from hfsplit.errors import HfsplitError
from hfsplit.objectives import OBJECTIVES, objective_of
from hfsplit.plan import OBJECTIVE_COUNTS, TrainingSpec
from hfsplit.training.objective import Objective
from hfsplit.training.options import FinetuneOptions, packing_of, training_spec

PACKAGE = Path(__file__).resolve().parents[2] / "hfsplit"
# the modules that run any objective: none compares against an objective's name
BLIND = [*sorted((PACKAGE / "planning").rglob("*.py")),
         *(PACKAGE / "training" / f"{m}.py" for m in ("trainer", "run", "options", "data", "checkpointer", "metrics",
                                                      "packing", "objective", "evaluation"))]


def test_every_registered_objective_declares_what_the_planner_counts():
    assert set(OBJECTIVES) <= set(OBJECTIVE_COUNTS)
    for name in OBJECTIVES:
        objective = objective_of(name)
        assert isinstance(objective, Objective) and objective.name == name
        assert objective.counts is OBJECTIVE_COUNTS[name] is TrainingSpec(objective=name).counts


@pytest.mark.parametrize("path", BLIND, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_planner_and_the_loop_never_name_an_objective(path):
    named = [node.lineno for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in OBJECTIVES
                                                      and c.value != "sft" for c in node.comparators)]
    assert not named, f"{path.name} compares with an objective's name at lines {named}"


def test_dpo_runs_with_the_default_options():
    """The issue's first try: `--objective dpo` on a real model with nothing else set stopped at "--micro-batch-size
    counts rows and must be even (got 1)". The objective's defaults hold where the user sets nothing."""
    options = FinetuneOptions(model="Qwen/Qwen2.5-0.5B", objective="dpo")
    options.validate()
    assert (options.micro_batch_size, options.beta, packing_of(options)) == (2, 0.1, False)
    assert FinetuneOptions(model="m", objective="dpo", packing="on").micro_batch_size == 1  # a packed row: whole pairs
    assert FinetuneOptions(model="m").micro_batch_size == 1 and FinetuneOptions(model="m").beta is None  # SFT's
    assert FinetuneOptions(model="m", objective="dpo", beta=0.5, micro_batch_size=4).micro_batch_size == 4
    spec = training_spec(options, gpu=True)
    assert (spec.objective, spec.reference, spec.micro_batch_size, spec.rows_per_example) == ("dpo", "adapters-off", 2, 2)
    with pytest.raises(HfsplitError, match="must be even"):  # a user's odd count is still refused by name
        FinetuneOptions(model="m", objective="dpo", micro_batch_size=3).validate()


def test_hfsplit_plan_objective_dpo_plans_with_the_default_options(capsys):
    assert main(["plan", "Qwen/Qwen2.5-0.5B", "--max-memory", "2x24GiB", "--objective", "dpo", "--seq-len", "256"]) == 0
    assert "DPO: 1 pair(s) a micro-batch" in capsys.readouterr().out


def test_an_unknown_objective_is_refused_by_name():
    with pytest.raises(HfsplitError, match="--objective 'ppo': choose sft"):
        FinetuneOptions(model="m", objective="ppo").validate()
    with pytest.raises(HfsplitError, match="choose sft"):
        objective_of("ppo")


@pytest.mark.slow
def test_dpo_trains_with_the_default_options_on_two_ranks(tiny_checkpoint, tmp_path):
    """`--objective dpo --model M` with nothing else set: one pair a micro-batch, the reference adapters-off (LoRA,
    the default method), the first loss ln 2."""
    import math

    from tests.parallel.launcher import launch

    run = dict(model=str(tiny_checkpoint("llama")), objective="dpo", seq_len=64, max_steps=2, max_memory="2x1GiB",
               output_dir=str(tmp_path / "dpo"))
    losses = launch("tests.objectives.grpo_cases:default_options_losses", world_size=2, kwargs={"options": run},
                    timeout_s=600)
    assert math.isclose(losses[0][0], math.log(2), rel_tol=1e-6) and len(losses[0]) == 2
