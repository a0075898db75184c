"""DPO's packed pairs (issue 23, `--packing on`): several pairs a row, a pair's chosen and rejected in one row, each
sequence isolated; the loss sums log-probs sequence by sequence."""
import math

import pytest
import torch

from hfsplit.checkpoint.synthetic import tiny_tokenizer
from hfsplit.errors import HfsplitError
from hfsplit.training.data import DatasetError
from hfsplit.training.batches import MicroBatches
from hfsplit.training.options import FinetuneOptions, packing_of
from hfsplit.training.packing import IGNORE_INDEX
from hfsplit.training.preference import (LN2, DpoLoss, dpo_loss, indexed_labels, local_keys, paired_rows,
                                         segment_logps, sequence_logps)
from tests.training.test_dpo import BUNDLED, bundled_rows


def packed_and_padded(count=12, seq_len=128):
    tok, rows = tiny_tokenizer(), bundled_rows()[:count]
    return (paired_rows(rows, tok, seq_len=seq_len, source=BUNDLED, packing=True, seed=3),
            paired_rows(rows, tok, seq_len=seq_len, source=BUNDLED))


def test_packing_on_is_accepted_for_dpo_and_auto_stays_padded():
    assert not packing_of(FinetuneOptions(objective="dpo"))
    assert not packing_of(FinetuneOptions(objective="dpo", packing="off"))
    assert packing_of(FinetuneOptions(objective="dpo", packing="on"))
    FinetuneOptions(objective="dpo", packing="on", micro_batch_size=1).validate()  # a packed row holds whole pairs
    with pytest.raises(HfsplitError, match="must be even .* or pass --packing on"):
        FinetuneOptions(objective="dpo", micro_batch_size=3).validate()


def test_each_pair_sits_in_one_row_chosen_then_rejected_as_its_padded_rows():
    packed, padded = packed_and_padded()
    assert len(packed) < len(padded) // 2 and packed.examples == len(padded) == 24
    for number in range(24):  # sequence 2i / 2i+1: pair i's chosen / rejected, the same tokens and labels as padded
        rows, where = (packed.sequences == number).nonzero(as_tuple=True)
        assert rows.unique().numel() == 1 and torch.equal(where, torch.arange(where[0], where[-1] + 1))
        assert (packed.sequences[rows[0]] == number ^ 1).any()  # its partner in the same row
        n = int(padded.lengths[number])
        assert torch.equal(packed.input_ids[rows[0], where], padded.input_ids[number, :n])
        assert torch.equal(packed.labels[rows[0], where], padded.labels[number, :n])
        assert torch.equal(packed.position_ids[rows[0], where], torch.arange(n))
    assert (packed.labels[packed.sequences < 0] == IGNORE_INDEX).all()
    batch = next(MicroBatches(packed, micro_batch_size=1, num_micro_batches=2, seed=0))
    assert torch.equal(batch["sequences"], packed.sequences[batch["index"]])


def test_a_pair_longer_than_a_row_is_refused_naming_the_row():
    rows = bundled_rows()[:3]
    rows[1] = {**rows[1], "chosen": " ".join([rows[1]["chosen"]] * 40)}
    with pytest.raises(DatasetError, match=r"prefs.jsonl row 1: prompt\+chosen and prompt\+rejected are \d+ tokens "
                                           "together, beyond --seq-len 64"):
        paired_rows(rows, tiny_tokenizer(), seq_len=64, source="prefs.jsonl", packing=True)


def isolating_model(folder):
    from transformers import AutoModelForCausalLM

    from hfsplit.load.materialize import isolate_packed_rows

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="sdpa")
    isolate_packed_rows(model)  # as hfsplit's stages run packed rows: under sdpa each example on its own
    return model.eval()


def test_a_packed_rows_sequence_log_probs_equal_each_sequence_alone(tiny_checkpoint):
    """Each sequence's summed response log-prob in a packed row (sdpa, example by example) equals the sequence run
    alone (its padded row) within 1e-5; the DPO loss over packed rows equals it over the padded rows."""
    from hfsplit.models import varlen

    packed, padded = packed_and_padded()
    model = isolating_model(tiny_checkpoint("llama"))
    calls = varlen.calls()
    with torch.no_grad():
        logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits
        alone = sequence_logps(model(input_ids=padded.input_ids).logits, padded.labels)
    assert varlen.calls() > calls  # the packed rows ran example by example
    present, keys = local_keys(packed.sequences)  # the sequences in the order the rows meet them: pairs adjacent
    assert sorted(present.tolist()) == list(range(24)) and (present[0::2] % 2 == 0).all()
    assert torch.equal(present[1::2], present[0::2] + 1)
    together = segment_logps(logits, packed.labels, keys)
    alone = alone[present]
    assert (together - alone).abs().max() <= 1e-5 * alone.abs().max()
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    reference = alone + torch.linspace(-1, 1, 24)  # any reference: the same pairs' loss whatever their layout
    padded_reference = torch.empty_like(reference)
    padded_reference[present] = reference  # by row
    expected = dpo_loss(model(input_ids=padded.input_ids).logits, padded.labels, padded_reference, beta=0.1)
    for loss_type in ("sigmoid", "ipo"):
        loss_fn = DpoLoss(beta=0.1, loss_type=loss_type)
        loss_fn.reference = reference
        halves = [loss_fn(logits[part], indexed_labels(packed.labels, keys)[part], num_items_in_batch=12)
                  for part in (slice(0, 3), slice(3, None))]  # two micro-batches of unequal pair counts
        want = expected if loss_type == "sigmoid" else dpo_loss(
            model(input_ids=padded.input_ids).logits, padded.labels, padded_reference, beta=0.1, loss_type="ipo")
        torch.testing.assert_close(sum(halves), want, rtol=1e-5, atol=1e-6)
        metrics = loss_fn.step_metrics(calls=2)
        assert metrics["pairs"] == 12


# Bundled pairs of 47-50 tokens together: at --seq-len 100 best-fit decreasing puts exactly two in each row, so
# every step holds the same number of pairs, which TRL's fixed gradient accumulation needs to compare step by step
# (the normaliser over unequal micro-batches is checked above).
EVEN_PAIRS = (0, 2, 4, 8, 10, 16, 18, 22, 24, 26, 28, 30)
STEPS, PAIRS_PER_STEP = 10, 4


def even_pairs_file(path) -> tuple[str, list[dict]]:
    import json

    rows = [bundled_rows()[i] for i in EVEN_PAIRS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path), rows


def packed_layout(options, rows: list[dict], *, steps: int, pairs_per_step: int) -> tuple[list[dict], list[dict]]:
    """(the preference rows in the order hfsplit's packed batches visit them: each step's rows' pairs, every step
    `pairs_per_step` of them; the pairs of the rows held out for --eval-every), as the run packs them (the same
    tokenizer, seq_len and seed) and holds out its first rows."""
    from hfsplit.training.preference import present_keys
    from hfsplit.training.run import split_eval_rows, tokenizer_for

    tokenizer = tokenizer_for(options, model_path=options.model)
    table = paired_rows(rows, tokenizer, seq_len=options.seq_len, source="pairs", packing=True, seed=options.seed)
    train, held = split_eval_rows(table, options)
    batches = MicroBatches(train, micro_batch_size=options.micro_batch_size, num_micro_batches=options.micro_batches,
                           seed=options.seed)
    order = []
    for _ in range(steps):
        pairs = present_keys(next(batches)["sequences"])[0::2] // 2
        assert len(pairs) == pairs_per_step
        order += [rows[int(p)] for p in pairs]
    return order, [] if held is None else [rows[int(p)] for p in present_keys(held.sequences)[0::2] // 2]


@pytest.mark.slow
def test_packed_dpo_at_pp2_equals_trl_lora_and_full_precomputed(tiny_checkpoint, tmp_path):
    """One launch of two ranks, 10-step DPO runs at pp=2 on packed pairs (two pairs a row, one row a micro-batch,
    two micro-batches a step): LoRA (the adapters-off reference) and full fine-tuning (the precomputed reference,
    its table keyed by sequence), plus the full run resumed from step 5 in another folder (its table recomputed,
    the sampler's rows found by their sequences), LoRA evaluating every 5 steps on its first 2 packed rows, and LoRA
    under Interleaved1F1B (two stages a rank: the reference relayed over the step's rows), and full fine-tuning
    evaluating every 5 steps (the held-out rows' reference precomputed, keyed by sequence).
    Per-step losses and rewards (and eval_loss, eval_rewards/...) equal TRL's DPOTrainer on the same pairs in the
    same order (each pair a padded batch of its own) within rel 1e-4."""
    from tests.parallel.launcher import launch
    from tests.training.test_dpo import assert_equals_trl, metrics_records

    dataset, rows = even_pairs_file(tmp_path / "pairs.jsonl")
    common = dict(model=str(tiny_checkpoint("llama")), objective="dpo", dataset=dataset, packing="on", seq_len=100,
                  micro_batch_size=1, micro_batches=2, pp=2, schedule="1F1B", max_steps=STEPS, warmup_steps=2,
                  dtype="float32", max_memory="2x1GiB")
    lora = dict(common, method="lora", lora_dropout=0.0, learning_rate=5e-3, output_dir=str(tmp_path / "lora"))
    full = dict(common, method="full", learning_rate=1e-4, save_every=5, output_dir=str(tmp_path / "full"))
    resumed = dict(full, resume=str(tmp_path / "full" / "checkpoint-5"), output_dir=str(tmp_path / "resumed"))
    evaluated = dict(lora, eval_every=5, output_dir=str(tmp_path / "eval"))  # 2 rows (4 pairs) held out
    looped = dict(lora, schedule="Interleaved1F1B", output_dir=str(tmp_path / "interleaved"))  # the relayed reference
    full_eval = dict(full, eval_every=5, save_every=None, output_dir=str(tmp_path / "full-eval"))
    results = launch("tests.training.cases:finetune_losses", world_size=2,
                     kwargs={"runs": [lora, full, resumed, evaluated, looped, full_eval]}, timeout_s=900)
    assert results[0] == results[1]
    lora_losses, full_losses, resumed_losses, eval_losses, looped_losses, full_eval_losses = results[0]
    (plan,) = metrics_records(lora["output_dir"], has="plan")
    assert plan["plan"]["pp"] == 2
    # measured worst relative: loss 5.4e-7 (LoRA, Interleaved1F1B too), 4.3e-7 (full), 6.2e-7 / 3.6e-7 (LoRA / full
    # evaluating; eval_loss 5.2e-7 / 3.5e-7); logps 1.4e-7; rewards within the 1e-6 absolute floor (beta ×
    # differences of near-equal log-probs)
    worst = assert_equals_trl(lora, lora_losses, rows=rows, pairs_per_step=PAIRS_PER_STEP, layout=packed_layout)
    assert lora_losses[-1] < lora_losses[0]
    worst_eval = assert_equals_trl(evaluated, eval_losses, rows=rows, pairs_per_step=PAIRS_PER_STEP,
                                   layout=packed_layout)
    (plan,) = metrics_records(looped["output_dir"], has="plan")
    assert plan["plan"]["schedule"] == "Interleaved1F1B"
    worst_looped = assert_equals_trl(looped, looped_losses, rows=rows, pairs_per_step=PAIRS_PER_STEP,
                                     layout=packed_layout)
    worst_full = assert_full_equals_trl(full, full_losses, rows=rows)
    worst_full_eval = assert_full_equals_trl(full_eval, full_eval_losses, rows=rows)
    torch.testing.assert_close(torch.tensor(resumed_losses), torch.tensor(full_losses[5:]), rtol=1e-5, atol=0)
    print("packed LoRA worst rel vs TRL:", {k: f"{v:.1e}" for k, v in worst.items()})
    print("packed full worst rel vs TRL:", {k: f"{v:.1e}" for k, v in worst_full.items()})
    print("packed LoRA with eval worst rel vs TRL:", {k: f"{v:.1e}" for k, v in worst_eval.items()})
    print("packed LoRA Interleaved1F1B worst rel vs TRL:", {k: f"{v:.1e}" for k, v in worst_looped.items()})
    print("packed full with eval worst rel vs TRL:", {k: f"{v:.1e}" for k, v in worst_full_eval.items()})


def assert_full_equals_trl(run: dict, losses: list[float], *, rows: list[dict]) -> dict[str, float]:
    """Full fine-tuning packed DPO `run` against TRL's DPOTrainer with `precompute_ref_log_probs=True` on the same
    pairs in the same order (with --eval-every: its held-out packed rows' pairs, their reference precomputed
    too): losses, rewards and eval figures within rel 1e-4 (rewards + 1e-6 absolute). The worst relative diffs."""
    from hfsplit.training.options import tiny_demo_options
    from tests.training.test_dpo import metrics_records
    from tests.training.test_dpo_precomputed import REWARDS, trl_full_dpo

    options = tiny_demo_options(**run)
    pairs, held = packed_layout(options, rows, steps=STEPS, pairs_per_step=PAIRS_PER_STEP)
    logs, _, _ = trl_full_dpo(options, pairs, steps=STEPS, pairs_per_step=PAIRS_PER_STEP, eval_pairs=held)
    evals, logs = [h for h in logs if "eval_loss" in h], [h for h in logs if "eval_loss" not in h]
    figures = [(metrics_records(run["output_dir"]), logs, ("loss", *REWARDS), {"loss": losses})]
    if held:
        figures.append((metrics_records(run["output_dir"], has="eval_loss"), evals,
                        ("eval_loss", *(f"eval_{k}" for k in REWARDS)), {}))
        assert len(evals) == STEPS // options.eval_every
    worst = {}
    for records, theirs_records, keys, given in figures:
        assert len(records) == len(theirs_records)
        for key in keys:
            mine = torch.tensor(given.get(key) or [float(r[key]) for r in records], dtype=torch.float64)
            theirs = torch.tensor([float(r[key]) for r in theirs_records], dtype=torch.float64)
            worst[key] = float(((mine - theirs).abs() / theirs.abs().clamp(min=1e-12)).max())
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=0 if "loss" in key else 1e-6, msg=key)
    return worst


@pytest.mark.slow
def test_packed_dpo_pp2_by_dp2_equals_pp2_on_the_same_global_batches(tiny_checkpoint, tmp_path):
    """All 32 bundled pairs packed into rows of 128 (one to four pairs a row): pp=2 × dp=2 (four ranks, two rows a
    replica) and pp=2 (two ranks, four rows) train on the same global batches, whose replicas hold unequal
    numbers of pairs; the loss (the global batch's pair mean) and the metrics (its pair means) are the same, LoRA
    and full fine-tuning with the precomputed reference alike (rel 1e-5)."""
    from hfsplit.training.options import tiny_demo_options
    from hfsplit.training.preference import pairs_of
    from hfsplit.training.run import tokenizer_for
    from tests.parallel.launcher import launch
    from tests.training.test_dpo import LOGGED, metrics_records

    common = dict(model=str(tiny_checkpoint("llama")), objective="dpo", packing="on", seq_len=128, micro_batch_size=1,
                  pp=2, tp=1, schedule="1F1B", max_steps=6, warmup_steps=2, dtype="float32")
    runs = {f"{method}-{name}": dict(common, method=method, lora_dropout=0.0,
                                     learning_rate=5e-3 if method == "lora" else 1e-4, micro_batches=m,
                                     max_memory=f"{ranks}x1GiB", output_dir=str(tmp_path / f"{method}-{name}"))
            for method in ("lora", "full") for name, m, ranks in (("dp1", 4, 2), ("dp2", 2, 4))}
    options = tiny_demo_options(**runs["lora-dp1"])
    table = paired_rows(bundled_rows(), tokenizer_for(options, model_path=options.model), seq_len=128, source=BUNDLED,
                        packing=True, seed=options.seed)
    batches = MicroBatches(table, micro_batch_size=1, num_micro_batches=4, seed=options.seed)
    halves = [[pairs_of(b["sequences"][:2]), pairs_of(b["sequences"][2:])] for b in (next(batches) for _ in range(6))]
    assert any(a != b for a, b in halves), halves  # the replicas' pair counts differ
    dp1 = launch("tests.training.cases:finetune_losses", world_size=2,
                 kwargs={"runs": [runs["lora-dp1"], runs["full-dp1"]]}, timeout_s=600)
    dp2 = launch("tests.training.cases:finetune_losses", world_size=4,
                 kwargs={"runs": [runs["lora-dp2"], runs["full-dp2"]]}, timeout_s=600)
    assert all(r == dp2[0] for r in dp2)
    for method, one, two in zip(("lora", "full"), dp1[0], dp2[0]):
        assert math.isclose(one[0], LN2, rel_tol=1e-6) and math.isclose(two[0], LN2, rel_tol=1e-6)  # the reference
        print(method, "dp2 vs dp1 worst rel loss:", f"{max(abs(a - b) / abs(b) for a, b in zip(two, one)):.1e}")
        torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-5, atol=0, msg=method)
        records = [metrics_records(runs[f"{method}-{name}"]["output_dir"]) for name in ("dp1", "dp2")]
        for key in LOGGED:
            torch.testing.assert_close(*(torch.tensor([float(r[key]) for r in t]) for t in records[::-1]),
                                       rtol=1e-5, atol=1e-6, msg=f"{method} {key}")
        assert one[-1] < one[0], method


def test_a_micro_batch_with_half_a_pair_is_refused():
    packed, _ = packed_and_padded()
    logits = torch.zeros(*packed.labels.shape, 256)
    keys = local_keys(packed.sequences)[1]
    for broken in (keys.where(keys != 0, -1), keys.where((keys != 0) & (keys != 23), -1)):  # 1..23, 1..22
        with pytest.raises(ValueError, match="whole chosen/rejected pairs"):
            dpo_loss(logits, packed.labels, torch.zeros(23), beta=0.1, keys=broken)
