"""A multimodal checkpoint's language model split at pp=2, trained with LoRA and saved (issue 29, item 5): the split
equals the original multimodal class, the adapter loads with peft onto that class and computes what the split
computed, and the merged full weights load with that class, its towers bitwise those of the original."""
import json
from pathlib import Path

import pytest
import torch

from tests.multimodal.checkpoints import multimodal_class

pytestmark = pytest.mark.slow

PROBE = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("kind", ["gemma3", "mistral3", "qwen3_5", "llama4", "gemma4"])
def test_lora_split_saves_what_the_original_class_loads(multimodal, kind, tmp_path):
    from peft import PeftModel

    from hfsplit.ship.merge import merge_adapter
    from tests.parallel.launcher import launch

    folder = multimodal(kind)
    results = launch("tests.multimodal.cases:lora_split_saved", world_size=2, timeout_s=300,
                     kwargs=dict(checkpoint=folder, out_dir=str(tmp_path), probe=PROBE.tolist()))
    run = results[0]
    original = multimodal_class(kind).from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = text_forward(original, kind)(input_ids=PROBE).logits
    torch.testing.assert_close(run["base"], want, rtol=0, atol=1e-5)  # the split is the multimodal text forward
    assert (run["tuned"] - run["base"]).abs().max() > 1e-3  # the adapters moved the logits

    adapter = Path(run["adapter"])
    peft = PeftModel.from_pretrained(multimodal_class(kind).from_pretrained(folder, dtype=torch.float32), adapter)
    adapted = [n for n, _ in peft.named_parameters() if ".lora_A." in n]
    assert adapted and all("language_model" in n for n in adapted), adapted[:3]  # no tower module adapted
    with torch.no_grad():
        adapted_logits = text_forward(peft.eval().base_model.model, kind)(input_ids=PROBE).logits
        torch.testing.assert_close(adapted_logits, run["tuned"], rtol=0, atol=1e-5)
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == folder

    towers = {n: p for n, p in original.state_dict().items() if "language_model" not in n and n != "lm_head.weight"}
    assert towers
    # the split's merged save, and `hfsplit merge BASE ADAPTER OUT` of the saved adapter into the multimodal base
    merge_adapter(folder, adapter, tmp_path / "merged-cli")
    for saved in (run["merged"], tmp_path / "merged-cli"):
        merged = multimodal_class(kind).from_pretrained(saved, dtype=torch.float32).eval()
        with torch.no_grad():
            torch.testing.assert_close(text_forward(merged, kind)(input_ids=PROBE).logits, run["tuned"], rtol=0,
                                       atol=1e-4)
        assert all(torch.equal(merged.state_dict()[n], p) for n, p in towers.items()), saved


def text_forward(model, kind: str):
    """What computes `model`'s logits from input_ids alone: the model itself, but for Llama 4, whose multimodal forward
    fails in transformers 5.24 without images (its output asks its language model's for `image_outputs`): the causal
    LM it holds, loaded (and adapted by peft) inside it."""
    return model.language_model if kind == "llama4" else model
