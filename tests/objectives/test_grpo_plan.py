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
from hfsplit.planning.search import plan_of_split, stage_slots
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
    """On GPU kinds (their memory bandwidth known) a decode step reads the stage's weights for a position a row, so
    in the same sequence length a new token costs more than a prompt's position."""
    options = dict(pp=2, micro_batches=MICRO, schedule="1F1B", optim="adamw_torch")
    grpo, longer, sft = (make_plan(MODEL, "2xRTX4090", spec=s, **options)
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


def test_a_generating_step_is_split_for_its_rollout_and_update_together():
    """The head weighs on every position of the update but on the new ones only in the rollout, so the split
    balanced for the update leaves the rollout waiting on rank 0; the plan is the fastest step of every cut."""
    spec = replace(GRPO, seq_len=2048)
    plan = make_plan(MODEL, "2x24GiB", spec=spec, pp=2, micro_batches=MICRO, schedule="1F1B", optim="adamw_torch")
    sft = make_plan(MODEL, "2x24GiB", spec=replace(spec, objective="sft", rollout_tokens=0), pp=2,
                    micro_batches=MICRO, schedule="1F1B", optim="adamw_torch")
    costs = model_costs(load_config(MODEL), plan.spec)
    slots = stage_slots([("0",), ("1",)], {"0": 24 << 30, "1": 24 << 30}, {}, p=2, d=1, v=1, m=MICRO,
                        schedule="1F1B")
    steps = {first: plan_of_split(costs, slots, [first, 24 - first], name=MODEL, config=load_config(MODEL), t=1, p=2,
                                  d=1, v=1, m=MICRO, schedule="1F1B").step_time_s for first in range(1, 24)}
    cut = plan.stages[0].layers[1]
    assert cut < sft.stages[0].layers[1]  # more blocks beside the head than the update alone gives it
    assert plan.step_time_s == pytest.approx(steps[cut], rel=1e-9) == pytest.approx(min(steps.values()), rel=1e-9)
    assert steps[sft.stages[0].layers[1]] > plan.step_time_s


def test_an_inference_plan_for_generating_counts_the_head_on_the_new_positions_only(tmp_path):
    """`generate` runs the head on one position a step: a plan for generating 32 tokens after 512-token prompts
    splits the layers evenly, where one scoring every position gives the head's stage fewer (the generation bench's
    model, docs/benchmarks/generate.md)."""
    from transformers import LlamaConfig
    LlamaConfig(num_hidden_layers=8, hidden_size=768, num_attention_heads=12, num_key_value_heads=4,
                intermediate_size=2048, vocab_size=16000).save_pretrained(tmp_path)
    forward = TrainingSpec(method="inference", dtype="float32", seq_len=544, micro_batch_size=16, reserve_bytes=0)
    options = dict(pp=2, tp=1, dp=1, schedule="GPipe", gpus=False)
    scoring = make_plan(str(tmp_path), "2x8GiB", spec=forward, **options)
    generating = make_plan(str(tmp_path), "2x8GiB", spec=replace(forward, rollout_tokens=32), **options)
    assert [s.layers for s in scoring.stages] == [(0, 5), (5, 8)]
    assert [s.layers for s in generating.stages] == [(0, 4), (4, 8)]
    first, last = (s.time_s for s in generating.stages)
    assert first < last < 1.05 * first  # four blocks each, the head's 32 positions of 544 little beside them


def test_a_decode_step_reads_its_weights_at_the_kinds_memory_bandwidth():
    """A decode step of two rows is bound by the bytes it reads (the stage's weights and KV cache) where the
    device's bandwidth is known; without it, by its FLOPs (a position a row); a prompt's pass by its FLOPs."""
    from hfsplit.gpu_kinds import gpu_kind
    from hfsplit.planning.stage_costs import decode_step_s, prefill_s

    costs = model_costs(load_config(MODEL), GRPO)
    rtx = gpu_kind("RTX4090")
    bare = Slot(index=1, pp_rank=1, devices=(("1",),), budget=24 << 30, speed=1.0, in_flight=MICRO, has_embed=False,
                has_head=True, micro_batches=MICRO)
    known = replace(bare, memory_bandwidth=rtx.expected_memory_bandwidth)
    read = 12 * costs.block.param_bytes + costs.head.param_bytes + 12 * costs.kv_bytes * (SEQ - 128) / SEQ
    assert decode_step_s(costs, known, 12) == pytest.approx(read / rtx.expected_memory_bandwidth, rel=1e-9)
    assert decode_step_s(costs, bare, 12) < decode_step_s(costs, known, 12) / 10  # two rows: far from the ridge
    assert prefill_s(costs, known, 12) == prefill_s(costs, bare, 12) > 0


def test_the_rollout_fills_the_pipeline_once_with_the_prompts_chunks():
    """The prompts run in m × chunks passes (`prefill_chunks_for`, as `generate` runs them): p − 1 idle passes;
    each new token takes max(m, p) micro-batch steps on the slowest rank."""
    from hfsplit.planning.rollout import prefill_chunks_for, rollout_micro_batches, rollout_seconds

    assert prefill_chunks_for(prompt_length=512, micro_batches=2, pp=2) == 4
    assert prefill_chunks_for(prompt_length=100, micro_batches=2, pp=2) == 1  # no chunk under 64 positions
    assert prefill_chunks_for(prompt_length=512, micro_batches=8, pp=2) == 1
    spec = replace(GRPO, seq_len=768, rollout_tokens=256)
    seconds = rollout_seconds(prefill_s=1.0, decode_step_s=0.01, spec=spec, m=2, p=2, step_message_s=0.001)
    assert seconds == pytest.approx(1.0 * 2 * 9 / 8 + 256 * (0.01 * 2 + 0.001))
    # one row: one micro-batch, its prompt in 8 chunks, and each token its round trip through both ranks
    one = rollout_seconds(prefill_s=1.0, decode_step_s=0.01, spec=replace(spec, micro_batch_size=1), m=1, p=2,
                          step_message_s=0.0)
    assert one == pytest.approx(1.0 * 1 * 9 / 8 + 256 * 0.01 * 2)
    # 8 of the update's micro-batches of 2 rows: generation cuts the 16 rows in 2 (`rollout_micro_batches`)
    assert rollout_micro_batches(spec, 8, 2) == 2 and rollout_micro_batches(replace(spec, micro_batch_size=1), 1, 2) == 1
    eight = rollout_seconds(prefill_s=1.0, decode_step_s=0.01, spec=spec, m=8, p=2, step_message_s=0.0)
    assert eight == pytest.approx(1.0 * 8 * 9 / 8 + 256 * 0.01 * 2)
