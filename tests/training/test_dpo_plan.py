"""The DPO run keeps its plan (issue 23): the tiny DPO recipe at pp=2, each rank's measured peak of a step against
the plan's figure for its stage, and the measured busy time against the plan's estimate (the reference pass in it)."""
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hfsplit.training.options import recipe_values
from tests.parallel.launcher import launch

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "dpo.yaml"


def dpo_step_against_plan(options: dict) -> dict:
    """On every rank: the recipe's DPO run as `hfsplit.finetune` builds and fits it, then one more step measured as
    the QLoRA tests measure theirs (bytes held: weights, quant state and AdamW state, + the peak of the storages the
    step creates, + torch's receive buffers of both schedules, made in the first step); the plan's figure for this rank's stages, the same split planned for SFT (what the reference and
    the DPO head add), and the run's step and busy times."""
    from hfsplit.checkpoint.resolve import load_config
    from hfsplit.plan import rank_total
    from hfsplit.planning.costs.model import model_costs
    from hfsplit.planning.planner import make_plan
    from hfsplit.planning.reference import forward_fraction, reference_bytes
    from hfsplit.objectives import dpo
    from hfsplit.training.options import tiny_demo_options
    from hfsplit.training.run import build_run
    from hfsplit.training.trainer import fit, train_step
    from tests.parallel.apply_cases import LiveStorages, receive_buffer_bytes
    from tests.training.test_qlora import held_bytes_of

    run = build_run(tiny_demo_options(**options), progress=False)
    reference_busy = []  # each step's busy seconds in the reference pass (the rest of train_step's are training's)

    def timed(run, *args, **kwargs):
        before = run.model.busy_seconds()
        targets = original(run, *args, **kwargs)
        reference_busy.append(run.model.busy_seconds() - before)
        return targets

    original, dpo.dpo_targets = dpo.dpo_targets, timed  # timed, not replaced: it runs as it does
    result = fit(run)
    dpo.dpo_targets = original
    model, plan = run.model, run.model.plan
    costs = model_costs(load_config(options["model"]), plan.spec)
    held = held_bytes_of(model) + sum(t.nbytes for state in run.optimizer.state.values() for t in state.values()
                                      if isinstance(t, torch.Tensor))
    with LiveStorages() as live:
        train_step(run, next(run.batches))
    buffers = receive_buffer_bytes(model)  # the run's two schedules, before reference_peaks builds its own
    passes = reference_peaks(run, next(run.batches))
    mine = list(model.stage_indices)
    sft = make_plan(options["model"], options["max_memory"], spec=replace(plan.spec, objective="sft", reference=None),
                    micro_batches=plan.micro_batches, schedule=plan.schedule, pp=plan.pp, tp=plan.tp,
                    activation_checkpointing=plan.spec.activation_checkpointing, optim=plan.spec.optim, gpus=False)
    return dict(measured=held + live.peak + buffers, planned=rank_total(plan.stages[i].memory for i in mine),
                planned_sft=rank_total(sft.stages[i].memory for i in mine), losses=result.losses,
                same_split=[s.layers for s in sft.stages] == [s.layers for s in plan.stages],
                objective=plan.spec.objective, reference=plan.spec.reference, reference_s=plan.reference_s,
                plan=plan, step_times_s=result.step_times_s, busy_s=result.busy_s_per_rank,
                # the timed steps' (Metrics leaves the first, which builds the schedules, out of its busy total)
                reference_busy=sum(reference_busy[1:]), busy=result.busy_s_per_rank[torch.distributed.get_rank()],
                planned_share=forward_fraction(model_costs(load_config(options["model"]), plan.spec)),
                planned_reference=sum(sum(reference_bytes(costs, has_embed=plan.stages[i].has_embed,
                                                      has_head=plan.stages[i].has_head,
                                                      micro_batches=plan.micro_batches, relay=False))
                                      # its schedule's receive buffers were made by the steps before: not the pass's
                                      - (0 if plan.stages[i].has_embed else plan.micro_batches * costs.boundary_bytes)
                                      for i in mine),
                **passes)


def reference_peaks(run, batch: dict) -> dict:
    """On every rank (collective): the peak bytes of the storages the step's reference pass creates (`dpo_targets`
    on `batch`, its schedule built by the steps before), and those of no-grad forwards of 1, 2, 4 of its rows with
    the adapters off (one row a micro-batch, as `micro_batches_for` cuts them), their log-probs taken as the run
    takes them ("reduced": each micro-batch's logits as they leave the last stage) and as it took them before
    ("joined": the step's logits, then `sequence_logps` of them all), each shape's schedule built beforehand; and
    the log-probs of both ways."""
    from hfsplit.models.loss import sequence_logps
    from hfsplit.objectives import dpo
    from hfsplit.training.preference import adapters_disabled, batch_sequences
    from tests.parallel.apply_cases import LiveStorages

    model = run.model
    ids, labels, positions = batch["input_ids"], batch["labels"], batch["position_ids"]
    with LiveStorages() as live:
        dpo.dpo_targets(run, ids, labels, positions, sequences=batch_sequences(batch))
    step_peak = live.peak

    def reduced(n):
        return model.forward(ids[:n], position_ids=positions[:n], reduce=sequence_logps, targets=labels[:n])

    def joined(n):
        logits = model.forward(ids[:n], position_ids=positions[:n])
        return sequence_logps(logits, labels[:n]) if logits is not None else None

    peaks, values = {}, {}
    with torch.no_grad(), adapters_disabled(model.stages):
        for way, forward in (("reduced", reduced), ("joined", joined)):
            for n in (1, 2, 4):
                forward(n)  # builds the schedule of this shape: its buffers are not the pass's
                with LiveStorages() as live:
                    values[way, n] = forward(n)
                peaks[way, n] = live.peak
        model.join_rows = True  # as under flash attention: each micro-batch's rows joined into one (both ways alike)
        try:
            values["reduced", "joined rows"], values["joined", "joined rows"] = reduced(len(ids)), joined(len(ids))
        finally:
            model.join_rows = False
    return dict(reference_peak=step_peak, pass_peaks=peaks, pass_values=values)


@pytest.mark.slow
def test_the_tiny_dpo_recipe_keeps_its_plan(tiny_checkpoint, tmp_path):
    """recipes/tiny/dpo.yaml (LoRA, pp=2, 1F1B, 4 micro-batches of one pair) on two CPU ranks: the plan is a DPO
    plan with the adapters-off reference; each rank's measured peak is its planned figure within ±15% (as the other
    run-vs-plan tests hold theirs), and above the same split's SFT figure where the plan says DPO costs more; the
    last stage's reference pass peaks at its planned figure within ±15%, at one micro-batch's logits whatever the
    micro-batch count (the old way, the step's logits joined, grows with it; both give the same log-probs); the
    reference pass's share of the ranks' busy time is at most the plan's (both count its forward of every
    micro-batch), and the busy time per step beside the estimate is printed."""
    from hfsplit.load.probes import RECHECK_FACTOR
    from hfsplit.planning.timing import pipeline_busy

    options = dict(recipe_values(RECIPE), model=str(tiny_checkpoint("llama")), max_memory="2x1GiB", max_steps=4,
                   dtype="float32", output_dir=str(tmp_path / "dpo"))
    results = launch("tests.training.test_dpo_plan:dpo_step_against_plan", world_size=2, kwargs={"options": options},
                     timeout_s=400)
    for rank, r in enumerate(results):  # every figure printed before any is asserted
        print(f"rank {rank}: planned {r['planned']} measured {r['measured']} ({r['measured'] / r['planned']:.3f}); "
              f"the SFT plan of the split {r['planned_sft']}; the reference pass: planned {r['planned_reference']} "
              f"measured {r['reference_peak']}; the pass of 1, 2, 4 micro-batches, reduced / joined: "
              f"{[r['pass_peaks']['reduced', n] for n in (1, 2, 4)]} / "
              f"{[r['pass_peaks']['joined', n] for n in (1, 2, 4)]}")
    first = results[0]
    plan = first["plan"]
    assert (first["objective"], first["reference"]) == ("dpo", "adapters-off")
    assert plan.pp == 2 and plan.schedule == "1F1B" and plan.spec.micro_batch_size == 2
    for rank, r in enumerate(results):
        ratio = r["measured"] / r["planned"]
        assert 0.85 <= ratio <= 1.15, f"rank {rank}: measured/planned = {ratio:.3f}"
        if r["same_split"] and r["planned"] > 1.15 * r["planned_sft"]:  # what DPO adds shows in the measurement
            assert r["measured"] > r["planned_sft"], (rank, r["measured"], r["planned_sft"])
    # The reference pass on the last stage: its peak within ±15% of the plan's; one micro-batch's logits at a time
    # (taken as they leave the stage: no more with 4 micro-batches than with 1, but 4 bytes a row), where joining
    # them first, as the run did before, holds the step's (each row's logits and log-softmax more); the same values
    last, row_logits = results[1], 2 * options["seq_len"] * 256 * 4  # fp32 logits + log-softmax (vocab 256)
    ratio = last["reference_peak"] / last["planned_reference"]
    assert 0.85 <= ratio <= 1.15, f"the last stage's reference pass: measured/planned = {ratio:.3f}"
    reduced, joined = ([last["pass_peaks"][way, n] for n in (1, 2, 4)] for way in ("reduced", "joined"))
    assert reduced[2] - reduced[0] <= 4 * 3, reduced
    assert joined[1] - joined[0] >= row_logits and joined[2] - joined[1] >= 2 * row_logits, joined
    for n in (1, 2, 4, "joined rows"):
        assert torch.equal(last["pass_values"]["reduced", n], last["pass_values"]["joined", n]), n
    assert last["pass_values"]["reduced", "joined rows"].shape == (plan.spec.micro_batch_size * plan.micro_batches,)
    rows = pipeline_busy(plan, first["step_times_s"], first["busy_s"])
    estimated, measured = sum(row[1] for row in rows), sum(row[2] for row in rows)
    shares = [r["reference_busy"] / (r["busy"] - r["reference_busy"]) for r in results]
    print(f"busy per step: estimated {estimated * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms; step estimate "
          f"{plan.step_time_s * 1e3:.1f} ms, reference {first['reference_s'] * 1e3:.1f} ms of it, measured steps "
          f"{[round(t * 1e3, 1) for t in first['step_times_s']]}; the reference's busy time over training's per rank "
          f"{[round(x, 3) for x in shares]}, planned {first['planned_share']:.3f}")
    assert first["reference_s"] > 0
    # The busy time against the estimate swings with this shared machine's load between the launch's calibration
    # and the steps (the run's own recheck, `probes.recheck_speed`, rewrites the calibration beyond RECHECK_FACTOR):
    # printed, not asserted. What the plan adds for DPO is checked where load cancels out: the reference's forward
    # against the training pass, both measured on the same ranks at the same moments, is never above the plan's
    # share (1.5x margin). Measured 0.13-0.18 against the planned 0.5 here: the plan is conservative on this CPU
    # (a whole-model microbenchmark measured 0.48-0.67, see `forward_fraction`); not measured on a GPU.
    print(f"measured/estimated busy {measured / estimated:.2f} (the run's recheck factor: {RECHECK_FACTOR})")
    assert all(0 < x <= 1.5 * first["planned_share"] for x in shares), shares
    assert first["losses"][-1] < first["losses"][0]


@pytest.mark.slow
def test_the_tiny_dpo_recipe_packed_keeps_its_plan(tiny_checkpoint, tmp_path):
    """The tiny DPO recipe with --packing on (rows of 128, one full row a micro-batch): the plan is a packed DPO
    plan, and each rank's measured peak of a step is its planned figure within ±15%."""
    options = dict(recipe_values(RECIPE), model=str(tiny_checkpoint("llama")), max_memory="2x1GiB", max_steps=4,
                   dtype="float32", packing="on", seq_len=128, micro_batch_size=1, output_dir=str(tmp_path / "dpo"))
    results = launch("tests.training.test_dpo_plan:dpo_step_against_plan", world_size=2, kwargs={"options": options},
                     timeout_s=400)
    ratios = [r["measured"] / r["planned"] for r in results]
    print("packed DPO measured/planned per rank:", [f"{x:.3f}" for x in ratios])
    plan = results[0]["plan"]
    assert plan.spec.objective == "dpo" and plan.spec.packing and plan.spec.micro_batch_size == 1
    assert all(0.85 <= x <= 1.15 for x in ratios), ratios
    assert results[0]["losses"][-1] < results[0]["losses"][0]
