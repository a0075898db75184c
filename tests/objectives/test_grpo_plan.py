"""`hfsplit plan --objective grpo` counts the rollout as GRPO declares it (issue 31): each stage's KV cache of the
replica's rows for its layers, beside the update (a phase of its own: the larger of the two), and the rollout's
prefill and decode in the step's time."""
import json
from dataclasses import replace

import pytest

from hfsplit.checkpoint.resolve import load_config
from hfsplit.cli.plan import main
from hfsplit.plan import Plan, TrainingSpec
from hfsplit.planning.costs.model import model_costs
from hfsplit.planning.stage_costs import Slot, stage_memory
from hfsplit.planning.planner import make_plan
from hfsplit.planning.rollout import rollout_bytes

MODEL = "Qwen/Qwen2.5-0.5B"  # bundled config: 24 layers, 2 KV heads of 64
SEQ, ROWS, MICRO = 512, 2, 8
GRPO = TrainingSpec(method="lora", seq_len=SEQ, micro_batch_size=ROWS, dtype="bfloat16", activation_checkpointing=True,
                    reserve_bytes=0, objective="grpo", rollout_tokens=256)
SFT = replace(GRPO, objective="sft", rollout_tokens=0)


def test_a_stage_holds_the_kv_cache_of_every_rollout_row_for_its_layers():
    config = load_config(MODEL)
    grpo, sft = model_costs(config, GRPO), model_costs(config, SFT)
    kv = 2 * ROWS * SEQ * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 2
    assert grpo.kv_bytes == kv and sft.kv_bytes == 0
    assert rollout_bytes(grpo, 12, has_head=False, micro_batches=MICRO) == 12 * MICRO * kv + grpo.block.workspace_bytes
    # one stage (no pipeline buffers): the larger of the update's activations and the rollout's peak
    slot = Slot(index=0, pp_rank=0, devices=(("0",),), budget=80 << 30, speed=1.0, in_flight=MICRO, has_embed=True,
                has_head=True, micro_batches=MICRO)
    ours, theirs = stage_memory(grpo, slot, 24), stage_memory(sft, slot, 24)
    rollout = rollout_bytes(grpo, 24, has_head=True, micro_batches=MICRO)
    assert rollout > 24 * MICRO * kv
    assert ours.activations == max(theirs.activations, rollout) and (ours.weights, ours.optimizer) == \
        (theirs.weights, theirs.optimizer)


def test_the_rollout_is_in_the_step_and_grows_with_its_new_tokens():
    options = dict(pp=2, micro_batches=MICRO, schedule="1F1B", optim="adamw_torch")
    grpo, longer, sft = (make_plan(MODEL, "2x24GiB", spec=s, **options)
                         for s in (GRPO, replace(GRPO, rollout_tokens=512), SFT))
    assert sft.rollout_s == 0.0 and grpo.rollout_s > 0 and longer.rollout_s > grpo.rollout_s
    assert grpo.step_time_s == pytest.approx(sft.step_time_s + grpo.rollout_s, rel=1e-9)
    assert "GRPO: rollout of 16 sequences a replica × up to 256 new tokens" in grpo.table()
    again = Plan.from_json(grpo.to_json())
    assert (again.rollout_s, again.spec.rollout_tokens, again.spec.objective) == (grpo.rollout_s, 256, "grpo")


def test_hfsplit_plan_objective_grpo_plans_the_rollout(capsys):
    code = main(["plan", MODEL, "--max-memory", "2x24GiB", "--objective", "grpo", "--seq-len", str(SEQ),
                 "--max-completion-length", "256", "--num-generations", "4", "--micro-batch-size", "2",
                 "--micro-batches", "8", "--json"])
    assert code == 0
    plan = Plan.from_json(capsys.readouterr().out)
    assert plan.spec.objective == "grpo" and plan.spec.rollout_tokens == 256 and plan.rollout_s > 0
    assert plan.spec.reference is None  # beta 0, TRL's default: no reference pass
    assert main(["plan", MODEL, "--max-memory", "2x24GiB", "--objective", "grpo", "--beta", "0.04", "--seq-len",
                 str(SEQ), "--max-completion-length", "256", "--json"]) == 0
    beta = json.loads(capsys.readouterr().out)
    assert beta["spec"]["reference"] == "adapters-off" and beta["reference_s"] > 0
