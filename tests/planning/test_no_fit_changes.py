"""The no-fit diagnosis agrees with make_plan (issue 30, item 2): its changes of size are planned with make_plan's own
search (the tiled MLP, the chunked loss, fewer micro-batches), so each one it offers make_plan accepts; its shorter
sequence is `--max-seq-len`'s answer; its closest split is planned with those knobs at their most frugal."""
import re
from dataclasses import replace

import pytest

from hfsplit.budget import format_bytes
from hfsplit.cli.plan import longest_plan
from hfsplit.errors import PlanError
from hfsplit.plan import TrainingSpec
from hfsplit.planning.max_seq import MULTIPLE
from hfsplit.planning.planner import make_plan

LLAMA_70B = "meta-llama/Llama-3.1-70B"
# the job: `hfsplit plan meta-llama/Llama-3.1-70B --max-memory 2xRTX4090 --qlora --lora-r 16 --seq-len 16384
# --headroom 0.03` fitted nothing; the diagnosis once offered --seq-len 4352 where --max-seq-len found 11264. With the
# embedding table in host RAM it fits now: held on the card (`--host-embedding off`), it still fits nothing.
SPEC = TrainingSpec(method="qlora", lora_r=16, seq_len=16384)
BUDGET, HEADROOM, ON_CARD = "2xRTX4090", 0.03, "off"


@pytest.fixture(scope="module")
def message() -> str:
    with pytest.raises(PlanError) as err:
        make_plan(LLAMA_70B, BUDGET, spec=SPEC, headroom=HEADROOM, host_embedding=ON_CARD)
    return str(err.value)


def _fits(budget, spec: TrainingSpec, **options) -> bool:
    try:
        make_plan(LLAMA_70B, budget, spec=spec, headroom=HEADROOM, explain=False, host_embedding=ON_CARD, **options)
    except PlanError:
        return False
    return True


def test_the_shorter_sequence_offered_is_max_seq_len_s_answer(message):
    seq = int(re.search(r"a shorter sequence \(--seq-len (\d+), the longest that fits", message).group(1))
    assert seq % MULTIPLE == 0 and seq < SPEC.seq_len
    assert _fits(BUDGET, replace(SPEC, seq_len=seq))
    assert not _fits(BUDGET, replace(SPEC, seq_len=seq + MULTIPLE))  # one granule more does not
    longest = longest_plan(make_plan, LLAMA_70B, BUDGET, {"spec": SPEC, "headroom": HEADROOM, "host_embedding": ON_CARD})
    assert longest.spec.seq_len == seq


def test_the_devices_and_the_budget_offered_plan(message):
    count = int(re.search(r"(\d+) devices \(add (\d+) × 24\.00 GiB\)", message).group(1))
    assert _fits(f"{count}xRTX4090", SPEC)
    assert not _fits(f"{count - 1}xRTX4090", SPEC)  # the fewest: one fewer does not fit
    size = re.search(r"2 devices of ([\d.]+) GiB each", message).group(1)
    assert _fits(f"2x{size}GiB", SPEC)


def test_the_closest_split_is_the_frugal_knobs_plan(message):
    """The closest split's figures are those of the plan with every knob make_plan turns at its most frugal (offload,
    8-bit moments, the tiled MLP, the chunked loss, one micro-batch under GPipe) on devices it fits."""
    assert ("closest split: pp=2 × tp=1, 1 micro-batch of 1 row (GPipe), activation checkpointing offload, adamw_8bit, "
            "MLP in 14 tiles, chunked loss on") in message
    frugal = make_plan(LLAMA_70B, "2x80GiB", spec=SPEC, pp=2, activation_checkpointing="offload", optim="adamw_8bit",
                       tiled_mlp="on", chunked_loss=True, micro_batches=1, schedule="GPipe",
                       host_embedding=ON_CARD)
    stages = re.findall(r"stage (\d+) on \d+: layers (\d+)-(\d+), needs ([\d.]+ [KMG]iB) of ([\d.]+ [KMG]iB)", message)
    assert [(int(i), int(a), int(b) + 1, need) for i, a, b, need, _ in stages] == \
        [(s.index, *s.layers, format_bytes(s.memory.total)) for s in frugal.stages]
    assert {of for *_, of in stages} == {format_bytes(int(24 * (1 << 30) * (1 - HEADROOM)))}  # the headroom's cap


def test_the_table_held_on_the_card_is_offered_in_host_ram_with_the_plan_make_plan_makes(message):
    """Held on the card (`--host-embedding off`), the table in host RAM is the change that fits at this length, with
    every other knob as make_plan turns it; its figures are make_plan's."""
    found = re.search(r"the first stage's embedding table in host RAM \(--host-embedding on\): ([\d.]+ GiB) / "
                      r"([\d.]+ GiB) per card", message)
    plan = make_plan(LLAMA_70B, BUDGET, spec=SPEC, headroom=HEADROOM, host_embedding="on")
    assert plan.stages[0].host_embedding and found is not None, message
    assert list(found.groups()) == [format_bytes(s.memory.total) for s in plan.stages]
