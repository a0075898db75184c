"""Recipe options: YAML recipe, flags overriding it, and the refusals."""
from pathlib import Path

import pytest

from hfsplit.errors import HfsplitError
from hfsplit.training.options import (ACCELERATE_CPU_CONFIG, TINY_RECIPE, FinetuneOptions, parse_options,
                                      tiny_demo_options)


def test_flags_override_the_yaml_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: lora\nlora-r: 4\nmax_steps: 7\nlora_targets: [q_proj, v_proj]\n")
    options = parse_options(["--config", str(recipe), "--max-steps", "9", "--seq-len", "32"])
    assert (options.method, options.lora_r, options.max_steps, options.seq_len) == ("lora", 4, 9, 32)
    assert options.lora_targets == ["q_proj", "v_proj"]


def test_bare_flags_mean_the_obvious():
    assert parse_options(["--resume"]).resume == "latest"
    assert parse_options(["--resume", "runs/x/checkpoint-6"]).resume == "runs/x/checkpoint-6"
    assert parse_options(["--method", "lora", "--merge"]).merge is True
    assert parse_options(["--method", "lora", "--merge", "off"]).merge is False
    assert parse_options([]) == tiny_demo_options()  # no flags: the built-in default


@pytest.mark.parametrize("argv, message", [
    (["--on-nonfinite", "ignore"], "choose skip or stop"),
    (["--merge"], "needs --method lora"),
    (["--peer-timeout", "0"], "positive number of seconds"),
    (["--method", "dora"], "choose lora, qlora or full"),
    (["--max-steps", "0"], "--max-steps must be at least 1"),
    (["--lora-r", "0"], "--lora-r must be at least 1"),
    (["--learning-rate", "-1"], "--learning-rate must be a finite number above 0"),
    (["--learning-rate", "nan"], "--learning-rate must be a finite number above 0"),
    (["--learning-rate", "inf"], "--learning-rate must be a finite number above 0"),
    (["--warmup-steps", "-1"], "--warmup-steps must be a finite number at least 0"),
    (["--eval-every", "0"], "--eval-every must be at least 1"),
    (["--save-every", "-2"], "--save-every must be at least 1"),
    (["--global-batch", "0"], "--global-batch must be at least 1"),
    (["--lora-dropout", "1.5"], "--lora-dropout must be a finite number at least 0 and at most 1"),
    (["--packing", "yes"], "--packing 'yes': choose auto, on or off"),
])
def test_bad_options_are_refused_by_name(argv, message):
    with pytest.raises(HfsplitError, match=message):
        parse_options(argv)


def test_an_unknown_yaml_key_is_named(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rat: 1e-4\n")
    with pytest.raises(HfsplitError, match=r"unknown option\(s\) learning_rat"):
        parse_options(["--config", str(recipe)])


def test_a_switch_given_as_a_string_in_python_is_refused_not_taken_as_on(tmp_path):

    with pytest.raises(HfsplitError, match=r"--activation-checkpointing is on or off .* got 'off'"):
        FinetuneOptions(activation_checkpointing="off").validate()
    recipe = tmp_path / "r.yaml"
    recipe.write_text("activation_checkpointing: off\nchunked_loss: 'no'\n")  # YAML 1.1: off is False, 'no' a string
    with pytest.raises(HfsplitError, match=r"--chunked-loss is on or off .* got 'no'"):
        parse_options(["--config", str(recipe)])
    FinetuneOptions(activation_checkpointing=True).validate()


@pytest.mark.parametrize("given, planned", [
    ([], "auto"), (["--activation-checkpointing"], True), (["--activation-checkpointing", "off"], False),
    (["--activation-checkpointing", "True"], True), (["--activation-checkpointing", "offload"], "offload"),
    (["--activation-checkpointing", "auto"], "auto"),
])
def test_activation_checkpointing_keeps_its_boolean_spellings_and_takes_offload(tmp_path, given, planned):
    """Today's spellings (on/off, True/False, a bare flag, YAML booleans) mean what they did; offload and auto
    are new; unset leaves the choice to the planner, and what the user fixes the plan honours."""
    from hfsplit.plan import TrainingSpec
    from hfsplit.training.options import plan_arguments

    arguments = plan_arguments(parse_options(["--model", "org/name"] + given), world_size=2)  # (no tiny demo recipe)
    assert arguments["activation_checkpointing"] == planned
    fixed = TrainingSpec(activation_checkpointing=planned if planned != "auto" else False).activation_checkpointing
    assert arguments["spec"].activation_checkpointing == fixed  # on/off stay booleans in the spec
    recipe = tmp_path / "r.yaml"
    recipe.write_text("activation_checkpointing: on\noptim: adamw_8bit\n")  # YAML 1.1: on is True
    arguments = plan_arguments(parse_options(["--config", str(recipe), "--model", "org/name"]), world_size=2)
    assert (arguments["activation_checkpointing"], arguments["optim"]) == (True, "adamw_8bit")
    assert arguments["spec"].optim == "adamw_8bit"
    with pytest.raises(HfsplitError, match=r"--activation-checkpointing is on or off .* or 'auto' or 'offload'; "
                                           r"got 'sometimes'"):
        FinetuneOptions(activation_checkpointing="sometimes").validate()
    with pytest.raises(HfsplitError, match=r"--optim 'adamw_4bit': choose auto, adamw_torch, adamw_8bit"):
        parse_options(["--optim", "adamw_4bit"])


def test_warmup_zero_and_unset_intervals_are_valid():
    options = parse_options(["--warmup-steps", "0"])
    assert (options.warmup_steps, options.eval_every, options.save_every) == (0, None, None)


def test_a_yaml_number_without_a_dot_is_a_number(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 1e-4\n")  # YAML 1.1 reads this as a string
    assert parse_options(["--config", str(recipe)]).learning_rate == 1e-4


@pytest.mark.parametrize("argv, culprit", [
    (["--lora-r", "0"], "--lora-r"), (["--learning-rate", "-1"], "--learning-rate"),
    (["--warmup-steps", "-1"], "--warmup-steps"), (["--eval-every", "0"], "--eval-every"),
])
def test_the_recipe_refuses_bad_options_with_one_line_and_exit_2(argv, culprit, tmp_path, capsys):
    import runpy
    from pathlib import Path

    main = runpy.run_path(str(Path(__file__).resolve().parents[2] / "recipes" / "finetune.py"))["main"]
    assert main(argv + ["--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("finetune: " + culprit), err
    assert not (tmp_path / "out").exists()  # refused before any work


def test_a_global_batch_is_cut_by_the_planner_under_auto_and_kept_whole_otherwise():
    from hfsplit.training.options import plan_arguments

    auto = plan_arguments(parse_options(["--global-batch", "16"]), world_size=2)
    fixed = plan_arguments(parse_options(["--global-batch", "16", "--schedule", "1F1B"]), world_size=2)
    count = plan_arguments(parse_options(["--micro-batches", "6"]), world_size=2)
    assert (auto["micro_batches"], auto["global_batch"]) == ("auto", 16)
    assert (fixed["micro_batches"], fixed["global_batch"]) == (None, 16)
    assert count["micro_batches"] == 6 and "global_batch" not in count


def _option_actions(parser):
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def test_every_option_of_the_recipe_and_of_hfsplit_plan_has_help_with_its_default():
    import argparse

    from hfsplit.cli.plan import plan_parser
    from hfsplit.training.options import GROUPS, options_parser

    plan = plan_parser(argparse.ArgumentParser().add_subparsers())
    for parser in (options_parser(), plan):
        actions = [a for a in _option_actions(parser) if a.help != argparse.SUPPRESS]  # plan lists what plans
        assert len(actions) >= 30
        bare = [a.option_strings[0] for a in actions if not a.help or not ("(default: " in a.help or "unset:" in a.help
                                                                            or a.const is not None)]
        assert not bare, f"options without help or default: {bare}"
        titles = [g.title for g in parser._action_groups]
        groups = [t for t in titles if t.endswith(" options") and t.split()[0] in GROUPS]
        assert groups == [f"{g} options" for g in GROUPS if f"{g} options" in groups]  # in the data flow's order
        assert len(groups) >= 5
    assert {a.dest for a in _option_actions(options_parser())} <= {a.dest for a in _option_actions(plan)}


def test_the_schedule_choices_are_the_schedule_table():
    import dataclasses

    from hfsplit.schedules import TABLE
    from hfsplit.training.options import _choices_of

    schedule = next(f for f in dataclasses.fields(FinetuneOptions) if f.name == "schedule")
    assert set(_choices_of(schedule)) == {"auto", *TABLE}


def test_one_set_of_defaults_for_real_models_and_the_tiny_demo_keeps_its_own():
    real = parse_options(["--model", "Qwen/Qwen2.5-0.5B"])
    assert (real.method, real.seq_len, real.micro_batch_size, real.lora_r, real.activation_checkpointing) == \
        ("lora", 2048, 1, 16, "auto")
    assert real == FinetuneOptions(model="Qwen/Qwen2.5-0.5B") and real.output_dir == "runs/Qwen2.5-0.5B"
    demo = parse_options([])
    assert (demo.method, demo.seq_len, demo.micro_batch_size, demo.max_steps, demo.output_dir) == \
        ("full", 128, 2, 200, "runs/tiny")
    assert parse_options(["--seq-len", "64"]).seq_len == 64  # flags still win over the demo's recipe


RECIPES = sorted(p for p in {*Path(__file__).parents[2].glob("recipes/**/*.yaml"), TINY_RECIPE}
                 if p.name != ACCELERATE_CPU_CONFIG.name)  # the launcher's config, not a recipe


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.parent.name + "/" + p.name)
def test_every_bundled_recipe_packs_by_default_and_packing_off_turns_it_off(recipe):
    """Issue 20: the bundled recipes (instruction or chat data) pack unless told; the README's `--packing off`
    turns it off, in the plan's spec too."""
    from hfsplit.training.options import packing_of, training_spec

    assert recipe.name != "accelerate_cpu.yaml" and len(RECIPES) >= 4
    options = parse_options(["--config", str(recipe)])
    if options.objective in ("dpo", "grpo"):  # DPO's pairs are padded rows, two per example (issue 23); GRPO trains
        assert not packing_of(options) and not training_spec(options).packing  # one completion a row (issue 31)
        return
    assert options.packing == "auto" and packing_of(options) and training_spec(options).packing
    off = parse_options(["--config", str(recipe), "--packing", "off"])
    assert not packing_of(off) and not training_spec(off).packing


def test_packing_follows_the_format_unless_told(tmp_path):
    """auto: instruction and chat pack, text keeps its blocks (the format read from the columns when not given);
    the plan's spec says what the run does."""
    from hfsplit.training.options import packing_of, training_spec

    text = tmp_path / "t.jsonl"
    text.write_text('{"text": "a b c"}\n')
    assert packing_of(parse_options([])) and training_spec(parse_options([])).packing  # the bundled alpaca set
    assert not packing_of(parse_options(["--dataset", str(text)]))
    assert packing_of(parse_options(["--dataset", str(text), "--packing", "on"]))
    assert not packing_of(parse_options(["--packing", "off"]))
    assert not training_spec(parse_options(["--packing", "off"])).packing
    assert packing_of(parse_options(["--dataset", str(text), "--dataset-format", "chat"]))
