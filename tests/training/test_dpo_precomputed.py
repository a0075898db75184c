"""DPO with the precomputed reference (issue 23, `--reference precomputed`): the table of reference log-probs,
and full fine-tuning DPO against TRL's DPOTrainer (`precompute_ref_log_probs=True`) at pp=2 and pp=2 × dp=2,
with its saved model and an exact resume."""
import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hfsplit.checkpoint.synthetic import tiny_tokenizer
from hfsplit.plan import TrainingSpec
from hfsplit.training.batches import MicroBatches
from hfsplit.training.options import tiny_demo_options
from hfsplit.training.preference import LN2, paired_rows, sequence_logps
from hfsplit.training.reference import (HELD_OUT, REFERENCE_FILE, read_table, reference_fingerprint, visited_rows,
                                        write_table)
from tests.training.test_dpo import (BUNDLED, bundled_rows, held_out_pairs, hfsplit_pair_order, in_order_dpo_trainer,
                                     metrics_records, training_calls)

STEPS, PAIRS_PER_STEP = 10, 4


def pair_batches(seq_len=64, *, rows_per_step=8, seed=0):
    table = paired_rows(bundled_rows(), tiny_tokenizer(), seq_len=seq_len, source=BUNDLED)
    return MicroBatches(table, micro_batch_size=2, num_micro_batches=rows_per_step // 2, seed=seed, group=2)


def test_the_run_plans_with_the_pairs_its_precomputed_reference_caches(tiny_checkpoint):
    """Item 6 of issue 23: a precomputed reference's run hands the plan its pairs (`cached_pairs`: the data set's,
    held-out ones included, whose table is cached too), so the plan counts the cached log-probs exactly;
    adapters-off caches none."""
    from hfsplit.planning.planner import make_plan
    from hfsplit.training.options import plan_arguments, tiny_demo_options
    from hfsplit.training.run import cached_pairs, load_rows

    model = str(tiny_checkpoint("llama"))
    full = tiny_demo_options(model=model, objective="dpo", method="full", seq_len=64, micro_batch_size=2,
                             micro_batches=4, pp=2, dataset=BUNDLED)
    _, rows = load_rows(full, model_path=model)
    assert cached_pairs(full, rows) == len(bundled_rows()) == len(rows) // 2
    held = replace(full, method="lora", reference="precomputed", eval_every=5)
    assert cached_pairs(held, rows) == len(bundled_rows())  # the held-out pairs' table is cached beside
    assert cached_pairs(replace(full, method="lora"), rows) is None  # adapters-off
    arguments = plan_arguments(full, world_size=2, gpu=False, reference_pairs=cached_pairs(full, rows))
    assert arguments["spec"].reference_pairs == len(bundled_rows())
    plan = make_plan(model, "2x1GiB", **arguments)
    one_step = make_plan(model, "2x1GiB", **plan_arguments(full, world_size=2, gpu=False))
    assert one_step.spec.reference_pairs is None  # `hfsplit plan` without the data: one step's pairs
    extra = plan.stages[-1].memory.activations - one_step.stages[-1].memory.activations
    assert extra == 8 * (len(bundled_rows()) - 4)  # 8 bytes a pair, against the 4 pairs of one step


def test_the_pass_covers_the_rows_the_steps_draw_each_once_in_the_order_met():
    batches = pair_batches()  # 64 rows, 8 a step: 8 steps an epoch
    drawn = [next(batches)["index"] for _ in range(10)]
    assert torch.equal(torch.from_numpy(pair_batches().rows_of_steps(10)), torch.stack(drawn))
    few = visited_rows(pair_batches(), steps=3)
    assert torch.equal(few, torch.cat(drawn[:3]))  # three steps of one epoch: no row twice
    assert sorted(visited_rows(pair_batches(), steps=10).tolist()) == list(range(64))  # past an epoch: all, once
    assert all(int(r[0]) % 2 == 0 and int(r[1]) == int(r[0]) + 1 for r in few.reshape(-1, 2))  # pairs together


def test_the_table_file_is_read_back_only_for_the_same_rows_model_and_precision(tmp_path, tiny_checkpoint):
    folder = str(tiny_checkpoint("llama"))
    rows = pair_batches().rows
    spec = TrainingSpec(method="full", seq_len=64, dtype="float32")
    fingerprint = reference_fingerprint(rows, spec, model_path=folder)
    table = torch.randn(len(rows))
    table[5] = float("nan")
    path = tmp_path / REFERENCE_FILE
    write_table(path, table, fingerprint)
    assert [p.name for p in tmp_path.iterdir()] == [REFERENCE_FILE]  # no temporary left beside it
    torch.testing.assert_close(read_table(path, fingerprint, rows=len(rows)), table, equal_nan=True)
    torch.testing.assert_close(read_table(path, fingerprint, rows=len(rows), mmap=True), table, equal_nan=True)
    other_rows = pair_batches(seq_len=48).rows
    assert reference_fingerprint(other_rows, spec, model_path=folder) != fingerprint
    bf16 = TrainingSpec(method="full", seq_len=64, dtype="bfloat16")
    assert reference_fingerprint(rows, bf16, model_path=folder) != fingerprint
    assert reference_fingerprint(rows, spec, model_path=str(tiny_checkpoint("llama", tied=True))) != fingerprint
    assert read_table(path, "another", rows=len(rows)) is None
    assert read_table(path, fingerprint, rows=len(rows) + 2) is None
    assert read_table(tmp_path / "missing.safetensors", fingerprint, rows=len(rows)) is None
    for cut in (4, 100, len(path.read_bytes()) - 8):  # a file cut short: recomputed, not read
        (tmp_path / "torn.safetensors").write_bytes(path.read_bytes()[:cut])
        assert read_table(tmp_path / "torn.safetensors", fingerprint, rows=len(rows)) is None
    # --eval-every: the held-out rows' table beside it, under its own fingerprint
    assert read_table(path, fingerprint, rows=len(rows), name=HELD_OUT) is None
    held = other_rows.select(slice(0, 8))
    held_print = reference_fingerprint(held, spec, model_path=folder)
    write_table(path, table, fingerprint, held_out=torch.arange(8.0), held_out_fingerprint=held_print)
    torch.testing.assert_close(read_table(path, fingerprint, rows=len(rows)), table, equal_nan=True)
    for mmap in (False, True):
        torch.testing.assert_close(read_table(path, held_print, rows=8, name=HELD_OUT, mmap=mmap), torch.arange(8.0))
    assert read_table(path, fingerprint, rows=8, name=HELD_OUT) is None  # the training rows' fingerprint


def trl_full_dpo(options, pairs: list[dict], *, steps: int, pairs_per_step: int, eval_pairs: list[dict] = ()):
    """TRL's DPOTrainer, full fine-tuning with `precompute_ref_log_probs=True`, on the same rows in the same order:
    (its per-step logs with each step's exact loss, the trained model, the reference log-probs it precomputed);
    `eval_pairs`: evaluated every `options.eval_every` steps, its eval logs after the step logs."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig

    from hfsplit.training.run import tokenizer_for

    InOrder = in_order_dpo_trainer()
    torch.manual_seed(options.seed)
    model = AutoModelForCausalLM.from_pretrained(options.model, dtype=torch.float32)
    args = DPOConfig(output_dir=options.output_dir + "-trl", beta=options.beta, loss_type=options.dpo_loss,
                     max_length=options.seq_len, per_device_train_batch_size=1, precompute_ref_log_probs=True,
                     gradient_accumulation_steps=pairs_per_step, max_steps=steps, learning_rate=options.learning_rate,
                     lr_scheduler_type="cosine", warmup_steps=options.warmup_steps, weight_decay=0.0,
                     max_grad_norm=options.max_grad_norm, optim="adamw_torch", logging_steps=1, report_to=[],
                     save_strategy="no", use_cpu=True, seed=options.seed, dataloader_num_workers=0,
                     eval_strategy="steps" if eval_pairs else "no", eval_steps=options.eval_every,
                     per_device_eval_batch_size=1,  # its eval dataset's reference log-probs precomputed too
                     bf16=False)  # DPOConfig's default is bf16=True: bf16 autocast, on the CPU too
    trainer = InOrder(model=model, ref_model=None, args=args, train_dataset=Dataset.from_list(pairs),
                      eval_dataset=Dataset.from_list(list(eval_pairs)) if eval_pairs else None,
                      processing_class=tokenizer_for(options, model_path=options.model))
    trainer.micro_losses = []
    reference = torch.stack([torch.tensor(trainer.train_dataset[k]) for k in ("ref_chosen_logps",
                                                                               "ref_rejected_logps")], 1)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "rewards/margins" in h]
    calls = trainer.micro_losses if not eval_pairs else training_calls(
        trainer.micro_losses, steps=steps, pairs_per_step=pairs_per_step, every=options.eval_every,
        evaluated=len(eval_pairs))
    micro = torch.tensor(calls).reshape(steps, pairs_per_step)
    for h, exact in zip(logs, micro.mean(1).tolist()):  # the Trainer's log rounds the loss to 4 decimals
        h["loss"] = exact
    return logs + [h for h in trainer.state.log_history if "eval_loss" in h], trainer.model, reference


def dpo_records(output_dir) -> list[dict]:
    return [json.loads(line) for line in open(Path(output_dir) / "metrics.jsonl") if '"rewards/margins"' in line]


# the rewards are beta × differences of near-equal log-probs (0 on the first step): an absolute floor; measured
# 6.7e-7 absolute, log-probs 1.2e-7 relative
REWARD_TOLERANCE = dict(rtol=1e-5, atol=2e-6)
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


@pytest.mark.slow
def test_full_dpo_with_the_precomputed_reference_equals_trl_at_pp2_and_pp_dp_saves_and_resumes(tiny_checkpoint,
                                                                                             tmp_path):
    """Full fine-tuning DPO, its reference precomputed before the first step: 10 steps at pp=2 (two ranks) and
    at pp=2 × dp=2 (four ranks) give TRL's per-step losses and reward metrics on the same rows in the same order
    (fp32); the saved model is TRL's trained one; the table in the output folder holds TRL's reference
    log-probs; resumed from step 5 under pp=2 × dp=2 (the table read back from the folder) and under pp=2 in
    another folder (the table recomputed from the base weights), the curve goes on exactly. With LoRA, the
    precomputed reference gives the adapters-off one's losses."""
    from transformers import AutoModelForCausalLM

    from tests.parallel.launcher import launch

    base = dict(model=str(tiny_checkpoint("llama")), objective="dpo", method="full", seq_len=64, micro_batch_size=2,
                max_steps=STEPS, learning_rate=1e-4, warmup_steps=2, dtype="float32", tp=1, pp=2)
    pp2 = dict(base, micro_batches=PAIRS_PER_STEP, max_memory="2x1GiB", save_every=5,
               output_dir=str(tmp_path / "pp2"))
    elsewhere = dict(pp2, resume=str(tmp_path / "pp2" / "checkpoint-5"), output_dir=str(tmp_path / "elsewhere"))
    lora = [dict(pp2, method="lora", lora_dropout=0.0, learning_rate=5e-3, reference=reference, save_every=None,
                 output_dir=str(tmp_path / f"lora-{reference}")) for reference in ("precomputed", "adapters-off")]
    evaluated = dict(pp2, eval_every=5, output_dir=str(tmp_path / "eval"))  # then resumed from its step 5
    (pp2_losses, elsewhere_losses, *lora_losses, eval_losses, eval_resumed), _ = launch(
        "tests.training.cases:finetune_losses", world_size=2,
        kwargs={"runs": [pp2, elsewhere, *lora, evaluated, dict(evaluated, resume="latest")]}, timeout_s=900)
    assert_full_dpo_evaluation_equals_trl(evaluated, eval_losses, eval_resumed)
    # LoRA: the precomputed reference is the adapters-off one, computed once before training
    torch.testing.assert_close(torch.tensor(lora_losses[0]), torch.tensor(lora_losses[1]), rtol=1e-6, atol=0)
    assert (tmp_path / "lora-precomputed" / "adapter").is_dir() and lora_losses[0][-1] < lora_losses[0][0]
    (record,) = metrics_records(str(tmp_path / "pp2"), has="reference_logps")  # planned with the pairs it caches
    assert record["planned_pairs"] == len(bundled_rows()) and record["table_rows"] == 2 * len(bundled_rows())
    options = tiny_demo_options(**pp2)
    pairs = hfsplit_pair_order(options, bundled_rows(), steps=STEPS, pairs_per_step=PAIRS_PER_STEP)
    logs, trained, trl_reference = trl_full_dpo(options, pairs, steps=STEPS, pairs_per_step=PAIRS_PER_STEP)
    trl = torch.tensor([h["loss"] for h in logs])
    print("hfsplit pp=2", pp2_losses, "\ntrl         ", trl.tolist())
    assert len(logs) == STEPS and math.isclose(pp2_losses[0], LN2, rel_tol=1e-6)
    torch.testing.assert_close(torch.tensor(pp2_losses), trl, rtol=1e-6, atol=0)  # measured: 2.6e-7
    assert pp2_losses[-1] < pp2_losses[0]  # it learns the preferences
    records = dpo_records(tmp_path / "pp2")
    for key in REWARDS:
        torch.testing.assert_close(torch.tensor([r[key] for r in records]), torch.tensor([h[key] for h in logs]),
                                   **REWARD_TOLERANCE, msg=key)
    # the table: every row, TRL's precomputed reference log-probs (chosen at even rows, rejected at odd)
    drawn = torch.from_numpy(pair_batches(seed=options.seed).rows_of_steps(STEPS)).reshape(-1)
    assert pairs == [bundled_rows()[int(r) // 2] for r in drawn[0::2]]  # TRL's rows: those the steps draw
    table = load_file(tmp_path / "pp2" / REFERENCE_FILE)["logps"]  # plain safetensors
    assert not table.isnan().any()
    torch.testing.assert_close(torch.stack([table[drawn[0::2]], table[drawn[1::2]]], 1), trl_reference, rtol=1e-6,
                               atol=0)  # measured: 2.1e-7
    # the saved HF folder is TRL's trained model: the same log-probs of the pairs
    rows = pair_batches().rows.select(slice(0, 16))
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "pp2" / "model"), dtype=torch.float32)
    with torch.no_grad():
        got, want = (sequence_logps(m(input_ids=rows.input_ids).logits, rows.labels) for m in (saved, trained))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    # resumed in another folder: the reference recomputed from the base weights, not the checkpoint's
    assert (tmp_path / "elsewhere" / REFERENCE_FILE).is_file()
    torch.testing.assert_close(torch.tensor(elsewhere_losses), torch.tensor(pp2_losses[5:]), rtol=1e-6, atol=0)

    ppdp = dict(base, micro_batches=PAIRS_PER_STEP // 2, max_memory="4x1GiB", output_dir=str(tmp_path / "ppdp"))
    resumed = dict(pp2, micro_batches=PAIRS_PER_STEP // 2, max_memory="4x1GiB", resume="latest")
    (ppdp_losses, resumed_losses), *_ = launch("tests.training.cases:finetune_losses", world_size=4,
                                               kwargs={"runs": [ppdp, resumed]}, timeout_s=900)
    print("hfsplit pp=2 x dp=2", ppdp_losses, "\nresumed", resumed_losses)
    torch.testing.assert_close(torch.tensor(ppdp_losses), trl, rtol=1e-6, atol=0)
    for key in REWARDS:
        torch.testing.assert_close(torch.tensor([r[key] for r in dpo_records(tmp_path / "ppdp")]),
                                   torch.tensor([h[key] for h in logs]), **REWARD_TOLERANCE, msg=key)
    # the table read back (keyed by row, whichever replica now holds it): the uninterrupted curve goes on
    torch.testing.assert_close(torch.tensor(resumed_losses), torch.tensor(pp2_losses[5:]), rtol=1e-5, atol=0)


def assert_full_dpo_evaluation_equals_trl(run: dict, losses: list[float], resumed: list[float]) -> None:
    """Full DPO with --eval-every 5 (its held-out pairs' reference precomputed with the training rows'), then
    resumed from its step 5 in its folder: the losses, eval_loss and eval_rewards/* equal TRL's (its eval
    dataset's reference precomputed too) on the same rows; the resumed run read both tables back."""
    options = tiny_demo_options(**run)
    held = held_out_pairs(options, bundled_rows())
    pairs = hfsplit_pair_order(options, bundled_rows()[held:], steps=STEPS, pairs_per_step=PAIRS_PER_STEP)
    logs, _, _ = trl_full_dpo(options, pairs, steps=STEPS, pairs_per_step=PAIRS_PER_STEP,
                              eval_pairs=bundled_rows()[:held])
    evals, logs = [h for h in logs if "eval_loss" in h], [h for h in logs if "eval_loss" not in h]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor([h["loss"] for h in logs]), rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[5:]), rtol=1e-5, atol=0)
    passes = metrics_records(run["output_dir"], has="reference_logps")
    assert [(p["reference_logps"], p["reference_held_out_rows"]) for p in passes] == \
        [("computed", 2 * held), ("read back", 2 * held)], passes
    ours = metrics_records(run["output_dir"], has="eval_loss")  # steps 5 and 10, then the resumed run's 10
    assert [r["step"] for r in ours] == [5, 10, 10] and [h["step"] for h in evals] == [5, 10]
    worst = {}
    for key in ("eval_loss", *(f"eval_{k}" for k in REWARDS)):
        mine, theirs = (torch.tensor([float(r[key]) for r in table], dtype=torch.float64)
                        for table in (ours, evals + evals[1:]))
        worst[key] = float(((mine - theirs).abs() / theirs.abs().clamp(min=1e-12)).max())
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=0 if key == "eval_loss" else 1e-6,
                                   msg=f"{key}:\nhfsplit {mine.tolist()}\ntrl     {theirs.tolist()}")
    print("full DPO evaluation, worst rel diff vs TRL:", {k: f"{v:.1e}" for k, v in worst.items()})


def accelerate_dpo(out: Path, *, env: dict, restarts: int = 0):
    """The tiny DPO recipe, full fine-tuning, on two CPU ranks under accelerate launch (torchrun restarts)."""
    from tests.parallel.launcher import ROOT, free_port, run_command

    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           "--config_file", str(ROOT / "recipes/accelerate_cpu.yaml"), "--main_process_port", str(free_port()),
           "--rdzv_backend", "c10d", "--max_restarts", str(restarts), "--monitor_interval", "0.2",
           "--rdzv_conf", "last_call_timeout=1", str(ROOT / "recipes/finetune.py"),
           "--config", str(ROOT / "recipes/tiny/dpo.yaml"), "--dataset", str(ROOT / BUNDLED), "--method", "full",
           "--learning-rate", "1e-4", "--max-steps", "4", "--save-every", "2", "--dtype", "float32",
           "--max-memory", "2x1GiB", "--output-dir", str(out)]
    return run_command(cmd, cwd=out.parent, env=env, timeout_s=400)


@pytest.mark.slow
def test_an_elastic_restart_of_full_dpo_reads_the_reference_back_and_keeps_the_curve(tmp_path):
    """Full DPO under accelerate launch --max_restarts 1 (docs/guides/faults.md): rank 0 fails in step 3 (an
    injected allocation failure, once); torchrun restarts both workers, which read the reference table back from
    the output folder (no second pass: the weights are step 2's by then), resume from checkpoint-2 and finish
    with the losses of a run that was never interrupted."""
    from hfsplit.training.memory import INJECT
    from tests.training.test_elastic import records_of, restarts

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                      os.environ.get("PYTHONPATH")]))}
    whole, failed = tmp_path / "whole", tmp_path / "failed"
    done = accelerate_dpo(whole, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "reference log-probs of 32 sequences computed" in done.stdout
    proc = accelerate_dpo(failed, env={**env, INJECT: "3"}, restarts=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ran out of memory in step 3" in proc.stderr
    (restart,) = restarts(failed)
    assert restart["restart"] == "restart" and restart["step"] == 2
    passes = [r["reference_logps"] for r in records_of(failed) if "reference_logps" in r]
    assert passes == ["computed", "read back"], passes

    def losses(out):
        return {r["step"]: r["loss"] for r in records_of(out) if "loss" in r and not r.get("skipped")}

    assert sorted(losses(failed)) == [1, 2, 3, 4]
    assert losses(failed) == pytest.approx(losses(whole), rel=1e-6)
