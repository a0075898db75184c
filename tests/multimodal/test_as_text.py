"""Multimodal checkpoints fine-tuned as their language model (issue 29, item 5): hfsplit reads and plans only the
language model's tensors, and its split computes what transformers' multimodal class computes from input_ids."""
import json

import pytest
import torch

from hfsplit.cli import main

KINDS = ["gemma3", "mistral3", "qwen3_5", "llama4", "gemma4"]


@pytest.mark.parametrize("kind", KINDS)
def test_config_is_the_language_models_with_the_classes_tie(multimodal, kind):
    from hfsplit.checkpoint import load_config
    from tests.multimodal.checkpoints import multimodal_class

    config = load_config(multimodal(kind))
    whole = multimodal_class(kind).from_pretrained(multimodal(kind))
    assert config.model_type == whole.config.get_text_config().model_type
    tied = whole.get_output_embeddings().weight is whole.get_input_embeddings().weight
    assert config.tie_word_embeddings == tied


@pytest.mark.parametrize("kind", KINDS)
def test_reader_opens_only_the_language_models_tensors(multimodal, kind):
    """Every name is the text model's; the towers' keys are not in the reader, and their shards are never opened."""
    from hfsplit.checkpoint import CheckpointReader, load_config
    from hfsplit.models.layout import meta_model

    folder = multimodal(kind)
    text = meta_model(load_config(folder))
    with CheckpointReader.open(folder, model=text) as reader:
        assert set(reader.keys()) == set(text.state_dict())
        stored = {reader.checkpoint_name(n) for n in reader.keys()}
    assert not any(tower in key for key in stored for tower in ("vision", "audio", "projector"))
    assert all("language_model" in key for key in stored if not key.startswith("lm_head"))


@pytest.mark.parametrize("kind", KINDS)
def test_plan_counts_only_the_text_weights_and_names_the_towers_left_out(multimodal, kind, tmp_path, capsys):
    """`hfsplit plan` on the multimodal checkpoint plans exactly what it plans for the language model saved alone,
    and says (a field of the plan, a line of its table) which modules it leaves out: every parameter of transformers'
    multimodal class that its language model lacks."""
    from hfsplit.plan import Plan
    from tests.multimodal.checkpoints import multimodal_class, multimodal_config, write_text_only

    text = write_text_only(tmp_path / "text", kind)
    args = ["--max-memory", "2x4GiB", "--pp", "2", "--seq-len", "64"]

    def planned(folder) -> dict:
        assert main(["plan", str(folder), *args, "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        plan.pop("model", None)
        return plan

    mine, alone = planned(multimodal(kind)), planned(text)
    left_out, _ = mine.pop("left_out"), alone.pop("left_out")
    assert mine == alone and _ is None
    with torch.device("meta"):
        whole = multimodal_class(kind)(multimodal_config(kind))
    language = whole.language_model if kind == "llama4" else whole.model.language_model
    assert left_out["checkpoint"] == kind and left_out["modules"]
    assert all("language_model" not in m and whole.get_submodule(m) for m in left_out["modules"])
    inside = {id(p) for p in language.parameters()} | {id(whole.get_output_embeddings().weight)}
    towers = sum(p.numel() for p in whole.parameters() if id(p) not in inside)
    assert left_out["parameters"] == towers > 0
    read = Plan.from_json(json.dumps({**mine, "model": "m", "left_out": left_out})).left_out  # the JSON round trip
    assert (read.checkpoint, read.modules, read.parameters) == (kind, tuple(left_out["modules"]), towers)

    assert main(["plan", multimodal(kind), *args]) == 0
    table = capsys.readouterr().out
    assert f"multimodal {kind} checkpoint: only its language model is planned and trained; " \
           f"{', '.join(left_out['modules'])} (" in table and "copied unchanged on a full save" in table
    assert main(["plan", str(text), *args]) == 0
    assert "multimodal" not in capsys.readouterr().out


@pytest.mark.parametrize("kind", KINDS)
def test_split_equals_the_multimodal_class_text_forward(multimodal, kind):
    """Two stages loaded from the multimodal checkpoint by hfsplit's reader, chained in one process: their logits
    are transformers' multimodal class's given input_ids only (fp32, ≤ 1e-5)."""
    from tests.multimodal.checkpoints import multimodal_class

    folder = multimodal(kind)
    stages = loaded_stages(folder, pp=2)
    whole = multimodal_class(kind).from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    # Llama 4's multimodal forward fails in transformers 5.24 without images (its output asks its language model's
    # for `image_outputs`): its oracle is the causal LM the multimodal class holds, loaded by that class
    oracle = whole.language_model if kind == "llama4" else whole
    with torch.no_grad():
        want = oracle(input_ids=ids).logits
        got = ids
        for stage in stages:
            got = stage(got)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def loaded_stages(folder: str, *, pp: int):
    """`pp` stages of the checkpoint's language model, built as a run builds them and read by hfsplit's reader."""
    from hfsplit.apply.load import load_stages
    from hfsplit.checkpoint import load_config
    from hfsplit.parallel.stage import build_stage_module
    from hfsplit.plan import Stage, StageMemory

    config = load_config(folder)
    n = config.num_hidden_layers
    bounds = [round(i * n / pp) for i in range(pp + 1)]
    stages = [build_stage_module(config=config, tied=config.tie_word_embeddings, stage=Stage(
        index=i, pp_rank=i, devices=(("cpu",),), layers=(bounds[i], bounds[i + 1]), has_embed=i == 0,
        has_head=i == pp - 1, memory=StageMemory(0, 0, 0, 0, 0), budget=0, time_s=0.0)) for i in range(pp)]
    load_stages(stages, source=folder, config=config, device=torch.device("cpu"), dtype=torch.float32, tp_rank=0,
                tp_size=1)
    return [s.eval() for s in stages]


def test_single_process_from_pretrained_is_the_language_model(multimodal):
    """`hfsplit.from_pretrained` (no launch) of a multimodal checkpoint: its language model, read by hfsplit's reader,
    equal to the multimodal class's text forward."""
    import hfsplit
    from tests.multimodal.checkpoints import multimodal_class

    folder = multimodal("gemma3")
    model = hfsplit.from_pretrained(folder, dtype=torch.float32)
    original = multimodal_class("gemma3").from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(input_ids=ids).logits, rtol=0, atol=1e-5)
    assert not any("vision" in name for name, _ in model.named_parameters())


def test_a_missing_language_model_tensor_is_named_and_towers_are_never_needed(multimodal, tmp_path):
    """A checkpoint lacking one of its language model's tensors is refused naming it; one lacking its towers'
    (a language model's share of a multimodal checkpoint) reads, as the towers are never read."""
    import shutil

    from safetensors.torch import load_file, save_file

    from hfsplit.checkpoint import CheckpointReader, load_config
    from hfsplit.errors import CheckpointError
    from hfsplit.models.layout import meta_model

    source = multimodal("gemma3")
    text = meta_model(load_config(source))
    stored = load_file(f"{source}/model.safetensors")
    for name, keep in (("no_layer", lambda k: "layers.3.mlp.up_proj" not in k),
                       ("no_towers", lambda k: "vision" not in k and "projector" not in k)):
        folder = tmp_path / name
        shutil.copytree(source, folder)
        save_file({k: v for k, v in stored.items() if keep(k)}, str(folder / "model.safetensors"))
        if name == "no_layer":
            with pytest.raises(CheckpointError, match="model.layers.3.mlp.up_proj.weight"):
                CheckpointReader.open(folder, model=text)
        else:
            with CheckpointReader.open(folder, model=text) as reader:
                assert set(reader.keys()) == set(text.state_dict())
