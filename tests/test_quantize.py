"""hfsplit.from_pretrained with transformers' BitsAndBytesConfig, in one process, against transformers' own 4-bit load."""
import pytest
import torch


def test_from_pretrained_quantizes_blocks_like_transformers(tiny_checkpoint):
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    import hfsplit
    from hfsplit.quantize import quantization_config

    path = tiny_checkpoint("llama")
    qconfig = quantization_config(compute_dtype="float32")
    ours = hfsplit.from_pretrained(path, max_memory={"cpu": "2GiB"}, dtype=torch.float32, quantization_config=qconfig)
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu", quantization_config=qconfig)
    kinds = lambda m: sorted((n, type(x).__name__) for n, x in m.named_modules() if isinstance(x, torch.nn.Linear))
    assert kinds(ours) == kinds(theirs)
    assert sum(isinstance(x, bnb.nn.Linear4bit) for x in ours.modules()) == 7 * ours.config.num_hidden_layers
    assert ours.is_loaded_in_4bit and ours.hfsplit_plan.spec.method == "qlora"
    probe = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # both in eval mode: the same bitsandbytes CPU kernel
        assert torch.equal(ours(input_ids=probe).logits, theirs(input_ids=probe).logits)
