"""Recipe options: YAML recipe, flags overriding it, and the refusals."""
import pytest

from hfsplit.errors import HfsplitError
from hfsplit.training.options import FinetuneOptions, parse_options


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
    assert parse_options([]) == FinetuneOptions()  # no flags: the built-in default


@pytest.mark.parametrize("argv, message", [
    (["--on-nonfinite", "ignore"], "choose skip or stop"),
    (["--merge"], "needs --method lora"),
    (["--peer-timeout", "0"], "positive number of seconds"),
    (["--method", "dora"], "choose lora, qlora or full"),
    (["--max-steps", "0"], "--max-steps must be at least 1"),
])
def test_bad_options_are_refused_by_name(argv, message):
    with pytest.raises(HfsplitError, match=message):
        parse_options(argv)


def test_an_unknown_yaml_key_is_named(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rat: 1e-4\n")
    with pytest.raises(HfsplitError, match=r"unknown option\(s\) learning_rat"):
        parse_options(["--config", str(recipe)])
