"""`hfsplit plan` end to end on the bundled public configs (no weights, no network)."""
import json
from dataclasses import replace
import re
import subprocess
import sys

import pytest

from hfsplit import Plan, PlanError, TrainingSpec, make_plan
from hfsplit.cli.plan import main
from hfsplit.models.families import valid_tp_degrees
from hfsplit.checkpoint import load_config

GiB = 2**30


def test_plan_fits_uneven_budgets_and_prints_a_table(capsys):
    assert main(["plan", "Qwen/Qwen2.5-14B", "--max-memory", "24GiB,12GiB,12GiB", "--seq-len", "2048"]) == 0
    out = capsys.readouterr().out
    assert "pp=" in out and "bubble" in out
    for device in ("0", "1", "2"):
        assert any(line.split()[1:2] == [device] for line in out.splitlines()[3:])


def test_uneven_budgets_give_the_larger_card_at_least_as_many_layers():
    # checkpointing on device everywhere: where the small cards may offload (auto), time alone balances the layers
    plan = make_plan("Qwen/Qwen2.5-14B", "24GiB,12GiB,12GiB", spec=TrainingSpec(method="lora", seq_len=2048),
                     activation_checkpointing=True, optim="adamw_torch")
    layers = {d: sum(s.num_layers for s in plan.stages if d in s.devices[0]) for d in ("0", "1", "2")}
    if plan.tp == 1 and plan.pp == 3:
        assert layers["0"] >= max(layers["1"], layers["2"])
    for stage in plan.stages:
        assert stage.memory.total <= stage.budget


def test_json_round_trip(capsys):
    assert main(["plan", "meta-llama/Llama-3.1-8B", "--max-memory", "4x16GiB", "--json"]) == 0
    text = capsys.readouterr().out
    plan = Plan.from_json(text)
    assert plan == Plan.from_json(plan.to_json())
    assert json.loads(plan.to_json()) == json.loads(text)
    assert sum(s.num_layers for s in plan.stages) == 32


def test_png_chart(tmp_path):
    png = tmp_path / "plan.png"
    assert main(["plan", "mistralai/Mistral-7B-v0.3", "--max-memory", "2x16GiB", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_infeasible_budget_exits_2_with_per_stage_needs_and_computed_fixes(capsys):
    code = main(["plan", "meta-llama/Llama-3.1-70B", "--max-memory", "2x24GiB", "--full", "--seq-len", "4096"])
    assert code == 2
    err = capsys.readouterr().err
    assert "no split fits" in err and "needs" in err and "over" in err
    assert "devices" in err  # more or larger GPUs is always among the computed fixes here


def test_suggested_fixes_really_fit():
    with pytest.raises(PlanError) as err:
        make_plan("meta-llama/Llama-3.1-8B", "2x24GiB", spec=TrainingSpec(method="full", seq_len=1024))
    message = str(err.value)
    assert "LoRA instead of full" in message
    make_plan("meta-llama/Llama-3.1-8B", "2x24GiB", spec=TrainingSpec(method="lora", seq_len=1024))
    # "N devices of X each" is computed: X fits, and X minus the search's 64 MiB step does not.
    size = re.search(r"2 devices of ([\d.]+) GiB each", message)
    assert size is not None
    make_plan("meta-llama/Llama-3.1-8B", f"2x{size.group(1)}GiB", spec=TrainingSpec(method="full", seq_len=1024))
    with pytest.raises(PlanError):
        smaller = int(float(size.group(1)) * GiB) - 2 * 2**26
        make_plan("meta-llama/Llama-3.1-8B", f"2x{smaller}", spec=TrainingSpec(method="full", seq_len=1024))


def test_head_counts_restrict_tensor_parallel_degree():
    config = load_config("Qwen/Qwen2.5-0.5B")  # 14 heads, 2 kv heads
    assert valid_tp_degrees(config, 8) == [1, 2]
    with pytest.raises(PlanError, match="tp=4 does not divide"):
        make_plan(config, "4x8GiB", tp=4)
    assert make_plan(config, "4x8GiB").tp in (1, 2)


def test_tied_embeddings_single_process_device_map():
    plan = make_plan("Qwen/Qwen2.5-0.5B", {0: "1GiB", 1: "1GiB", "cpu": "64GiB"},
                     spec=TrainingSpec(method="inference", seq_len=512, reserve_bytes=0), tp=1, dp=1)
    device_map = plan.device_map()
    assert plan.tied_embeddings
    assert {f"model.layers.{i}" for i in range(24)} <= set(device_map)
    assert set(device_map.values()) <= {0, 1, "cpu"}
    assert device_map["model.embed_tokens"] == device_map["model.layers.0"]
    assert device_map["lm_head"] == device_map["model.layers.23"] == device_map["model.norm"]
    assert all(s.memory.total <= s.budget for s in plan.stages)


def test_more_stages_than_devices_is_a_clear_error():
    with pytest.raises(PlanError, match="needs 4 devices"):
        make_plan("meta-llama/Llama-3.1-8B", "2x80GiB", pp=4)


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "hfsplit.cli", "plan", "Qwen/Qwen2.5-0.5B", "--max-memory", "1MiB"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "no split fits" in out.stderr


def test_fewer_micro_batches_than_stages_is_refused_with_the_fix_under_a_named_schedule():
    with pytest.raises(PlanError, match="raise --micro-batches to at least 2"):
        make_plan("meta-llama/Llama-3.1-8B", "2x80GiB", pp=2, micro_batches=1, schedule="1F1B")
    assert make_plan("meta-llama/Llama-3.1-8B", "2x80GiB", pp=2, micro_batches=1, schedule="GPipe").pp == 2
    # under auto (the default) the one schedule that runs it
    assert make_plan("meta-llama/Llama-3.1-8B", "2x80GiB", pp=2, micro_batches=1).schedule == "GPipe"


@pytest.mark.parametrize("degrees, world, message", [
    (dict(pp=2), 1, r"pp=2 needs 2 processes but 1 process was launched; launch 2 \(torchrun --nproc_per_node 2\)"),
    (dict(tp=2), 3, r"tp=2 needs a multiple of 2 processes but 3 processes were launched"),
    (dict(tp=1, pp=1, dp=1), 2, r"tp=1 × pp=1 × dp=1 needs 1 processes but 2 processes were launched"),
    (dict(pp=0), 1, r"pp=0: a parallel degree must be at least 1"),
])
def test_forced_degrees_the_launch_cannot_hold_are_refused_naming_the_launch(degrees, world, message):
    with pytest.raises(PlanError, match=message):
        make_plan("meta-llama/Llama-3.1-8B", "4x80GiB", world_size=world, **degrees)
    with pytest.raises(PlanError, match="2 processes were launched but max_memory names 1 device"):
        make_plan("meta-llama/Llama-3.1-8B", "80GiB", world_size=2)


def test_an_architecture_the_proof_refuses_is_refused_before_planning(tmp_path, capsys):
    """Zaya hands its next block state beside the hidden state: the proof on its config refuses it by name, with the
    block that differs, and nothing is planned."""
    from transformers import AutoConfig

    AutoConfig.for_model("zaya").save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path), "--max-memory", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert "model_type 'zaya': its split is refused: the split differs from transformers: block" in err


def test_plan_config_plans_what_the_recipe_runs_and_flags_override_it(tiny_checkpoint, tmp_path, capsys):
    model = tiny_checkpoint("llama")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {model}\nmethod: lora\nlora_r: 4\nseq_len: 64\nmicro_batches: 6\n"
                      "max_memory: 2x1GiB\npp: 2\nschedule: GPipe\nlearning_rate: 0.01\n")
    assert main(["plan", "--config", str(recipe), "--json"]) == 0
    plan = Plan.from_json(capsys.readouterr().out)
    # The recipe's own values; a recipe's budget is the devices' free memory, so no reserve on top.
    assert (plan.spec.method, plan.spec.lora_r, plan.spec.seq_len, plan.micro_batches, plan.schedule) == \
        ("lora", 4, 64, 6, "GPipe")
    assert plan.spec.reserve_bytes == 0 and plan.spec.dtype == "float32"
    assert (plan.pp, plan.tp * plan.dp) == (2, 1)  # a launch of as many ranks as the budget has devices
    assert main(["plan", "--config", str(recipe), "--json", "--seq-len", "32", "--pp", "1", "--full"]) == 0
    plan = Plan.from_json(capsys.readouterr().out)
    assert (plan.spec.method, plan.spec.seq_len, plan.pp, plan.dp) == ("full", 32, 1, 2)


def test_plan_and_the_recipe_share_their_defaults(capsys):
    from hfsplit.training.options import FinetuneOptions

    assert main(["plan", "Qwen/Qwen2.5-0.5B", "--max-memory", "2x8GiB", "--json"]) == 0
    spec = Plan.from_json(capsys.readouterr().out).spec
    recipe = FinetuneOptions()
    assert (spec.lora_r, spec.seq_len, spec.micro_batch_size) == (recipe.lora_r, recipe.seq_len, recipe.micro_batch_size)


@pytest.mark.parametrize("flags", [[], ["--method", "full", "--seq-len", "512", "--micro-batch-size", "2",
                                        "--schedule", "1F1B", "--chunked-loss"]])
def test_plan_of_a_model_is_the_plan_the_recipe_makes_for_it(flags, capsys):
    """`hfsplit plan M --max-memory B ...` and `recipes/finetune.py --model M --max-memory B ...` on GPUs plan the same
    run: the same spec, split, schedule and micro-batches (the recipe then adds its probed speeds and link)."""
    from hfsplit.training.options import parse_options, plan_arguments

    model, budget = "Qwen/Qwen2.5-0.5B", "2x8GiB"
    assert main(["plan", model, "--max-memory", budget, "--json", *flags]) == 0
    planned = Plan.from_json(capsys.readouterr().out)
    recipe = [{"--qlora": "--method=qlora"}.get(f, f) for f in flags]
    options = parse_options(["--model", model, "--max-memory", budget, *recipe])
    ran = make_plan(options.model, options.max_memory, **plan_arguments(options, world_size=2, gpu=True))
    assert planned == ran
    assert planned.spec.dtype == "bfloat16" and planned.spec.reserve_bytes > 0  # planned for GPUs


@pytest.mark.parametrize("argv, message", [
    (["plan", "Qwen/Qwen2.5-0.5B"], "needs MODEL and --max-memory, or --config"),
    (["plan", "--config", "missing.yaml"], "--config missing.yaml: file not found"),
])
def test_plan_without_a_budget_or_recipe_says_what_to_pass(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_run_time_error_keeps_its_own_exit_code(monkeypatch, capsys):
    from hfsplit.cli import plan as cli
    from hfsplit.errors import TrainingFault

    def fails(args):
        raise TrainingFault("it broke")

    monkeypatch.setattr(cli, "run_plan", fails)
    assert cli.main(["plan", "Qwen/Qwen2.5-0.5B", "--max-memory", "2x8GiB"]) == 3


def test_plan_prints_the_schedule_auto_chose_and_each_candidates_step(capsys):
    assert main(["plan", "meta-llama/Llama-3.1-8B", "--max-memory", "4x24GiB", "--pp", "4"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("note: schedule auto chose"))
    chosen = line.split("chose ")[1].split(":")[0]
    assert f"schedule {chosen}" in out
    assert re.search(r"1F1B [\d.]+ ms", line), line
    for name in ("Interleaved1F1B", "ZBVZeroBubble"):  # each timed, or said why not
        assert re.search(rf"{name} [\d.]+ ms", line) or re.search(rf"\(.*{name}.*: nothing fits", line), line
    assert main(["plan", "meta-llama/Llama-3.1-8B", "--max-memory", "4x24GiB", "--pp", "4", "--schedule", "1F1B"]) == 0
    assert "schedule auto" not in capsys.readouterr().out


def test_chunked_loss_flag_plans_a_lighter_last_stage(capsys):
    """`--chunked-loss` reaches the plan, and the head it plans no longer counts a micro-batch's fp32 logits."""
    from hfsplit.planning.costs.model import model_costs

    assert main(["plan", "Qwen/Qwen2.5-0.5B", "--max-memory", "2x8GiB", "--seq-len", "2048", "--qlora",
                 "--micro-batch-size", "1", "--pp", "2", "--json", "--chunked-loss"]) == 0
    plan = Plan.from_json(capsys.readouterr().out)
    assert plan.spec.chunked_loss and "chunked loss" in plan.table()
    config = load_config("Qwen/Qwen2.5-0.5B")
    plain, chunked = (model_costs(config, replace(plan.spec, chunked_loss=c)).head for c in (False, True))
    logits = 2048 * config.vocab_size * 4  # one micro-batch's fp32 logits
    assert plain.activation_bytes - chunked.activation_bytes > logits
    assert chunked.workspace_bytes < plain.workspace_bytes / 4
    assert chunked.flops == pytest.approx(plain.flops * 4 / 3)  # backward recomputes each chunk's logits


def test_plan_of_a_recipe_without_a_budget_plans_what_it_would_run_here_and_says_so(tiny_checkpoint, tmp_path,
                                                                                     capsys):
    import psutil

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {tiny_checkpoint('llama')}\nmethod: lora\nlora_r: 4\nseq_len: 64\n")
    assert main(["plan", "--config", str(recipe), "--json"]) == 0
    plan = Plan.from_json(capsys.readouterr().out)
    share = psutil.virtual_memory().available / 2  # no GPU here: two CPU ranks, each half the free RAM
    assert len({d for s in plan.stages for group in s.devices for d in group}) == 2
    assert all(abs(s.budget - share) < 0.1 * share for s in plan.stages), [s.budget for s in plan.stages]
    assert any(n.startswith("budget: the recipe sets no max_memory, so this plans what it would run here: 2 rank(s)")
               for n in plan.notes), plan.notes
    assert main(["plan", "--config", str(recipe), "--nproc", "1"]) == 0
    assert "plans what it would run here: 1 rank(s)" in capsys.readouterr().out
