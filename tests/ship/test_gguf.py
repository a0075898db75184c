"""`hfsplit export-gguf`: transformers' own GGUF reader is the oracle. It loads the file to the source model's logits
(exactly for f16 of an fp16 model; within a stated bound for bf16, q8_0, q4_0) and rebuilds a tokenizer that encodes
a test text as the original does."""
import subprocess
import sys

import pytest
import torch

from hfsplit.errors import UnsupportedModelError
from hfsplit.ship.gguf_export import export_gguf
from hfsplit.ship.merge import merge_adapter
from tests.ship.bpe import write_bpe_tokenizer
from tests.ship.conftest import write_adapter

TEXT = "Hello world! <|im_start|>user\n Numbers 12345 and ünïcödé, spaces   here.<|im_end|>"
# max |logit difference| / max |logit| measured on these tiny random models: bf16 0.4%, q8_0 1.1%, q4_0 18%
BOUNDS = {"bf16": 0.01, "q8_0": 0.02, "q4_0": 0.25}


# transformers' GGUF reader takes Qwen3's head_dim as 128, Gemma2's soft-caps and query scale and Qwen3-MoE's expert
# width and top-k normalisation at their defaults
READER_DEFAULTS = {"qwen3": dict(head_dim=128), "gemma2": dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                                               query_pre_attn_scalar=256, tied=True),
                   "qwen3_moe": dict(norm_topk_prob=True, moe_intermediate_size=768)}


def fp16_model(folder, arch, split="llama-bpe"):
    """An fp16 tiny `arch` with random norm weights (Gemma's are stored as 1 + w) and a trained byte-level BPE
    tokenizer (the vocabulary a little larger than the tokenizer)."""
    from transformers import AutoModelForCausalLM

    from hfsplit.checkpoint.synthetic import tiny_config

    tokenizer = write_bpe_tokenizer(folder, split=split)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, num_layers=2, vocab=len(tokenizer) + 3,
                                                         **READER_DEFAULTS.get(arch, {})))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0 if arch != "gemma2" else 0.0, 0.1)
    model.to(torch.float16).save_pretrained(folder)
    return folder, tokenizer


def logits(folder, gguf_file=None):
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits


def logits_and_tokenizer(folder, gguf_file=None):
    from transformers import AutoTokenizer

    return logits(folder, gguf_file), AutoTokenizer.from_pretrained(folder, **({"gguf_file": gguf_file} if gguf_file else {}))


@pytest.mark.parametrize("arch, split", [("llama", "llama-bpe"), ("qwen2", "qwen2"), ("qwen3", "qwen2"),
                                         ("mistral", "gpt-2"), ("gemma2", "llama-bpe"),
                                         ("qwen3_moe", "qwen2")])
def test_f16_export_loads_in_transformers_to_equal_logits_and_tokens(tmp_path, arch, split):
    folder, tokenizer = fp16_model(tmp_path / arch, arch, split)
    export_gguf(folder, folder / "model.gguf", tensor_type="f16")
    expected, _ = logits_and_tokenizer(folder)
    got, rebuilt = logits_and_tokenizer(folder, "model.gguf")
    assert torch.equal(expected, got)
    assert rebuilt.encode(TEXT, add_special_tokens=False) == tokenizer.encode(TEXT, add_special_tokens=False)
    assert [p.name for p in folder.glob(".*")] == []  # no temporary file left


@pytest.mark.parametrize("kind", ["bf16", "q8_0", "q4_0"])
def test_quantized_exports_stay_within_their_bound(tmp_path, kind):
    folder, tokenizer = fp16_model(tmp_path / "llama", "llama")
    export_gguf(folder, folder / f"model-{kind}.gguf", tensor_type=kind)
    expected, _ = logits_and_tokenizer(folder)
    got, rebuilt = logits_and_tokenizer(folder, f"model-{kind}.gguf")
    error = ((expected - got).abs().max() / expected.abs().max()).item()
    assert 0 < error <= BOUNDS[kind], error
    assert rebuilt.encode(TEXT, add_special_tokens=False) == tokenizer.encode(TEXT, add_special_tokens=False)


def test_a_merged_folder_exports_to_the_merged_models_logits(tmp_path):
    """merge, then export-gguf through the CLI: the file's logits are peft's merged model's, exactly (f16)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, _ = fp16_model(tmp_path / "base", "llama")
    adapter = write_adapter(base, tmp_path / "adapter", target_modules=["q_proj", "k_proj", "down_proj"])
    merged = merge_adapter(base, adapter, tmp_path / "merged")
    done = subprocess.run([sys.executable, "-m", "hfsplit.cli", "export-gguf", merged, merged / "model.gguf"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float16), adapter)
    reference.merge_and_unload().save_pretrained(tmp_path / "peft-merged")
    assert torch.equal(logits(tmp_path / "peft-merged"), logits(merged, "model.gguf"))


def test_architectures_without_a_proof_are_refused_by_name(tiny_checkpoint, tmp_path):
    with pytest.raises(UnsupportedModelError, match="'phi3' is not exported"):
        export_gguf(tiny_checkpoint("phi3"), tmp_path / "x.gguf")
    with pytest.raises(UnsupportedModelError, match="'gemma2' with .*attn_logit_softcapping"):
        export_gguf(tiny_checkpoint("gemma2"), tmp_path / "x.gguf")  # soft-caps the reader would not read back
    done = subprocess.run([sys.executable, "-m", "hfsplit.cli", "export-gguf", tiny_checkpoint("olmo2"),
                           tmp_path / "x.gguf"], capture_output=True, text=True)
    assert done.returncode == 2 and "hfsplit export-gguf: export-gguf: model type 'olmo2'" in done.stderr
    assert list(tmp_path.iterdir()) == []
