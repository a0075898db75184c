"""The input embedding table in host RAM (`TrainingSpec.host_embedding`), planned on the meta device: offered only
where the table is frozen and untied, chosen only where the first stage fits no other way, its bytes off the
card and in the plan's host figures, its rows' host copy charged, and the flag an override."""
from dataclasses import replace

import pytest

from hfsplit.errors import PlanError
from hfsplit.plan import Plan, TrainingSpec
from hfsplit.planning.costs.model import model_costs
from hfsplit.planning.memory_choices import ladder
from hfsplit.planning.planner import make_plan

GiB = 1 << 30
LLAMA_70B = "meta-llama/Llama-3.1-70B"
AT_16K = TrainingSpec(method="qlora", lora_r=16, seq_len=16384)
TABLE_BYTES = 128256 * 8192 * 2  # Llama-3.1-70B's embedding table in bf16


def _tiny_config(**overrides):
    from transformers import LlamaConfig

    values = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=32000, max_position_embeddings=4096)
    return LlamaConfig(**{**values, **overrides})


def test_the_ladder_tries_each_choice_then_the_same_with_the_table_on_the_host():
    spec = TrainingSpec(method="lora")
    auto = ladder(spec, embedding_frozen=True)
    assert [c.host_embedding for c in auto] == [False, True] * (len(auto) // 2)
    assert auto[::2] == [replace(c, host_embedding=False) for c in auto[1::2]]
    assert all(c.host_embedding for c in ladder(spec, embedding_frozen=True, host_embedding="on"))
    assert not any(c.host_embedding for c in ladder(spec, embedding_frozen=True, host_embedding="off"))
    assert not any(c.host_embedding for c in ladder(spec, embedding_frozen=False))  # not offered: never chosen
    with pytest.raises(PlanError, match="--host-embedding on"):
        ladder(spec, embedding_frozen=False, host_embedding="on")


def test_the_table_leaves_the_card_for_host_ram_and_its_rows_cross_the_host_link():
    config = _tiny_config()
    spec = TrainingSpec(method="lora", seq_len=1024, dtype="float32")
    device, host = model_costs(config, spec), model_costs(config, replace(spec, host_embedding=True))
    table = 32000 * 64 * 4
    assert (device.embed.param_bytes, device.embed.host_bytes) == (table, 0)
    assert (host.embed.param_bytes, host.embed.host_bytes) == (0, table)
    assert host.embed.workspace_bytes == device.embed.workspace_bytes  # the looked-up rows still reach the device
    assert host.block == device.block and host.head == device.head


def test_70b_qlora_at_seq_16384_fits_two_rtx4090s_only_with_the_table_on_the_host():
    """Every other knob turned, both cards are 0.84 GiB over at 40 + 40 layers; with the 1.96 GiB table in host RAM
    the first card takes two more layers and both fit (23.04 / 23.25 GiB of 23.28)."""
    with pytest.raises(PlanError):
        make_plan(LLAMA_70B, "2xRTX4090", spec=AT_16K, headroom=0.03, host_embedding="off", explain=False)
    plan = make_plan(LLAMA_70B, "2xRTX4090", spec=AT_16K, headroom=0.03)
    first, last = plan.stages
    assert (first.host_embedding, last.host_embedding, plan.spec.host_embedding) == (True, False, True)
    assert (first.layers, last.layers) == ((0, 42), (42, 80))
    assert first.memory.host_weights == plan.host_weight_bytes == TABLE_BYTES and last.memory.host_weights == 0
    assert [round(s.memory.total / GiB, 2) for s in plan.stages] == [23.04, 23.25]
    assert "host_embedding" in [step.kind for step in plan.steps()]
    table = plan.table()
    assert "0-41+embed(host)" in table and "host RAM for the input embedding table: 1.96 GiB" in table
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.stages[0].host_embedding


def test_auto_keeps_the_table_on_the_card_where_it_fits_there():
    """Where every rank fits at the fastest choice nothing moves; `on` moves the first stage's table."""
    config, spec = _tiny_config(), TrainingSpec(method="lora", seq_len=256, dtype="float32", reserve_bytes=0)
    plan = make_plan(config, "2x1GiB", spec=spec, pp=2, gpus=False)
    on = make_plan(config, "2x1GiB", spec=spec, pp=2, gpus=False, host_embedding="on")
    assert not any(s.host_embedding for s in plan.stages) and plan.host_weight_bytes == 0
    assert [s.host_embedding for s in on.stages] == [True, False]
    assert (on.stages[0].memory.host_weights, on.stages[1].memory.host_weights) == (32000 * 64 * 4, 0)


SMALL_FIRST_CARD = {"0": "8MiB", "1": "64MiB"}  # the tiny model's 7.8 MiB table leaves the first card too little


@pytest.mark.parametrize("method, tied", [("full", False), ("lora", True)])
def test_a_trained_or_tied_table_stays_on_the_card(method, tied):
    """Full fine-tuning trains the table; a tied one is lm_head's too: neither is offered (where only the host table
    would make the first card fit, as it does untied under LoRA, nothing fits), and the flag is refused."""
    spec = TrainingSpec(method="lora", seq_len=256, dtype="float32", reserve_bytes=0)
    plan = make_plan(_tiny_config(), SMALL_FIRST_CARD, spec=spec, pp=2, gpus=False)
    assert [s.host_embedding for s in plan.stages] == [True, False]
    with pytest.raises(PlanError, match=r"changes that fit: the first stage's embedding table in host RAM "
                                        r"\(--host-embedding on\)"):  # held off, the diagnosis names it
        make_plan(_tiny_config(), SMALL_FIRST_CARD, spec=spec, pp=2, gpus=False, host_embedding="off")
    config, spec = _tiny_config(tie_word_embeddings=tied), replace(spec, method=method)
    with pytest.raises(PlanError, match="no split fits"):
        make_plan(config, SMALL_FIRST_CARD, spec=spec, pp=2, gpus=False, explain=False)
    with pytest.raises(PlanError, match="--host-embedding on"):
        make_plan(config, "2x1GiB", spec=spec, pp=2, gpus=False, host_embedding="on")
