"""DPO plans (issue 23): pairs as two rows of a micro-batch, the adapters-off reference's memory and time, a
precomputed reference's one-off pass and cached log-probs; the Plan stays data; the chunked DPO head against its
planned figure. No ranks: bundled configs, and one tiny model in one process."""
import json
from dataclasses import replace

import pytest
import torch

from hfsplit.checkpoint.resolve import load_config
from hfsplit.cli.plan import main
from hfsplit.plan import Plan, TrainingSpec
from hfsplit.planning.costs.model import model_costs
from hfsplit.planning.stage_costs import Slot, stage_memory
from hfsplit.planning.planner import make_plan
from hfsplit.planning.reference import reference_bytes

MODEL = "Qwen/Qwen2.5-0.5B"  # bundled config (hfsplit/configs): vocab 151936, hidden 896, 24 layers
SEQ, ROWS, MICRO = 256, 2, 4
DPO = TrainingSpec(method="lora", seq_len=SEQ, micro_batch_size=ROWS, dtype="bfloat16", activation_checkpointing=True,
                   reserve_bytes=0, objective="dpo", reference="adapters-off")
SFT = replace(DPO, objective="sft", reference=None)  # twice the pairs' count of rows: the same rows


def slot(*, head: bool, relay: bool = False) -> Slot:
    return Slot(index=int(head), pp_rank=int(head), devices=(("0",),), budget=24 << 30, speed=1.0,
                in_flight=1 if head else 2, has_embed=not head, has_head=head, micro_batches=MICRO, relay=relay)


def test_dpo_activations_are_sft_at_the_pairs_rows_plus_the_reference():
    """Each pair is two rows: a DPO micro-batch of one pair costs the blocks, masks and boundary of an SFT micro-batch
    of two rows. Beside them the reference (hand-counted here): stage 0 keeps each micro-batch's reference output (a
    hidden state, bf16) through the step; the last stage keeps one fp32 log-prob a row twice (torch's fwd_cache and the
    loss's copy), and its reference pass peaks at one micro-batch's logits, their fp32 copy and fp32 log-softmax
    beside the head's input (each micro-batch's logits reduced to its rows' log-probs as they leave the stage)."""
    config = load_config(MODEL)
    dpo, sft = model_costs(config, DPO), model_costs(config, SFT)
    assert dpo.block == sft.block and dpo.stage_inputs == sft.stage_inputs and dpo.embed == sft.embed
    hidden = ROWS * SEQ * config.hidden_size * 2
    logits = ROWS * SEQ * config.vocab_size * 2
    assert dpo.logits_bytes == logits and dpo.boundary_bytes == hidden
    first_dpo, first_sft = (stage_memory(c, slot(head=False), 12) for c in (dpo, sft))
    assert first_dpo.activations == first_sft.activations + MICRO * hidden
    assert (first_dpo.weights, first_dpo.optimizer) == (first_sft.weights, first_sft.optimizer)
    last_dpo = stage_memory(dpo, slot(head=True), 12)
    training = stage_memory(replace(dpo, spec=replace(DPO, objective="sft")), slot(head=True), 12).activations
    # the reference schedule's own receive buffers (one a micro-batch) beside the log-probs; the training
    # schedule's receive buffers of the micro-batches not in flight (planning/buffers.py) stay through both passes
    kept = 2 * 4 * MICRO * ROWS + MICRO * hidden
    buffers = (MICRO - 1) * hidden
    peak = logits * (1 + 2 + 2) + hidden  # one micro-batch's bf16 logits, their fp32 copy, the fp32 log-softmax
    assert last_dpo.activations == kept + buffers + max(training - buffers, peak)
    # the DPO head (each row's fp32 log-softmax for the metrics, then for the loss) is traced, not the CE loss's
    assert dpo.head.activation_bytes >= ROWS * SEQ * config.vocab_size * 4
    assert dpo.head != sft.head


@pytest.mark.parametrize("relay", [False, True])
def test_the_last_stages_reference_pass_holds_one_micro_batchs_logits_whatever_the_count(relay):
    """One stage a rank (GPipe): the last stage's reference figure is the same at 1, 8 and 32 micro-batches but for 8
    bytes a row (its log-probs) and a hidden state a micro-batch (its schedule's receive buffers), no logits more;
    the relay (several stages a rank) runs the step's rows at once: it grows by the logits of each micro-batch more."""
    costs = model_costs(load_config(MODEL), DPO)
    figures = {m: sum(reference_bytes(costs, has_embed=False, has_head=True, micro_batches=m, relay=relay))
               for m in (1, 8, 32)}
    if not relay:
        per_micro_batch = 8 * ROWS + costs.boundary_bytes
        assert [figures[m] - figures[1] for m in (8, 32)] == [per_micro_batch * 7, per_micro_batch * 31]
    else:
        assert figures[32] - figures[8] >= 24 * costs.logits_bytes * (1 + 2 + 2)


def test_a_dpo_plan_counts_the_reference_forward_in_each_step_and_says_so():
    options = dict(pp=2, micro_batches=MICRO, schedule="1F1B", activation_checkpointing="on", optim="adamw_torch")
    dpo, sft = (make_plan(MODEL, "2x24GiB", spec=s, **options) for s in (DPO, SFT))
    assert sft.reference_s == 0.0 and "DPO" not in sft.table()
    # a third more per stage: LoRA's training pass is about 3 forwards under checkpointing (forward, the input
    # gradients' backward, the recompute), the reference one more
    for d, s in zip(dpo.stages, sft.stages):
        if d.layers == s.layers and not d.has_head:
            assert d.time_s == pytest.approx(s.time_s * 4 / 3, rel=0.02)
    assert dpo.step_time_s > sft.step_time_s and dpo.reference_s > 0
    assert dpo.stages[-1].memory.total > sft.stages[-1].memory.total
    assert "DPO: 1 pair(s) a micro-batch" in dpo.table() and "reference adapters-off" in dpo.table()


def test_a_precomputed_reference_is_a_one_off_pass_and_eight_bytes_a_pair_on_the_last_stage():
    full = replace(DPO, method="full", reference="precomputed", reference_pairs=0)
    options = dict(pp=2, micro_batches=MICRO, schedule="1F1B", activation_checkpointing="on", optim="adamw_torch")
    none, many = (make_plan(MODEL, "2x80GiB", spec=replace(full, reference_pairs=n), **options) for n in (0, 10**6))
    assert [s.layers for s in none.stages] == [s.layers for s in many.stages]
    assert many.stages[-1].memory.activations - none.stages[-1].memory.activations == 8 * 10**6
    assert many.stages[0].memory == none.stages[0].memory
    sft = make_plan(MODEL, "2x80GiB", spec=replace(full, objective="sft", reference=None, reference_pairs=None),
                    **options)
    assert many.reference_s > 0 and many.step_time_s == pytest.approx(sft.step_time_s, rel=1e-9)  # not in the step
    assert "one-off no-grad pass" in many.table() and "for 1000000 pairs" in many.table()


def test_plan_json_round_trips_the_objective_and_an_older_plan_reads_as_sft():
    plan = make_plan(MODEL, "2x24GiB", spec=DPO, pp=2, micro_batches=MICRO, schedule="1F1B")
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert (again.spec.objective, again.spec.reference, again.reference_s) == ("dpo", "adapters-off", plan.reference_s)
    old = json.loads(make_plan(MODEL, "2x24GiB", spec=SFT, pp=2, micro_batches=MICRO, schedule="1F1B").to_json())
    for key in ("objective", "reference", "reference_pairs"):
        del old["spec"][key]
    del old["reference_s"]
    assert Plan.from_json(json.dumps(old)).spec.objective == "sft"


def test_hfsplit_plan_objective_dpo_plans_a_bundled_config(capsys):
    code = main(["plan", MODEL, "--max-memory", "2x24GiB", "--objective", "dpo", "--seq-len", str(SEQ),
                 "--micro-batch-size", "2", "--json"])
    assert code == 0
    plan = Plan.from_json(capsys.readouterr().out)
    assert plan.spec.objective == "dpo" and plan.spec.reference == "adapters-off" and plan.reference_s > 0
    assert main(["plan", MODEL, "--max-memory", "2x24GiB", "--objective", "dpo", "--micro-batch-size", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--micro-batch-size" in err[0] and "even" in err[0]


def test_hfsplit_plan_objective_dpo_packing_on_plans_full_rows_as_sft_packing(capsys):
    """`--packing on` under DPO: any micro-batch size (a packed row holds whole pairs); the blocks cost what SFT
    packing's do at the same rows (full rows, the varlen attention's per-example cost), and the table says so."""
    code = main(["plan", MODEL, "--max-memory", "2x24GiB", "--objective", "dpo", "--packing", "on", "--seq-len",
                 str(SEQ), "--micro-batch-size", "1", "--json"])
    assert code == 0
    plan = Plan.from_json(capsys.readouterr().out)
    assert plan.spec.objective == "dpo" and plan.spec.packing and plan.spec.micro_batch_size == 1
    assert plan.reference_s > 0 and "packed pairs, 1 full row(s) a micro-batch" in plan.table()
    config = load_config(MODEL)
    packed_dpo, packed_sft = (model_costs(config, replace(s, packing=True)) for s in (DPO, SFT))
    assert packed_dpo.block == packed_sft.block and packed_dpo.stage_inputs == packed_sft.stage_inputs
    assert packed_dpo.block != model_costs(config, DPO).block  # packing is counted, not ignored


def measured_head_peak(model, hidden: torch.Tensor, labels: torch.Tensor, *, chunked: bool) -> int:
    """Peak bytes of the storages DPO's head creates on the last stage, forward and backward (the final norm, lm_head,
    the loss), on the model's frozen norm and head: the full logits' log-probs or the chunked ones."""
    from functools import partial

    from hfsplit.models.loss import chunked_sequence_logps, dpo_head_loss
    from tests.parallel.apply_cases import LiveStorages

    norm, lm_head = model.model.norm, model.lm_head
    x = hidden.clone().requires_grad_()
    with LiveStorages() as live:  # the stage's output (logits, or the normed states) lives on to its backward, as
        out = norm(x) if chunked else lm_head(norm(x))  # the pipeline's schedule keeps it
        logps = partial(chunked_sequence_logps, head=lm_head, vocab_size=model.config.vocab_size)
        loss = dpo_head_loss(out, labels, **({"logps": logps} if chunked else {}))
        loss.backward()
        del out
    return live.peak


def test_chunked_dpo_head_keeps_its_plan_and_saves_the_logits(tiny_checkpoint):
    """The last stage's DPO head (final norm, lm_head, the pairs' loss) of a LoRA plan (frozen head) at a vocabulary
    large enough that its logits dominate (16384 × 256 tokens × 2 rows), measured in one process with and without
    `chunked_loss` against the planner's head figure (`model_costs(...).head`: activations + workspace) within
    ±15%; the chunked head holds under a fifth of the full one, as planned."""
    from transformers import AutoModelForCausalLM

    folder = tiny_checkpoint("llama", num_layers=1, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=16384)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).requires_grad_(False)
    spec = TrainingSpec(method="lora", seq_len=256, micro_batch_size=2, dtype="float32", lora_r=8, objective="dpo",
                        reference="adapters-off")
    hidden = torch.randn(2, 256, 64, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 16384, (2, 256), generator=torch.Generator().manual_seed(1))
    labels[:, :40] = -100  # the prompts
    figures = {}
    for chunked in (False, True):
        head = model_costs(load_config(folder), replace(spec, chunked_loss=chunked)).head
        planned = head.activation_bytes + head.workspace_bytes
        measured = measured_head_peak(model, hidden, labels, chunked=chunked)
        figures[chunked] = (planned, measured)
        print(f"DPO head, chunked {chunked}: planned {planned} measured {measured} ({measured / planned:.3f})")
    for chunked, (planned, measured) in figures.items():
        assert 0.85 <= measured / planned <= 1.15, (chunked, planned, measured)
    assert figures[True][1] < figures[False][1] / 5 and figures[True][0] < figures[False][0] / 5
