"""Split fine-tuning equals single-process training of the unsplit transformers model, step by step."""
import json
import re
import os
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
import torch

from hfsplit.training.data import bundled_dataset_path, load_token_rows

from hfsplit.training.batches import MicroBatches
from hfsplit.apply.lora import lora_config, seed_lora_weights
from hfsplit.training.options import ACCELERATE_CPU_CONFIG, TINY_RECIPE, FinetuneOptions, packing_of, tiny_demo_options
from hfsplit.training.packing import label_tokens
from hfsplit.models.loss import causal_lm_loss
from hfsplit.training.run import tokenizer_for
from hfsplit.cli.charts import run_timeline_chart
from hfsplit.training.timeline import TIMELINE_JSON, read_timeline
from hfsplit.planning.timeline import action_order
from tests.parallel.launcher import free_port, launch, run_command
from tests.training.refusals import stderr_lines

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20


def reference_training(options: FinetuneOptions, *, replicas: int = 1, base=None, autocast=None):
    """(per-step losses, trained model) of plain transformers (+ peft) training on the run's rows (packed or padded,
    as the options say), each step's loss the token mean of its global batch as transformers' Trainer computes it
    (the summed token loss of every micro-batch over the batch's label tokens, `num_items_in_batch`); an MoE's
    router term (`output_router_logits`) the mean of its forwards'. `base`: a ready base model; `autocast`: a dtype
    the forwards run under `torch.autocast` to, as transformers' Trainer with bf16/fp16."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

    torch.manual_seed(options.seed)
    model = base if base is not None else AutoModelForCausalLM.from_pretrained(options.model, dtype=torch.float32)
    if options.method in ("lora", "qlora"):
        model = get_peft_model(model, lora_config(r=options.lora_r, alpha=options.lora_alpha,
                                                  dropout=options.lora_dropout, targets=options.lora_targets,
                                                  model_config=model.config))
        seed_lora_weights(model, seed=options.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=options.learning_rate, weight_decay=options.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, options.warmup_steps, options.max_steps)
    tokenizer = tokenizer_for(options, model_path=options.model)
    rows = load_token_rows(str(bundled_dataset_path("tiny_alpaca.jsonl")), tokenizer, seq_len=options.seq_len,
                           packing=packing_of(options), seed=options.seed)
    micro_batches = options.micro_batches * replicas  # data-parallel replicas split one global batch
    batches = MicroBatches(rows, micro_batch_size=options.micro_batch_size, num_micro_batches=micro_batches,
                           seed=options.seed)
    losses = []
    for _ in range(options.max_steps):
        losses.append(reference_step(model, next(batches), micro_batch_size=options.micro_batch_size,
                                     forwards=micro_batches, autocast=autocast))
        torch.nn.utils.clip_grad_norm_(params, options.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return losses, model


def reference_step(model, batch: dict, *, micro_batch_size: int, forwards: int, autocast=None) -> float:
    """Forward and backward of one global batch in micro-batches of `micro_batch_size` rows, transformers' way: the
    loss of each is its summed token loss over the whole batch's label tokens (+ the router term / `forwards`)."""
    items = label_tokens(batch["labels"])
    loss_fn = causal_lm_loss(model.config.vocab_size)
    routed = getattr(model.config, "output_router_logits", False)  # an MoE: transformers' router auxiliary loss
    total = 0.0
    for x, y, pos in zip(*(batch[k].split(micro_batch_size) for k in ("input_ids", "labels", "position_ids"))):
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            out = model(input_ids=x, position_ids=pos, use_cache=False)
        loss = loss_fn(out.logits, y, num_items_in_batch=items)
        if routed:
            loss = loss + model.config.router_aux_loss_coef * out.aux_loss / forwards
        loss.backward()
        total += float(loss.detach())
    return total


def saved_model(folder: Path, options: FinetuneOptions):
    """What users load from the run's output with plain transformers / peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if options.method == "lora":
        base = AutoModelForCausalLM.from_pretrained(options.model, dtype=torch.float32)
        return PeftModel.from_pretrained(base, folder / "adapter")
    return AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32)


def run_options(checkpoint, tmp_path, method: str, **extra) -> dict:
    return dict(model=str(checkpoint), method=method, seq_len=64, micro_batch_size=2, micro_batches=4,
                max_steps=STEPS, learning_rate=3e-3 if method == "lora" else 1e-3, warmup_steps=3,
                max_grad_norm=0.5, output_dir=str(tmp_path / f"{method}-{extra}"), dtype="float32", **extra)


@pytest.mark.slow
@pytest.mark.parametrize("world, split, arch", [
    (2, dict(pp=2, max_memory="2x1GiB"), "llama"),
    (2, dict(tp=2, pp=1, max_memory="2x1GiB"), "qwen2"),
    (4, dict(tp=2, pp=2, max_memory="4x1GiB"), "mistral"),
    # two data-parallel replicas, one example a row: the token mean over padded micro-batches of unequal counts
    (2, dict(tp=1, pp=1, max_memory="2x1GiB", packing="off"), "llama"),
    (2, dict(pp=2, max_memory="2x1GiB"), "phi3"),  # fused qkv_proj / gate_up_proj as LoRA targets
    (2, dict(tp=2, pp=1, max_memory="2x1GiB"), "qwen3"),  # q/k norm gradients summed over TP
    # the families of hfsplit.models.families.FAMILIES train on every split in tests/parallel/test_families_split.py
])
def test_split_training_losses_equal_unsplit_training(tiny_checkpoint, tmp_path, world, split, arch):
    """pp=2, tp=2, pp=2×tp=2 and dp=2, LoRA and full, on packed rows (padded under dp=2): every step's loss equals
    the unsplit model's trained by transformers on the same rows, and the saved output loads with plain
    transformers / peft."""
    checkpoint = tiny_checkpoint(arch)
    runs = [run_options(checkpoint, tmp_path, "lora", merge=True, **split), run_options(checkpoint, tmp_path, "full", **split)]
    results = launch("tests.training.cases:finetune_losses", world_size=world, kwargs={"runs": runs}, timeout_s=300)
    probe = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    for run, split_losses in zip(runs, results[0]):
        options = tiny_demo_options(**run)
        replicas = world // (split["tp"] if "tp" in split else 1) // split["pp"]
        expected, trained = reference_training(options, replicas=replicas)
        assert len(split_losses) == STEPS
        assert split_losses == pytest.approx(expected, rel=1e-4), run["method"]
        # the saved output loads with plain transformers / peft and computes what training ended with
        loaded = saved_model(Path(run["output_dir"]), options)
        with torch.no_grad():
            diff = (loaded(input_ids=probe).logits - trained(input_ids=probe).logits).abs().max()
        assert diff < 1e-4, run["method"]
        if run.get("merge"):  # --merge: the adapters folded into a plain transformers model
            from transformers import AutoModelForCausalLM

            merged = AutoModelForCausalLM.from_pretrained(Path(run["output_dir"]) / "merged", dtype=torch.float32)
            base = AutoModelForCausalLM.from_pretrained(options.model, dtype=torch.float32)
            with torch.no_grad():
                assert (merged(input_ids=probe).logits - trained(input_ids=probe).logits).abs().max() < 1e-4
                assert (base(input_ids=probe).logits - trained(input_ids=probe).logits).abs().max() > 1e-3
    assert results[0] == results[-1]  # every rank reports the same losses


@pytest.mark.slow
def test_offloaded_checkpointing_trains_as_planned_and_metrics_log_the_host_bytes(tiny_checkpoint, tmp_path):
    """pp=2 on two ranks (auto's Interleaved1F1B): LoRA with offloaded checkpointing and the chunked loss gives the
    unsplit model's losses, and metrics.jsonl logs per rank the host bytes its offload held, the plan's within ±15%.
    (8-bit AdamW against torch's over 20 steps: tests/training/test_optimizers.py; through the trainer, with its
    resume, in the resume tests below.)"""
    checkpoint = tiny_checkpoint("llama")
    runs = [run_options(checkpoint, tmp_path, "lora", activation_checkpointing="offload", chunked_loss=True, pp=2,
                        max_memory="2x1GiB")]
    (offloaded,) = launch("tests.training.cases:finetune_losses", world_size=2, kwargs={"runs": runs},
                          timeout_s=400)[0]
    expected, _ = reference_training(tiny_demo_options(**runs[0]))
    assert offloaded == pytest.approx(expected, rel=1e-4)
    records = [json.loads(x) for x in (Path(runs[0]["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    planned = next(r["activation_offload_planned"] for r in records if "plan" in r)
    assert sum(planned) > 0
    for record in (r for r in records if "loss" in r):
        for rank, (held, plan) in enumerate(zip(record["activation_offload_bytes"], planned)):
            assert (held == plan == 0) or 0.85 <= held / plan <= 1.15, (record["step"], rank, held, plan)


@pytest.mark.slow
def test_readme_default_command_runs_under_accelerate_launch_and_loss_falls(tmp_path):
    """The installed recipe (`accelerate launch -m hfsplit.finetune` with the packaged CPU config): loss falls,
    a model folder comes out, and stderr holds progress bars only: no third-party warning."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CPU_CONFIG),
           "--main_process_port", str(free_port()), "-m", "hfsplit.finetune", "--output-dir", str(out)]
    proc = run_command(cmd, cwd=tmp_path, env=env, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not stderr_lines(proc.stderr), proc.stderr[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r and not r.get("skipped")]
    assert len(losses) == tiny_demo_options().max_steps
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert "bubble measured" in proc.stdout and "pp=2" in proc.stdout
    assert (out / "tensorboard").is_dir()
    # a Hugging Face model folder: one shard per stage (schedule auto may give each rank two), index, config,
    # generation config, tokenizer
    saved = {p.name for p in (out / "model").iterdir()}
    virtual = re.search(r"virtual stages (\d+)", proc.stdout)
    n = 2 * (int(virtual.group(1)) if virtual else 1)
    shards = {f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)}
    assert shards | {"model.safetensors.index.json", "config.json", "generation_config.json",
                     "tokenizer_config.json"} <= saved, saved


@pytest.mark.slow
def test_the_recipe_runs_without_a_launcher_as_one_rank(tiny_checkpoint, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    model = str(tiny_checkpoint("llama"))
    cmd = [sys.executable, str(ROOT / "recipes/finetune.py"), "--config", str(TINY_RECIPE), "--model", model,
           "--max-memory", "1GiB", "--max-steps", "3", "--seq-len", "64", "--output-dir", str(tmp_path / "out"),
           "--global-batch", "4"]
    record = _calibration_wrong_by_4x(model, tiny_demo_options(model=model, seq_len=64, max_memory="1GiB"))
    proc = run_command(cmd, cwd=tmp_path, env=env, timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 3 steps" in proc.stdout and (tmp_path / "out" / "model" / "config.json").is_file()
    # --global-batch under schedule auto: the planner cut the 4 rows (its note), and the run trained on that cut
    cut = re.search(r"micro-batches auto cut 4 rows per replica as (\d+) × (\d+)", proc.stdout)
    assert cut and int(cut.group(1)) * int(cut.group(2)) == 4 and int(cut.group(1)) <= 2
    launch = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert launch["plan"]["micro_batches"] == int(cut.group(2)) and launch["tokens_per_step"] == 4 * 64
    # The run planned with a FLOP/s 4× too high, measured its busy time, and put its own rate in the cache.
    ratio = float(re.search(r"measured busy time was ([\d.]+)× the estimate", proc.stdout).group(1))
    fixed = record()
    assert ratio > 2 and fixed["source"] == "run" and fixed["seconds"] > 2 * fixed["wrong_seconds"]


def _calibration_wrong_by_4x(model: str, options: FinetuneOptions):
    """Store the calibration record a run of `options` on this CPU (one thread) reads, 4× too fast; returns a
    function reading it back (with the wrong figure kept as `wrong_seconds`)."""
    from hfsplit.load import probes as calibrate
    from hfsplit.checkpoint import load_config
    from hfsplit.planning.costs.cache import read_cache, write_cache
    from hfsplit.training.options import training_spec

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the recipe's rank runs one thread: its device kind says so
    try:
        config, spec, cpu = load_config(model), training_spec(options), torch.device("cpu")
        key = calibrate.speed_key(config, spec, cpu)
        record = calibrate.speed_record(config, spec, cpu)
    finally:
        torch.set_num_threads(threads)
    wrong = record["seconds"] / 4
    write_cache("speed", key, {**record, "seconds": wrong, "split_seconds": record["split_seconds"] / 4})
    return lambda: {**read_cache("speed", key), "wrong_seconds": wrong}


@pytest.mark.slow
def test_epochs_and_evaluation(tiny_checkpoint, tmp_path):
    run = dict(run_options(tiny_checkpoint("llama"), tmp_path, "full", pp=2, max_memory="2x1GiB"),
               epochs=1, eval_every=5)
    (losses,) = launch("tests.training.cases:finetune_losses", world_size=2, kwargs={"runs": [run]},
                       timeout_s=300)[0]
    rows = len(load_token_rows(str(bundled_dataset_path("tiny_alpaca.jsonl")),
                               tokenizer_for(tiny_demo_options(**run), model_path=run["model"]), seq_len=64))
    held_out = max(2 * 4, rows // 20)
    assert len(losses) == (rows - held_out) // (2 * 4)  # one pass over the training rows
    records = [json.loads(x) for x in (Path(run["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == len(losses) // 5 and evals[-1] < evals[0]
    # issue 20's metrics on packed rows: tokens_per_s counts real tokens only, trained_tokens_per_s the label tokens,
    # padding the rest of the step's 2 × 4 rows of 64 positions; each a whole count over the step's seconds
    steps = [r for r in records if "loss" in r and not r.get("skipped")]
    for r in steps:
        real, trained = r["tokens_per_s"] * r["step_s"], r["trained_tokens_per_s"] * r["step_s"]
        assert real == pytest.approx(round(real), abs=1e-3) and trained == pytest.approx(round(trained), abs=1e-3)
        assert 0 < round(trained) < round(real) <= 2 * 4 * 64
        assert round(real) == pytest.approx((1 - r["padding"]) * 2 * 4 * 64, abs=1e-6)
    assert any(r["padding"] > 0 for r in steps) and all(r["padding"] < 0.5 for r in steps)  # packed rows
    events = [EventAccumulator(str(p.parent)).Reload() for p in (Path(run["output_dir"]) / "tensorboard").rglob(
        "events.out.tfevents.*")]
    tags = {t for e in events for t in e.Tags()["scalars"]}
    assert {"tokens_per_s", "trained_tokens_per_s", "padding"} <= tags, tags
    check_measured_timeline(Path(run["output_dir"]), step=len(losses))


def check_measured_timeline(folder: Path, *, step: int) -> None:
    """Issue 33: the last step as the ranks ran it. Each rank ran every action of its schedule's order, in that order
    (torch's own table, `action_order`), one at a time; after the clocks are aligned, stage 1's first forward starts
    only once stage 0's has ended (it needs its output); the recipe's chart is drawn from the JSON."""
    recorded, timeline = read_timeline(str(folder))
    assert recorded == step and timeline.pp == 2 and timeline.micro_batches == 4
    order = action_order(timeline.schedule, pp=timeline.pp, micro_batches=timeline.micro_batches)
    for rank in range(timeline.pp):
        actions = timeline.of_rank(rank)
        assert [(a.stage, a.kind, a.micro_batch) for a in actions] == order[rank], rank
        assert all(a.start <= a.end <= b.start for a, b in zip(actions, actions[1:])), rank
        stages = {a.stage for a in actions}  # one forward and one backward of every micro-batch on each
        assert sorted((a.stage, a.kind, a.micro_batch) for a in actions) == sorted(
            (stage, kind, mb) for stage in stages for kind in "BF" for mb in range(4)), rank
    first = {a.stage: a for a in timeline.actions if a.kind == "F" and a.micro_batch == 0}
    assert first[0].start == 0 and first[0].end <= first[1].start
    chart = run_timeline_chart(folder / TIMELINE_JSON)  # as the recipe draws it at the end of a run
    assert chart.parent == folder and chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.parametrize("world, split, method", [
    (2, dict(pp=2, max_memory="2x1GiB"), "full"),
    (2, dict(tp=2, pp=1, max_memory="2x1GiB"), "lora"),
])
def test_resume_gives_the_uninterrupted_loss_curve(tiny_checkpoint, tmp_path, world, split, method):
    """... with fp32 AdamW, and (full pp=2) with bitsandbytes' 8-bit AdamW: its codes and absmax come back bit for
    bit on the same split, so the curve is the uninterrupted one exactly."""
    base = dict(run_options(tiny_checkpoint("llama"), tmp_path, method, **split), max_steps=12, save_every=6)
    whole = dict(base, output_dir=str(tmp_path / "whole"))
    interrupted = dict(base, output_dir=str(tmp_path / "resumed"))
    eight = [dict(run, optim="adamw_8bit", output_dir=run["output_dir"] + "-8bit") for run in (whole, interrupted)]
    eight = eight if method == "full" else []
    first = launch("tests.training.cases:finetune_losses", world_size=world,
                   kwargs={"runs": [whole, interrupted] + eight}, timeout_s=400)[0]
    assert (tmp_path / "resumed" / "checkpoint-6" / "trainer_state").is_dir()
    # the latest checkpoint is step 6 (the final step saves the model, not a checkpoint): resume from it
    again = [dict(run, resume="latest") for run in [interrupted] + eight[1:]]
    resumed = launch("tests.training.cases:finetune_losses", world_size=world, kwargs={"runs": again},
                     timeout_s=300)[0]
    assert resumed[0] == pytest.approx(first[0][6:], rel=1e-6)
    if eight:
        assert resumed[1] == first[2][6:]  # exactly: the 8-bit state as it was
        assert first[2] != first[0] and first[2] == pytest.approx(first[0], rel=1e-2)  # 8-bit moments track fp32
    # the final save of a resumed run loads like any other
    assert (tmp_path / "resumed" / ("adapter" if method == "lora" else "model")).is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("method, before, after", [
    ("full", (2, dict(pp=2, max_memory="2x1GiB")), (2, dict(pp=1, tp=2, max_memory="2x1GiB"))),
    ("lora", (2, dict(pp=1, tp=2, max_memory="2x1GiB")), (1, dict(pp=1, tp=1, max_memory="1GiB"))),
])
def test_resume_under_another_split_reshards_weights_and_optimizer(tiny_checkpoint, tmp_path, method, before, after):
    """pp=2 → tp=2 and tp=2 on two ranks → one rank: the resumed run continues the same loss curve. With 8-bit AdamW
    (full): onto tp=2 the moments are re-quantized for the new pieces, and the curve continues within the 8-bit
    steps; onto two replicas (each parameter whole again) the codes come back as they were."""
    (world, split), (world_after, split_after) = before, after
    run = dict(run_options(tiny_checkpoint("llama"), tmp_path, method, **split), max_steps=10, save_every=5,
               output_dir=str(tmp_path / "run"))
    eight = [dict(run, optim="adamw_8bit", output_dir=str(tmp_path / "run-8bit"))] if method == "full" else []
    wholes = launch("tests.training.cases:finetune_losses", world_size=world, kwargs={"runs": [run] + eight},
                    timeout_s=300)[0]
    moved = dict(run, **split_after, resume=str(tmp_path / "run" / "checkpoint-5"),
                 output_dir=str(tmp_path / "moved"))
    moved8 = [{**eight[0], **split_after, "resume": str(tmp_path / "run-8bit" / "checkpoint-5"),
               "output_dir": str(tmp_path / f"moved-8bit-{name}"), **extra}
              for name, extra in (("tp2", {}), ("dp2", dict(tp=1, micro_batches=2)))] if eight else []
    resumed = launch("tests.training.cases:finetune_losses", world_size=world_after, kwargs={"runs": [moved] + moved8},
                     timeout_s=400)[0]
    assert resumed[0] == pytest.approx(wholes[0][5:], rel=1e-4)  # another split only reorders float sums
    if eight:
        assert resumed[1] == pytest.approx(wholes[1][5:], rel=1e-3)  # re-quantized for tp=2's pieces
        assert resumed[2] == pytest.approx(wholes[1][5:], rel=1e-4)  # whole again: the codes as they were
    if method == "full":  # the saved model (one shard per pp=2 stage) loads again under another split
        (tp2, _) = launch("tests.parallel.cases:planned_split_runs", world_size=2, kwargs=dict(
            checkpoint=str(tmp_path / "run" / "model"), max_memory="2x2GiB", pp=1, tp=2, schedule="1F1B"))
        assert tp2["logits_diff"] < 1e-5


@pytest.mark.slow
def test_resume_with_another_method_is_refused_naming_the_tensor(tiny_checkpoint, tmp_path):
    run = dict(run_options(tiny_checkpoint("llama"), tmp_path, "lora", pp=2, max_memory="2x1GiB"),
               max_steps=2, save_every=1, output_dir=str(tmp_path / "run"))
    launch("tests.training.cases:finetune_losses", world_size=2, kwargs={"runs": [run]}, timeout_s=300)
    other = dict(run, method="full", resume="latest")
    with pytest.raises(AssertionError, match=r"holds no trainer state for .* model\.\S+; was it written with "
                                             r"another --method"):
        launch("tests.training.cases:finetune_losses", world_size=2, kwargs={"runs": [other]}, timeout_s=300)


@pytest.mark.slow
def test_bf16_full_fine_tuning_tracks_fp32_training_and_saves_bf16(tiny_checkpoint, tmp_path):
    run = dict(run_options(tiny_checkpoint("llama"), tmp_path, "full", pp=2, max_memory="2x1GiB"),
               max_steps=10, dtype="bfloat16")
    (losses,) = launch("tests.training.cases:finetune_losses", world_size=2, kwargs={"runs": [run]},
                       timeout_s=300)[0]
    expected, _ = reference_training(tiny_demo_options(**dict(run, dtype="float32")))
    assert losses == pytest.approx(expected, rel=2e-2)  # bf16 compute, fp32 weights and optimizer
    assert losses != pytest.approx(expected, rel=1e-6)  # autocast really computed in bf16
    from safetensors import safe_open
    saved = Path(run["output_dir"]) / "model"
    shard = sorted(saved.glob("*.safetensors"))[0]
    with safe_open(str(shard), framework="pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16


@pytest.mark.slow
def test_moe_split_training_with_router_loss_equals_transformers(tiny_checkpoint, tmp_path):
    """20 steps with `output_router_logits` (the router auxiliary loss over the layers of both stages, coefficient
    0.5), LoRA and full training of each family, one launch: Mixtral LoRA (1F1B) and full (GPipe), Qwen3-MoE full with
    offloaded activation checkpointing (the routers run again in backward, from the inputs brought back; GPipe) and
    LoRA with checkpointing on the device (1F1B), gpt-oss LoRA on attention and experts with checkpointing (1F1B)
    and full (GPipe) from its MXFP4 checkpoint. Every step's loss equals transformers' own loss of the unsplit
    model, and the saved output (`check_saved_experts`) loads with plain transformers / peft."""
    cases = (("mixtral", "lora", "1F1B", False), ("qwen3_moe", "full", "GPipe", "offload"),
             ("mixtral", "full", "GPipe", False), ("qwen3_moe", "lora", "1F1B", True),
             ("gpt_oss", "lora", "1F1B", True), ("gpt_oss", "full", "GPipe", False))
    # gpt-oss from its MXFP4-packed checkpoint (experts dequantized as read), 8 steps each (sinks, biases, the clamp);
    # its LoRA adapts the transposed fused experts too (peft target parameters)
    gpt_oss = {"lora": dict(max_steps=8, lora_targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj",
                                                       "down_proj"]), "full": dict(max_steps=8)}
    runs = [dict(run_options(tiny_checkpoint(arch, output_router_logits=True, router_aux_loss_coef=0.5,
                                             **({"mxfp4": True} if arch == "gpt_oss" else {})),
                             tmp_path / f"{arch}-{method}", method, tp=1, pp=2, schedule=schedule, max_memory="2x1GiB",
                             activation_checkpointing=recompute), **(gpt_oss[method] if arch == "gpt_oss" else {}))
            for arch, method, schedule, recompute in cases]
    results = launch("tests.training.cases:finetune_losses", world_size=2, kwargs={"runs": runs}, timeout_s=400)
    probe = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    for run, split_losses in zip(runs, results[0]):
        expected, trained = reference_training(tiny_demo_options(**run))
        assert split_losses == pytest.approx(expected, rel=1e-5), run["model"]
        if run["method"] == "full":  # written as transformers' save_pretrained writes it
            check_saved_experts(Path(run["output_dir"]) / "model", gpt_oss="gpt_oss" in run["model"])
        with torch.no_grad():
            loaded = saved_model(Path(run["output_dir"]), tiny_demo_options(**run))
            assert (loaded(input_ids=probe).logits - trained(input_ids=probe).logits).abs().max() < 1e-4
    assert results[0] == results[-1]


def check_saved_experts(folder: Path, *, gpt_oss: bool) -> None:
    """Mixtral / Qwen3-MoE: each expert's matrices apart, as their checkpoints store them. gpt-oss: fused 16-bit
    experts and no quantization config, as transformers saves the MXFP4 checkpoint it dequantized on load."""
    stored = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    if gpt_oss:
        assert "model.layers.3.mlp.experts.gate_up_proj" in stored and not [k for k in stored if k.endswith("_blocks")]
        assert "quantization_config" not in json.loads((folder / "config.json").read_text())
        return
    assert [k for k in stored if ".layers.3." in k and ".experts.3." in k], folder
    assert not [k for k in stored if "gate_up_proj" in k], folder
