"""Every input `hfsplit` is handed gets one line and exit 2, naming the input and the fix (issue 33, item 6): the
plan command's own flags, the option combinations it would otherwise drop silently, and the lines a library logs
before the error hfsplit already names."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hfsplit.cli.plan import main
from tests.training.refusals import stderr_lines

ROOT = Path(__file__).resolve().parents[2]
PLAN = ["plan", "Qwen/Qwen2.5-0.5B", "--max-memory", "2x24GiB"]


def refusal(argv: list, capsys) -> str:
    """`hfsplit ARGV`'s one stderr line; it must exit 2 and print nothing else."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's refusals
        code = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, (code, err)
    return err[0]


@pytest.mark.parametrize("flags, words", [
    # were tracebacks (ValueError, ZeroDivisionError) or a plan with a negative speed
    (["--device-speeds", "1,x"], ["--device-speeds '1,x'", "a number above 0 for each device"]),
    (["--device-speeds", "1,0"], ["--device-speeds '1,0'", "above 0"]),
    (["--device-speeds", "1,-1"], ["--device-speeds '1,-1'", "above 0"]),
    (["--device-speeds", "1,nan"], ["above 0"]),
    (["--device-speeds", "1"], ["1 values for 2 devices", "give one each"]),
    # were taken: an empty list planned the default targets; --micro-batches was dropped for the global batch
    (["--lora-targets", ","], ["--lora-targets names no module", "leave it out"]),
    (["--global-batch", "8", "--micro-batches", "2"], ["--global-batch 8 and --micro-batches 2", "give one"]),
])
def test_a_plan_flag_the_planner_cannot_take_is_one_line(flags, words, capsys):
    line = refusal([*PLAN, *flags], capsys)
    assert line.startswith("hfsplit plan: ") and all(word in line for word in words), line


def test_expert_lora_at_a_forced_tp2_is_one_line(tmp_path, capsys):
    """`--lora-targets gate_up_proj --tp 2` on an MoE: one line naming the option, the expert parameter and the fix
    (it failed deep inside peft at the first step: "aten.baddbmm got mixed Tensor and DTensor")."""
    from hfsplit.checkpoint.synthetic import tiny_config

    tiny_config("qwen3_moe").save_pretrained(tmp_path)
    line = refusal(["plan", str(tmp_path / "config.json"), "--max-memory", "2x1GiB", "--method", "lora", "--tp", "2",
                    "--lora-targets", "q_proj,gate_up_proj"], capsys)
    assert line.startswith("hfsplit plan: --lora-targets gate_up_proj at tp=2: ") and "use --tp 1" in line, line
    assert "mlp.experts.gate_up_proj" in line and "leave gate_up_proj out of --lora-targets" in line, line


@pytest.mark.parametrize("argv", [["--max-memory", "-1GiB"], ["--max-memory=-1GiB"], ["--max-memory", "-1"],
                                  ["--max-memory", "24GiB,-1GiB"]])
def test_a_negative_budget_is_one_line_naming_the_option_and_the_fix(argv, capsys):
    """`--max-memory -1GiB` got argparse's "expected one argument" (a value starting with '-' read as a flag)."""
    line = refusal(["plan", "Qwen/Qwen2.5-0.5B", *argv], capsys)
    assert line.startswith("hfsplit plan: max_memory part '-1") and "is negative" in line, line
    assert "give each device a size larger than zero" in line and "expected one argument" not in line, line


def test_a_negative_looking_value_is_joined_only_to_a_flag_that_takes_one():
    from hfsplit.training.options import negative_values_joined

    flags = {"--max-memory", "--learning-rate"}
    assert negative_values_joined(["plan", "m", "--max-memory", "-1GiB", "--learning-rate", "-.5"], flags) == [
        "plan", "m", "--max-memory=-1GiB", "--learning-rate=-.5"]
    assert negative_values_joined(["--merge", "-1GiB", "-v"], flags) == ["--merge", "-1GiB", "-v"]


@pytest.mark.parametrize("nproc", ["0", "-1", "two"])
def test_nproc_is_a_positive_count(nproc, capsys):
    """`--nproc 0` planned, `--nproc -1` asked for a budget of -1 × -22 GB."""
    line = refusal(["plan", "--config", str(ROOT / "recipes" / "tiny" / "lora.yaml"), f"--nproc={nproc}"], capsys)
    assert f"argument --nproc: '{nproc}' is not a whole number of at least 1" in line, line


def test_a_png_path_that_cannot_be_written_is_one_line_and_the_folder_is_checked_first(tmp_path, capsys):
    """A traceback from matplotlib's savefig, after the plan was printed; the missing folder is now refused before
    planning, and a write that fails anyway (the path is a folder here) names --png."""
    missing = tmp_path / "no-such-folder" / "plan.png"
    line = refusal([*PLAN, "--png", str(missing)], capsys)
    assert f"--png {missing}: the folder {missing.parent} does not exist" in line, line
    taken = tmp_path / "taken.png"
    taken.mkdir()
    line = refusal([*PLAN, "--png", str(taken)], capsys)
    assert f"--png {taken}: cannot write it" in line and "a folder you can write" in line, line


def test_a_png_path_without_the_suffix_is_written_where_it_says(tmp_path, capsys):
    """matplotlib appended ".png" to a path without it, while the CLI printed the path it was given."""
    assert main([*PLAN, "--png", str(tmp_path / "chart")]) == 0
    assert capsys.readouterr().err.strip() == f"memory chart: {tmp_path / 'chart'}"
    assert (tmp_path / "chart").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_export_error_names_its_command_once(tiny_checkpoint, tmp_path, capsys):
    """The API's message starts `export-gguf: `, and the CLI printed `hfsplit export-gguf: export-gguf: ...`."""
    model = tiny_checkpoint("llama")
    capsys.readouterr()  # its writer's progress bar
    line = refusal(["export-gguf", str(model), str(tmp_path / "out.gguf")], capsys)
    assert line.startswith("hfsplit export-gguf: ") and "export-gguf: export-gguf" not in line, line
    assert "tokenizer.json is not a byte-level BPE tokenizer" in line, line


@pytest.mark.parametrize("command", [["-m", "hfsplit.cli", *PLAN], ["-m", "hfsplit.finetune", "--max-memory", "1GiB"]],
                         ids=["hfsplit plan", "finetune"])
def test_a_malformed_json_dataset_is_named_once(command, tmp_path):
    """datasets logged "Failed to load JSON from file ... <class 'pyarrow.lib.ArrowInvalid'>" before the error
    hfsplit names in one line (file, row, fix); a logger's record escapes an in-process capture, so a process."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, *command, "--dataset", str(bad), "--output-dir", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    lines = stderr_lines(done.stderr)
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert "Failed to load JSON" not in done.stderr  # (it shared a line with a progress bar, which lines leave out)
    assert f"could not read dataset '{bad}': JSON parse error" in lines[0] and "fix the file" in lines[0], lines


def test_a_step_size_given_as_a_flag_replaces_the_recipes_other_way_of_giving_it(tmp_path, capsys):
    """A recipe's micro_batches under --global-batch (or the reverse) is overridden, as any flag overrides it;
    both in one place are refused."""
    from hfsplit.training.options import parse_options

    recipe = ROOT / "recipes" / "tiny" / "lora.yaml"
    options = parse_options(["--config", str(recipe), "--global-batch", "8"])
    assert (options.global_batch, options.micro_batches) == (8, None)
    both = tmp_path / "both.yaml"
    both.write_text(f"{recipe.read_text()}\nglobal_batch: 8\n")
    assert parse_options(["--config", str(both), "--micro-batches", "2"]).global_batch is None
    line = refusal(["plan", "--config", str(both)], capsys)
    assert "--global-batch 8 and --micro-batches" in line and "give one" in line, line
