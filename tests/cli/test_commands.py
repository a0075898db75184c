"""The CLI as people type it (issue 33, item 5): a quick `--help`, "did you mean" for a mistyped flag, and
`hfsplit plan --help` listing only what changes a plan."""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hfsplit.cli import main
from hfsplit.training.options import PLANNED, FinetuneOptions, options_from, plan_arguments, training_only_flags

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def test_hfsplit_help_loads_no_torch():
    """What made `hfsplit --help` take 3.5 s was importing torch; no time is asserted (a benchmark's job)."""
    code = ("import sys\nfrom hfsplit.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit as e:\n"
            "    assert e.code == 0\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, check=True)
    assert out.stdout.splitlines()[-1] == "False" and "plan" in out.stdout
    run = subprocess.run([sys.executable, "-m", "hfsplit.cli", "--help"], capture_output=True, text=True, env=ENV)
    assert run.returncode == 0 and "accelerate-config" in run.stdout


def heavy_modules_loaded(module: str, argv: list, code: int) -> str:
    """Which of torch and transformers `module.main(argv)` loads in a fresh process (it exits with `code`)."""
    script = (f"import sys\nfrom {module} import main\ntry:\n    code = main({argv!r})\n"
              f"except SystemExit as e:\n    code = e.code\nassert code == {code}, code\n"
              "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()[-1]


@pytest.mark.parametrize("argv, code", [
    (["plan", "--help"], 0),
    (["plan", "Qwen/Qwen2.5-0.5B", "--max-memry", "2GiB"], 2),  # parsed, refused: nothing runs
    # the objectives' names are known without their modules
    (["plan", "Qwen/Qwen2.5-0.5B", "--max-memory", "2GiB", "--objective", "ppo"], 2),
    (["merge", "--help"], 0),
])
def test_plan_help_and_its_flags_load_no_torch_nor_transformers(argv, code):
    """Issue 33: `hfsplit plan` parses every fine-tuning option (the objectives' own too) before torch loads; the
    objectives' modules, the checkpoint package and the planner load when a plan runs."""
    assert heavy_modules_loaded("hfsplit.cli", argv, code) == "[]"


@pytest.mark.parametrize("argv, code", [
    (["--help"], 0),
    (["--model", "Qwen/Qwen2.5-0.5B", "--seq-len", "0"], 2),  # the options built and refused
    (["--model", "Qwen/Qwen2.5-0.5B", "--objective", "dpo", "--micro-batch-size", "3"], 2),  # an objective's rule
    (["--model", "Qwen/Qwen2.5-0.5B", "--objective", "grpo", "--num-generations", "1"], 2),
    (["--learnin-rate", "3"], 2),
])
def test_the_recipe_help_and_its_refusals_load_no_torch_nor_transformers(argv, code):
    """Issue 33: `python -m hfsplit.finetune --help` loaded torch (7 s); building and checking the options (the
    objectives' defaults and refusals included: `OptionRules`) loads none, only a run does."""
    assert heavy_modules_loaded("hfsplit.finetune", argv, code) == "[]"


@pytest.mark.parametrize("entry", [["-m", "hfsplit.finetune"], [str(ROOT / "recipes" / "finetune.py")]],
                         ids=["python -m hfsplit.finetune", "recipes/finetune.py"])
def test_the_recipe_help_as_people_type_it_imports_no_torch(entry):
    """The same, from the command line: `-X importtime` lists every module the process imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", *entry, "--help"], capture_output=True, text=True,
                          env=ENV)
    assert done.returncode == 0 and "--peer-timeout" in done.stdout, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    assert "hfsplit" in imported and not imported & {"torch", "transformers"}, sorted(imported)


@pytest.mark.parametrize("argv, words", [
    (["plan", "Qwen/Qwen2.5-0.5B", "--max-memry", "2GiB"], ["hfsplit plan: unknown flag --max-memry",
                                                           "did you mean --max-memory?"]),
    (["plan", "--seq_len", "64"], ["unknown flag --seq_len", "did you mean --seq-len?"]),
    (["plan", "--lernig-rate", "0.1"], ["did you mean --learning-rate?"]),  # a training flag: taken, so suggested
    (["plan", "--zzz"], ["unknown flag --zzz", "--help lists the options"]),
])
def test_a_mistyped_flag_gets_did_you_mean_in_one_line_and_exit_2(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(word in err for word in words), err


def test_the_recipe_suggests_too(capsys):
    from hfsplit.training.options import parse_options

    with pytest.raises(SystemExit):
        parse_options(["--max-step", "3x"])  # an abbreviation argparse takes, then a bad value
    with pytest.raises(SystemExit) as exit_:
        parse_options(["--learnin-rate", "3"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "finetune: unknown flag --learnin-rate: did you mean --learning-rate? (--help lists the options)"


def test_plan_help_lists_only_what_changes_a_plan_and_names_the_rest(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = capsys.readouterr().out
    listed = {word.strip("[,") for word in text.split() if word.startswith(("--", "[--"))}
    for flag in training_only_flags():
        assert f"  {flag}" not in text  # no entry of its own
        assert flag in text.split("It also takes", 1)[1]  # named once, in the epilog
    for name in PLANNED:
        assert f"--{name.replace('_', '-')}" in listed
    assert len(text.splitlines()) < 205  # was 231 with every training flag (199 before --host-embedding)


def test_plan_takes_a_training_flag_and_plans_the_same(capsys):
    argv = ["plan", "Qwen/Qwen2.5-0.5B", "--max-memory", "2x8GiB", "--json"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main([*argv, "--learning-rate", "0.1", "--save-every", "5", "--output-dir", "/nonexistent"]) == 0
    assert capsys.readouterr().out == plain


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(FinetuneOptions) if f.name not in PLANNED])
def test_an_option_left_out_of_plan_help_changes_no_plan(name):
    """PLANNED is exact: every other option, set away from its default, leaves `make_plan`'s arguments as they were."""
    other = {"tokenizer": "some/tokenizer", "trust_remote_code": True, "eval_every": 7, "beta": 0.3, "dpo_loss": "ipo",
             "merge": True, "learning_rate": 0.5, "warmup_steps": 3, "weight_decay": 0.1, "max_grad_norm": 0.5,
             "max_steps": 9, "epochs": 3, "seed": 5, "output_dir": "elsewhere", "save_every": 2, "save_total_limit": 2,
             "resume": "latest", "on_nonfinite": "stop", "peer_timeout": 9.0, "timeline_step": 3,
             "reward_funcs": ["a.py:f"],
             "reward_weights": [2.0], "temperature": 0.7, "top_p": 0.9, "top_k": 5, "epsilon": 0.3, "epsilon_high": 0.4,
             "num_iterations": 2, "loss_type": "grpo", "scale_rewards": "batch", "max_shard_size": "1GB"}
    base = {"model": "Qwen/Qwen2.5-0.5B", "max_memory": "2x8GiB"}
    planned = plan_arguments(options_from(base), world_size=2, gpu=True)
    assert plan_arguments(options_from({**base, name: other[name]}), world_size=2, gpu=True) == planned


def test_the_readme_quick_start_plan_prints_the_headline_figures(capsys):
    """The first `hfsplit plan` command of the README gives the per-card figures its headline table prints."""
    import re
    import shlex

    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines() if line.startswith("hfsplit plan meta-llama/Llama-3.1-70B"))
    row = next(line for line in readme.splitlines() if line.startswith("| Llama-3.1-70B QLoRA r=16, seq 2048"))
    first, second = re.search(r"\*\*([\d.]+) / ([\d.]+) GiB\*\*", row).groups()
    assert main(shlex.split(command)[1:]) == 0
    table = capsys.readouterr().out
    # one stage a card: its row; two (an interleaved schedule): the line of each device's stages together
    for device, figure in (("0", first), ("1", second)):
        assert re.search(rf"^{device} .* {figure} GiB |: .*\b{device} {figure} GiB of", table, re.M), table
    assert "79063.3 ms" in table and "79.1 s" in row


def test_plan_of_a_tiny_recipe_writes_nothing(tmp_path):
    """It plans the built-in model's config: no checkpoint in the temp folder, the working folder or the home."""
    dirs = {name: tmp_path / name for name in ("tmp", "cwd", "home")}
    for folder in dirs.values():
        folder.mkdir()
    env = {**ENV, "TMPDIR": str(dirs["tmp"]), "HOME": str(dirs["home"]), "HFSPLIT_CACHE": str(tmp_path / "cache")}
    for recipe in ("lora", "dpo"):
        done = subprocess.run([sys.executable, "-m", "hfsplit.cli", "plan", "--config",
                               str(ROOT / "recipes" / "tiny" / f"{recipe}.yaml"), "--max-memory", "2x1GiB"],
                              cwd=dirs["cwd"], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "tiny-llama (llama, 4 layers)" in done.stdout, done.stderr[-2000:]
    # (torch makes its inductor cache folder in the temp folder, empty: torch's, not a write of the plan's)
    written = {name: sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
               for name, folder in dirs.items()}
    assert written == {"tmp": [], "cwd": [], "home": []}, written


def test_an_unknown_hub_name_without_a_hub_fails_at_once_naming_what_answers_offline(tmp_path):
    """No retries: HF_HUB_OFFLINE, or an endpoint that refuses (a machine without network), answer from the cache
    (huggingface_hub logs each retry: none may show; no time is asserted, the benchmark-not-timed-test rule)."""
    for offline in ({"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}):
        env = {**ENV, **offline, "HF_HOME": str(tmp_path / "hf")}
        done = subprocess.run([sys.executable, "-m", "hfsplit.cli", "plan", "no-such-org/no-such-model",
                               "--max-memory", "24GiB"], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr[-2000:]
        assert "no-such-org/no-such-model/config.json: not in the local hub cache" in done.stderr
        assert "meta-llama/Llama-3.1-70B" in done.stderr and "Retrying" not in done.stderr
