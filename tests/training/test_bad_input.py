"""Every bad input is one line and exit 2 (issue 24): a matrix of what a new user gets wrong.

Each case asserts exit code 2, one `finetune: ...` line naming the culprit and the fix, no traceback, and nothing
written to the output folder (`tests/training/refusals.py`). All but the launcher's run in this process through the
recipe's `main(argv)`; the world-size mismatches run under torchrun.
"""
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from hfsplit.checkpoint.synthetic import shard_files
from hfsplit.training.options import TINY_RECIPE
from tests.training.refusals import assert_recipe_refuses

MARKER = "hfsplit-crafted-pickle-ran"


@pytest.fixture(autouse=True)
def _no_probe(monkeypatch):
    monkeypatch.setenv("HFSPLIT_NO_CALIBRATION", "1")  # refusals need no timing; keeps each case to seconds


def checkpoint_copy(tiny_checkpoint, tmp_path: Path) -> Path:
    """A private copy of the tiny sharded Llama (the session's fixture is shared: never modify it)."""
    return Path(shutil.copytree(tiny_checkpoint("llama"), tmp_path / "ckpt"))


def middle_shard(folder: Path) -> Path:
    shards = shard_files(folder)
    assert len(shards) > 2
    return folder / shards[len(shards) // 2]


def edited_config(folder: Path, **changes) -> Path:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


def model(tiny_checkpoint) -> list[str]:
    return ["--model", str(tiny_checkpoint("llama"))]


# ---------------------------------------------------------------- the cases: (flags, words the line holds)


def missing_shard(tiny_checkpoint, tmp_path):
    folder = checkpoint_copy(tiny_checkpoint, tmp_path)
    shard = middle_shard(folder)
    shard.unlink()
    return ["--model", str(folder)], [shard.name, "not found", "incomplete"]


def truncated_shard(tiny_checkpoint, tmp_path):
    folder = checkpoint_copy(tiny_checkpoint, tmp_path)
    shard = middle_shard(folder)
    os.truncate(shard, shard.stat().st_size // 2)
    return ["--model", str(folder)], [shard.name, "corrupt", "re-download or re-save"]


def config_wider_than_weights(tiny_checkpoint, tmp_path):
    folder = edited_config(checkpoint_copy(tiny_checkpoint, tmp_path), hidden_size=128)
    return ["--model", str(folder)], ["safetensors: tensor", "shape", "config.json disagree"]


def config_deeper_than_weights(tiny_checkpoint, tmp_path):
    folder = edited_config(checkpoint_copy(tiny_checkpoint, tmp_path), num_hidden_layers=6)
    return ["--model", str(folder)], ["model.layers.4.", "lacks", "config.json"]


def unsupported_architecture(tiny_checkpoint, tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("zaya").save_pretrained(tmp_path / "zaya")  # no weights: refused by the proof before any read
    return ["--model", str(tmp_path / "zaya")], [str(tmp_path / "zaya"), "'zaya'", "its split is refused",
                                                  "single process"]


def model_folder_missing(tiny_checkpoint, tmp_path):
    return ["--model", str(tmp_path / "no-such-model")], ["no-such-model", "not a model folder", "config.json"]


def model_folder_without_config(tiny_checkpoint, tmp_path):
    folder = checkpoint_copy(tiny_checkpoint, tmp_path)
    (folder / "config.json").unlink()
    return ["--model", str(folder)], [str(folder), "config.json"]


def dataset_missing(tiny_checkpoint, tmp_path):
    return [*model(tiny_checkpoint), "--dataset", "missing.jsonl"], ["missing.jsonl", "does not exist", "--dataset"]


def dataset_without_columns(tiny_checkpoint, tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"foo": 1}\n{"foo": 2}\n')
    return ([*model(tiny_checkpoint), "--dataset", str(tmp_path / "rows.jsonl")],
            ["rows.jsonl", "['foo']", "'instruction' + 'output'"])


def empty_dataset(tiny_checkpoint, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    return [*model(tiny_checkpoint), "--dataset", str(tmp_path / "empty.jsonl")], ["empty.jsonl", "is empty",
                                                                                    "add examples"]


def dataset_not_utf8(tiny_checkpoint, tmp_path):
    (tmp_path / "latin1.jsonl").write_bytes('{"text": "caf\xe9 cr\xe8me"}\n'.encode("latin-1") * 20)
    return [*model(tiny_checkpoint), "--dataset", str(tmp_path / "latin1.jsonl")], ["latin1.jsonl", "UTF-8"]


def dataset_folder_without_data(tiny_checkpoint, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.md").write_text("nothing to train on\n")
    return [*model(tiny_checkpoint), "--dataset", str(tmp_path / "data")], [str(tmp_path / "data"), "no data files"]


def dataset_malformed_json(tiny_checkpoint, tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{"text": "cut off\n')
    return [*model(tiny_checkpoint), "--dataset", str(tmp_path / "broken.jsonl")], ["broken.jsonl", "fix the file"]


def dataset_format_against_columns(tiny_checkpoint, tmp_path):
    (tmp_path / "alpaca.jsonl").write_text('{"instruction": "a", "output": "b"}\n' * 20)
    return ([*model(tiny_checkpoint), "--dataset", str(tmp_path / "alpaca.jsonl"), "--dataset-format", "chat"],
            ["alpaca.jsonl", "messages"])


def tokenizer_missing(tiny_checkpoint, tmp_path):
    return [*model(tiny_checkpoint), "--tokenizer", str(tmp_path / "no-tokenizer")], ["no-tokenizer",
                                                                                      "no such tokenizer folder"]


def tokenizer_with_remote_code(tiny_checkpoint, tmp_path):
    """A tokenizer folder whose config names code of its own: not run without --trust-remote-code."""
    folder = tmp_path / "custom-tok"
    folder.mkdir()
    (folder / "tokenization_evil.py").write_text(f"open({str(tmp_path / MARKER)!r}, 'w').close()\n"
                                                 "from transformers import PreTrainedTokenizer as EvilTokenizer\n")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}}))
    return [*model(tiny_checkpoint), "--tokenizer", str(folder)], [str(folder), "--trust-remote-code"]


def contradicting_quantization(tiny_checkpoint, tmp_path):
    return ([*model(tiny_checkpoint), "--method", "qlora", "--load-in-8bit", "--bnb-4bit-quant-type", "fp4"],
            ["--load-in-8bit", "--bnb-4bit-quant-type fp4", "drop"])


def lora_target_naming_no_module(tiny_checkpoint, tmp_path):
    return [*model(tiny_checkpoint), "--method", "lora", "--lora-targets", "nonexistent_proj"], ["nonexistent_proj",
                                                                                               "q_proj"]


def lora_target_fused_name(tiny_checkpoint, tmp_path):
    return [*model(tiny_checkpoint), "--method", "lora", "--lora-targets", "qkv_fused"], ["name no module"]


def flags(*extra: str, words: tuple[str, ...], details: bool = False):
    def case(tiny_checkpoint, tmp_path):
        return [*model(tiny_checkpoint), *extra], list(words)
    case.__name__ = " ".join(extra)
    case.details = details
    return case


def resume_missing(tiny_checkpoint, tmp_path):
    return [*model(tiny_checkpoint), "--resume", str(tmp_path / "checkpoint-9")], ["checkpoint-9",
                                                                                  "no complete checkpoint"]


def resume_latest_without_checkpoints(tiny_checkpoint, tmp_path):
    return [*model(tiny_checkpoint), "--resume", "latest"], ["--resume latest", "--save-every"]


def resume_a_model_folder(tiny_checkpoint, tmp_path):
    return [*model(tiny_checkpoint), "--resume", str(tiny_checkpoint("llama"))], ["no complete checkpoint",
                                                                                "trainer_state"]


# ---------------------------------------------------------------- the probe of issue 33: each input kind a user hands
# hfsplit, malformed, empty and written by another run


def written(tmp_path: Path, name: str, text) -> str:
    path = tmp_path / name
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    return str(path)


def recipe_malformed(tiny_checkpoint, tmp_path):
    path = written(tmp_path, "bad.yaml", "seq_len: [1,\n")
    return [*model(tiny_checkpoint), "--config", path], [path, "not valid YAML at line 2", "fix the recipe"]


def recipe_empty(tiny_checkpoint, tmp_path):
    path = written(tmp_path, "empty.yaml", "")
    return [*model(tiny_checkpoint), "--config", path], [path, "the recipe is empty", "drop --config"]


def recipe_not_a_mapping(tiny_checkpoint, tmp_path):
    path = written(tmp_path, "list.yaml", "- seq_len\n- 64\n")
    return [*model(tiny_checkpoint), "--config", path], [path, "mapping of `option: value` lines", "not a list"]


def recipe_not_utf8(tiny_checkpoint, tmp_path):
    path = written(tmp_path, "latin1.yaml", "output_dir: caf\xe9\n".encode("latin-1"))
    return [*model(tiny_checkpoint), "--config", path], [path, "not UTF-8"]


def recipe_value_of_another_type(tiny_checkpoint, tmp_path):
    path = written(tmp_path, "typed.yaml", "seq_len: long\n")
    return [*model(tiny_checkpoint), "--config", path], [path, "seq_len: 'long' is not a number"]


def dataset_parquet_not_parquet(tiny_checkpoint, tmp_path):
    path = written(tmp_path, "rows.parquet", "not a parquet file")
    return [*model(tiny_checkpoint), "--dataset", path], ["rows.parquet", "is not a parquet file", "re-export it"]


def dataset_text_not_strings(tiny_checkpoint, tmp_path):
    path = written(tmp_path, "numbers.json", '[{"text": 1}, {"text": 2}]')
    return [*model(tiny_checkpoint), "--dataset", path], ["numbers.json", "example 0", "'text' holds 1, not text"]


def dataset_of_preference_pairs_for_sft(tiny_checkpoint, tmp_path):
    path = written(tmp_path, "pairs.jsonl", '{"prompt": "a", "chosen": "b", "rejected": "c"}\n' * 20)
    return [*model(tiny_checkpoint), "--dataset", path], ["pairs.jsonl", "cannot tell the dataset format"]


def dataset_of_instructions_for_dpo(tiny_checkpoint, tmp_path):
    path = written(tmp_path, "alpaca.jsonl", '{"instruction": "a", "output": "b"}\n' * 20)
    return ([*model(tiny_checkpoint), "--dataset", path, "--objective", "dpo", "--micro-batch-size", "2"],
            ["alpaca.jsonl", "--objective dpo needs columns prompt, chosen and rejected"])


def model_config_malformed(tiny_checkpoint, tmp_path):
    folder = checkpoint_copy(tiny_checkpoint, tmp_path)
    (folder / "config.json").write_text("{")
    return ["--model", str(folder)], [str(folder / "config.json"), "not a readable config.json"]


def model_index_malformed(tiny_checkpoint, tmp_path):
    folder = checkpoint_copy(tiny_checkpoint, tmp_path)
    (folder / "model.safetensors.index.json").write_text("garbage")
    return ["--model", str(folder)], ["model.safetensors.index.json", "not a readable safetensors index"]


def model_folder_empty(tiny_checkpoint, tmp_path):
    (tmp_path / "empty-model").mkdir()
    return ["--model", str(tmp_path / "empty-model")], ["empty-model", "config.json", "file not found"]


def tokenizer_malformed(tiny_checkpoint, tmp_path):
    folder = checkpoint_copy(tiny_checkpoint, tmp_path)
    (folder / "tokenizer.json").write_text("{bad")
    return [*model(tiny_checkpoint), "--tokenizer", str(folder)], [str(folder), "no tokenizer found", "--tokenizer"]


def tokenizer_folder_empty(tiny_checkpoint, tmp_path):
    (tmp_path / "empty-tokenizer").mkdir()
    return [*model(tiny_checkpoint), "--tokenizer", str(tmp_path / "empty-tokenizer")], ["empty-tokenizer",
                                                                                        "no tokenizer found"]


def tokenizer_of_another_model(tiny_checkpoint, tmp_path):
    """More tokens than the model has embeddings for: the run would index past them mid-step."""
    from hfsplit.checkpoint.synthetic import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens([f"extra{i}" for i in range(400)])
    tokenizer.save_pretrained(tmp_path / "larger-tokenizer")
    path = written(tmp_path, "extra.jsonl", "".join('{"text": "%s"}\n' % " ".join(f"extra{j}" for j in range(i, i + 90))
                                                   for i in range(0, 300, 30)))
    return ([*model(tiny_checkpoint), "--tokenizer", str(tmp_path / "larger-tokenizer"), "--dataset", path],
            ["larger-tokenizer", "beyond", "vocab_size 256", "another model's tokenizer"])


IN_PROCESS_PROBE = [
    recipe_malformed, recipe_empty, recipe_not_a_mapping, recipe_not_utf8, recipe_value_of_another_type,
    dataset_parquet_not_parquet, dataset_text_not_strings, dataset_of_preference_pairs_for_sft,
    dataset_of_instructions_for_dpo, model_config_malformed, model_index_malformed, model_folder_empty,
    tokenizer_malformed, tokenizer_folder_empty, tokenizer_of_another_model,
]


IN_PROCESS = [*IN_PROCESS_PROBE, flags("--max-memory", "", words=("--max-memory is empty", "leave it out"))] + [
    missing_shard, truncated_shard, config_wider_than_weights, config_deeper_than_weights, unsupported_architecture,
    model_folder_missing, model_folder_without_config,
    dataset_missing, dataset_without_columns, empty_dataset, dataset_not_utf8, dataset_folder_without_data,
    dataset_malformed_json, dataset_format_against_columns,
    tokenizer_missing, tokenizer_with_remote_code,
    contradicting_quantization, lora_target_naming_no_module, lora_target_fused_name,
    flags("--seq-len", "100000", words=("--seq-len 100000", "beyond", "max_position_embeddings")),
    flags("--method", "qlora", "--tp", "2", words=("--tp 2 with --method qlora",)),
    flags("--method", "full", "--merge", words=("--merge", "--method lora")),
    flags("--output-dir", "/proc/hfsplit-cannot-write", words=("not writable",)),
    flags("--max-memory", "12potatoes", words=("max_memory", "'12potatoes'", "examples")),
    flags("--max-memory", "0GiB", words=("max_memory", "'0GiB'", "larger than zero")),
    flags("--max-memory", "1MiB", words=("no split fits", "1.00 MiB"), details=True),  # the planner's table follows
    flags("--max-memory", "RTX4080", words=("'RTX4080'", "GPU kinds: RTX3090")),
    flags("--max-memory", "A100", words=("'A100' is ambiguous", "A100-40GB or A100-80GB")),
    flags("--max-memory", "0:1GiB,1GiB", words=("name all",)),
    resume_missing, resume_latest_without_checkpoints, resume_a_model_folder,
]


@pytest.mark.parametrize("bad_input", IN_PROCESS, ids=lambda case: case.__name__)
def test_bad_input_is_one_line_naming_it_and_exit_2_before_any_work(tiny_checkpoint, tmp_path, bad_input):
    argv, words = bad_input(tiny_checkpoint, tmp_path)
    assert_recipe_refuses(tmp_path, argv, words, details=getattr(bad_input, "details", False))
    assert not (tmp_path / MARKER).exists()  # no code of the input's ran


@pytest.mark.slow
@pytest.mark.parametrize("nproc, extra, words", [
    (1, ["--pp", "2"], ("pp=2", "1 process was launched", "--nproc_per_node 2")),
    (1, ["--max-memory", "2x1GiB", "--tp", "2"], ("tp=2", "1 process was launched", "--nproc_per_node 2")),
    (2, [], ("2 processes were launched", "max_memory names 1 device", '"2x1.00GiB"')),
])
def test_a_launch_that_disagrees_with_the_plan_or_budget_is_one_line_and_exit_2(tiny_checkpoint, tmp_path, nproc,
                                                                                extra, words):
    assert_recipe_refuses(tmp_path, [*model(tiny_checkpoint), *extra], list(words), nproc=nproc, launcher=True)


# ---------------------------------------------------------------- resume never runs a checkpoint's code


class Crafted:
    """What a malicious checkpoint would hold: unpickling it runs code (here: creates a marker file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.fixture(scope="module")
def saved_checkpoint(tiny_checkpoint, tmp_path_factory) -> Path:
    """A real checkpoint of two steps of a one-rank run (in this process)."""
    from hfsplit.finetune import main

    out = tmp_path_factory.mktemp("trained") / "run"
    os.environ["HFSPLIT_NO_CALIBRATION"] = "1"
    try:
        code = main(["--config", str(TINY_RECIPE),
                     *model(tiny_checkpoint), "--max-memory", "1GiB", "--max-steps", "3", "--save-every", "2",
                     "--seq-len", "64", "--output-dir", str(out)])
    finally:
        os.environ.pop("HFSPLIT_NO_CALIBRATION", None)
    assert code == 0
    return out / "checkpoint-2"


def planted(saved_checkpoint: Path, tmp_path: Path, relative: str, payload) -> Path:
    """A copy of the checkpoint with `payload` pickled over its file `relative` (the JSON small state removed when the
    pickle takes its place, as an older hfsplit's checkpoint holds)."""
    folder = Path(shutil.copytree(saved_checkpoint, tmp_path / "ckpt" / "checkpoint-2"))
    state = folder / "trainer_state"
    if relative.endswith(".pt"):
        for stale in state.glob("rank00000.*"):
            stale.unlink()
        torch.save({"step": 2, "rng": payload}, state / relative)
    else:
        (state / relative).write_bytes(pickle.dumps(payload))
    return folder


def test_the_trainer_state_is_json_and_safetensors(saved_checkpoint):
    state = saved_checkpoint / "trainer_state"
    small = json.loads((state / "rank00000.json").read_text())["state"]
    assert small["step"] == 2 and small["rng"] == {"__tensor__": "state.rng"} and "last_epoch" in small["scheduler"]
    assert (state / "rank00000.safetensors").is_file() and not list(state.glob("*.pt"))


@pytest.mark.parametrize("relative, words", [
    ("rank00000.pt", ["rank00000.pt", "io.open", "refused"]),  # an older hfsplit's small state, crafted
    ("tensors/.metadata", [".metadata", "io.open", "DCP metadata", "refused"]),  # DCP's own pickle, crafted
])
def test_a_crafted_pickle_in_a_checkpoint_is_refused_never_run(saved_checkpoint, tiny_checkpoint, tmp_path, relative,
                                                               words):
    marker = tmp_path / MARKER
    folder = planted(saved_checkpoint, tmp_path, relative, Crafted(marker))
    pickle.loads(pickle.dumps(Crafted(tmp_path / "control")))  # the payload does run when unpickled plainly
    assert (tmp_path / "control").exists()
    assert_recipe_refuses(tmp_path, [*model(tiny_checkpoint), "--seq-len", "64", "--resume", str(folder)], words)
    assert not marker.exists()


def test_an_older_checkpoints_plain_pickle_still_resumes(saved_checkpoint, tmp_path):
    """A small state pickled by an older hfsplit (tensors, dicts, numbers only) reads under weights_only."""
    from hfsplit.training.resume import small_state_file
    from hfsplit.training.trainer_state import read_small_state

    folder = Path(shutil.copytree(saved_checkpoint, tmp_path / "checkpoint-2"))
    state = read_small_state(small_state_file(folder, 0))
    for stale in (folder / "trainer_state").glob("rank00000.*"):
        stale.unlink()
    torch.save(state, folder / "trainer_state" / "rank00000.pt")
    again = read_small_state(small_state_file(folder, 0))
    assert again["step"] == state["step"] and torch.equal(again["rng"], state["rng"])
    assert again["scheduler"] == state["scheduler"] and again["batches"] == state["batches"]


# ---------------------------------------------------------------- resume folders and adapters: malformed, empty, and
# written by another run (another model, method or LoRA rank); the checkpoint itself is left as it was


def damaged(saved_checkpoint: Path, tmp_path: Path, text: str) -> Path:
    folder = Path(shutil.copytree(saved_checkpoint, tmp_path / "ckpt" / "checkpoint-2"))
    (folder / "trainer_state" / "rank00000.json").write_text(text)
    return folder


@pytest.fixture(scope="module")
def lora_run(tiny_checkpoint, tmp_path_factory) -> Path:
    """The output folder of a two-step LoRA run (r=8) with a checkpoint each step."""
    from hfsplit.finetune import main

    out = tmp_path_factory.mktemp("lora") / "run"
    os.environ["HFSPLIT_NO_CALIBRATION"] = "1"
    try:
        code = main(["--config", str(TINY_RECIPE), *model(tiny_checkpoint), "--method", "lora", "--lora-r", "8",
                     "--max-memory", "1GiB", "--max-steps", "2", "--save-every", "1", "--seq-len", "64",
                     "--output-dir", str(out)])
    finally:
        os.environ.pop("HFSPLIT_NO_CALIBRATION", None)
    assert code == 0
    return out


def test_resume_from_a_malformed_or_empty_trainer_state_is_one_line(saved_checkpoint, tiny_checkpoint, tmp_path):
    for text in ("{garbage", ""):
        folder = damaged(saved_checkpoint, tmp_path / str(len(text)), text)
        before = (folder / "trainer_state" / "rank00000.json").read_text()
        assert_recipe_refuses(tmp_path / str(len(text)), [*model(tiny_checkpoint), "--seq-len", "64", "--resume",
                                                          str(folder)], ["rank00000.json", "unreadable trainer state"])
        assert (folder / "trainer_state" / "rank00000.json").read_text() == before  # left as it was


def test_resume_from_another_models_checkpoint_is_one_line(saved_checkpoint, tiny_checkpoint, tmp_path):
    other = tiny_checkpoint("llama", hidden=32)
    assert_recipe_refuses(tmp_path, ["--model", str(other), "--seq-len", "64", "--resume", str(saved_checkpoint)],
                          [str(saved_checkpoint), "another model or LoRA rank", "[256, 64] there and [256, 32]"])


def test_resume_with_another_method_or_lora_rank_is_one_line(saved_checkpoint, lora_run, tiny_checkpoint, tmp_path):
    flags_ = [*model(tiny_checkpoint), "--seq-len", "64"]
    assert_recipe_refuses(tmp_path, [*flags_, "--method", "lora", "--resume", str(saved_checkpoint)],
                          ["holds no trainer state", "another --method"])  # a full run's checkpoint under LoRA
    assert_recipe_refuses(tmp_path, [*flags_, "--method", "full", "--resume", str(lora_run / "checkpoint-1")],
                          ["holds no trainer state", "another --method"])  # and the other way round
    assert_recipe_refuses(tmp_path, [*flags_, "--method", "lora", "--lora-r", "4", "--resume",
                                     str(lora_run / "checkpoint-1")], ["another model or LoRA rank", "[8, 64] there"])


def test_an_adapter_folder_handed_as_model_or_checkpoint_is_one_line(lora_run, tiny_checkpoint, tmp_path):
    adapter = lora_run / "adapter"
    assert (adapter / "adapter_config.json").is_file()
    assert_recipe_refuses(tmp_path, ["--model", str(adapter)], [str(adapter), "config.json"])
    assert_recipe_refuses(tmp_path, [*model(tiny_checkpoint), "--resume", str(adapter)], ["no complete checkpoint"])
