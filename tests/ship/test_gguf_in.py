"""GGUF in: a folder saved after transformers loaded a GGUF keeps `quantization_config: {quant_method: gguf}` over float
tensors; hfsplit loads it as transformers does."""
import json

import torch

import hfsplit
from hfsplit.ship.gguf_export import export_gguf
from tests.ship.test_gguf import fp16_model


def test_a_folder_labelled_gguf_over_float_tensors_loads_as_transformers_loads_it(tmp_path):
    from transformers import AutoModelForCausalLM

    source, _ = fp16_model(tmp_path / "source", "llama")
    export_gguf(source, source / "model.gguf")
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file="model.gguf")
    # transformers refuses save_pretrained on a GGUF-loaded model: a fresh one takes its weights and config
    fresh = AutoModelForCausalLM.from_config(loaded.config)
    fresh.load_state_dict(loaded.state_dict())
    fresh.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]["quant_method"] == "gguf"
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")(ids).logits
    got = hfsplit.from_pretrained(str(tmp_path / "saved"), max_memory={"cpu": "2GiB"})(ids).logits
    assert torch.equal(expected, got)
