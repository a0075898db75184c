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
# max |logit difference| / max |logit| measured on these tiny random models: Llama bf16 0.3%, q8_0 0.9%, q4_0 15%;
# Phi-3 q4_0 17%, LFM2 q8_0 1.2%, Falcon q8_0 0.9%; Qwen2-MoE q8_0 2.0% (a quantized router may pick another expert
# for a near tie, hence its wider bound)
BOUNDS = {"bf16": 0.01, "q8_0": 0.02, "q4_0": 0.25}
MOE_BOUNDS = {"q8_0": 0.04}


# transformers' GGUF reader takes these config values at its defaults (export-gguf refuses a model whose values differ,
# asking the reader itself): the tiny models take them too
READER_DEFAULTS = {
    "qwen3": dict(head_dim=128),
    "gemma2": dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256, tied=True),
    "gemma3_text": dict(query_pre_attn_scalar=256, final_logit_softcapping=None, layer_types=None, rope_parameters=None,
                        tied=True),
    "qwen3_moe": dict(norm_topk_prob=True, moe_intermediate_size=768),
    "qwen2_moe": dict(moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=4),
    "lfm2": dict(num_hidden_layers=2, layer_types=["conv", "full_attention"], intermediate_size=96),
    "nemotron": dict(num_key_value_heads=4),
    "falcon": dict(ffn_hidden_size=256, tied=True),  # the reader ties Falcon's head always; 4 x hidden
}
# Gemma 4 is built whole rather than through tiny_config's shrunk defaults: its __post_init__ derives the layer kinds,
# the full layers' head size and rope from these. The reader reads its widths, heads, eps, window and the full layers'
# head size (global_head_dim, from key_length); everything else at Gemma4TextConfig's defaults, which the tiny model
# keeps: head_dim 256 and the per-layer-input table of 262144 rows x 2 layers x 256 (134M parameters, 256 MiB in f16).
GEMMA4 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              global_head_dim=32, sliding_window=4, max_position_embeddings=512, rms_norm_eps=1e-6,
              layer_types=["sliding_attention", "full_attention"])
# (transformers model_type, the byte-level pre-tokenizer its family's tokenizers use)
ROUND_TRIPS = [("llama", "llama-bpe"), ("qwen2", "qwen2"), ("qwen3", "qwen2"), ("mistral", "gpt-2"),
               ("gemma2", "llama-bpe"), ("qwen3_moe", "qwen2"), ("qwen2_moe", "qwen2"), ("phi3", "gpt-2"),
               ("gemma3_text", "llama-bpe"), ("starcoder2", "gpt-2"), ("lfm2", "llama-bpe"),
               ("minimax_m2", "gpt-2"), ("nemotron", "gpt-2"), ("stablelm", "gpt-2"), ("falcon", "gpt-2")]


def fp16_model(folder, arch, split="llama-bpe", **overrides):
    """An fp16 tiny `arch` with random norm weights (Gemma's are stored as 1 + w) and a trained byte-level BPE
    tokenizer (the vocabulary a little larger than the tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hfsplit.checkpoint.synthetic import tiny_config

    tokenizer = write_bpe_tokenizer(folder, split=split)
    torch.manual_seed(0)
    if arch == "gemma4_text":
        config = AutoConfig.for_model(arch, vocab_size=len(tokenizer) + 3, **{**GEMMA4, **overrides})
    else:
        config = tiny_config(arch, num_layers=2, vocab_size=len(tokenizer) + 3,
                             **{**READER_DEFAULTS.get(arch, {}), **overrides})
    model = AutoModelForCausalLM.from_config(config)
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


@pytest.mark.parametrize("arch, split", ROUND_TRIPS)
def test_f16_export_loads_in_transformers_to_equal_logits_and_tokens(tmp_path, arch, split):
    folder, tokenizer = fp16_model(tmp_path / arch, arch, split)
    export_gguf(folder, folder / "model.gguf", tensor_type="f16")
    expected, _ = logits_and_tokenizer(folder)
    got, rebuilt = logits_and_tokenizer(folder, "model.gguf")
    assert torch.equal(expected, got)
    assert rebuilt.encode(TEXT, add_special_tokens=False) == tokenizer.encode(TEXT, add_special_tokens=False)
    assert [p.name for p in folder.glob(".*")] == []  # no temporary file left


@pytest.mark.parametrize("arch, kind", [("llama", "bf16"), ("llama", "q8_0"), ("llama", "q4_0"), ("qwen2_moe", "q8_0"),
                                        ("lfm2", "q8_0"), ("phi3", "q4_0"), ("falcon", "q8_0")])
def test_quantized_exports_stay_within_their_bound(tmp_path, arch, kind):
    folder, tokenizer = fp16_model(tmp_path / arch, arch)
    export_gguf(folder, folder / f"model-{kind}.gguf", tensor_type=kind)
    expected, _ = logits_and_tokenizer(folder)
    got, rebuilt = logits_and_tokenizer(folder, f"model-{kind}.gguf")
    error = ((expected - got).abs().max() / expected.abs().max()).item()
    print(f"{arch} {kind}: max |logit difference| / max |logit| = {error:.4f}")
    assert 0 < error <= (MOE_BOUNDS if "moe" in arch else BOUNDS)[kind], error
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
    import gguf
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    # why Gemma 3n and Falcon-H1 are refused: the reader has no mapping for them
    read = {key: set(keys.values()) for key, keys in GGUF_CONFIG_MAPPING.items()}
    assert "gemma3n" not in read and "falcon-h1" not in read and "falcon_h1" not in read
    for model_type, gguf_name in [("gemma3n_text", "gemma3n"), ("falcon_h1", "falcon-h1")]:
        assert gguf_name in gguf.MODEL_ARCH_NAMES.values()  # gguf-py declares it: llama.cpp has the layout
        with pytest.raises(UnsupportedModelError, match=f"'{model_type}' is not exported: transformers' GGUF reader"):
            export_gguf(tiny_checkpoint(model_type), tmp_path / "x.gguf")
    done = subprocess.run([sys.executable, "-m", "hfsplit.cli", "export-gguf", tiny_checkpoint("olmo2"),
                           tmp_path / "x.gguf"], capture_output=True, text=True)
    assert done.returncode == 2 and "hfsplit export-gguf: model type 'olmo2'" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_gpt_oss_is_refused_for_the_tensors_the_reader_would_not_load(tiny_checkpoint, tmp_path):
    """The recorded reason, checked against transformers: in a file with llama.cpp's architecture name 'gpt-oss' (its
    GptOssTensorProcessor is registered under 'gpt_oss', and changes no name anyway), the reader maps nothing to the
    fused experts and the experts' down_proj bias, and maps the experts' down_proj and the attention sinks without the
    .weight llama.cpp's converter writes them with: all of them would load uninitialised."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, GptOssTensorProcessor, TensorProcessor,
                                                          get_gguf_hf_weights_map)

    assert gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT_OSS] == "gpt-oss" and "gpt-oss" not in TENSOR_PROCESSORS
    assert not GptOssTensorProcessor.GGUF_MOE_WEIGHTS_PATTERN.match("blk.0.ffn_gate_exps.weight")
    config = AutoConfig.from_pretrained(tiny_checkpoint("gpt_oss"))
    with torch.device("meta"):
        gpt_oss = AutoModelForCausalLM.from_config(config)
    for processor in (TENSOR_PROCESSORS.get("gpt-oss", TensorProcessor)(), GptOssTensorProcessor()):
        mapped = get_gguf_hf_weights_map(gpt_oss, processor)
        unloaded = {f"model.layers.0.mlp.experts.{n}" for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj_bias")}
        assert unloaded.isdisjoint(mapped.values())
        for name in ("blk.0.ffn_down_exps", "blk.0.attn_sinks"):
            assert name in mapped and f"{name}.weight" not in mapped
    with pytest.raises(UnsupportedModelError, match="'gpt_oss' is not exported: transformers' GGUF reader, the proof "
                                                    "of the export, cannot read it back"):
        export_gguf(tiny_checkpoint("gpt_oss"), tmp_path / "x.gguf")


def test_gemma4_is_written_as_llama_cpp_converts_it_and_reads_back_to_equal_logits(tmp_path):
    """Gemma 4 at the reader's defaults (GEMMA4): exact logits and the same tokens through transformers' reader; the
    keys llama.cpp's converter writes beyond those the reader reads hold the model's values; rope_freqs turns plain
    rope over the full layers' heads into the model's own proportional rope (llama.cpp divides each rotary pair's
    frequency by it; transformers' reader skips it and rebuilds proportional rope)."""
    import gguf
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    folder, tokenizer = fp16_model(tmp_path / "gemma4", "gemma4_text")
    export_gguf(folder, folder / "model.gguf")
    expected, _ = logits_and_tokenizer(folder)
    got, rebuilt = logits_and_tokenizer(folder, "model.gguf")
    assert torch.equal(expected, got)
    assert rebuilt.encode(TEXT, add_special_tokens=False) == tokenizer.encode(TEXT, add_special_tokens=False)

    reader = gguf.GGUFReader(folder / "model.gguf")
    keys = {k[len("gemma4."):]: f.contents() for k, f in reader.fields.items() if k.startswith("gemma4.")}
    assert {k: keys[k] for k in ("attention.key_length", "attention.key_length_swa", "rope.dimension_count",
                                 "rope.dimension_count_swa", "rope.freq_base", "rope.freq_base_swa",
                                 "attention.sliding_window_pattern", "attention.shared_kv_layers",
                                 "embedding_length_per_layer_input")} == {
        "attention.key_length": 32, "attention.key_length_swa": 256, "rope.dimension_count": 32,
        "rope.dimension_count_swa": 256, "rope.freq_base": 1e6, "rope.freq_base_swa": 1e4,
        "attention.sliding_window_pattern": [True, False], "attention.shared_kv_layers": 0,
        "embedding_length_per_layer_input": 256}
    names = {t.name for t in reader.tensors}
    assert {"per_layer_token_embd.weight", "blk.1.layer_output_scale.weight"} <= names
    freqs = torch.from_numpy(next(t for t in reader.tensors if t.name == "rope_freqs.weight").data.copy())
    config = AutoConfig.from_pretrained(folder)
    proportional, _ = ROPE_INIT_FUNCTIONS["proportional"](config, layer_type="full_attention")
    plain = 1.0 / (1e6 ** (torch.arange(0, 32, 2).float() / 32))
    assert not torch.allclose(plain, proportional)  # three quarters of the pairs do not rotate
    torch.testing.assert_close(plain / freqs, proportional, rtol=1e-6, atol=1e-29)


def test_a_gemma4_layer_scalar_the_reader_would_leave_at_one_is_refused(tmp_path):
    """transformers' reader maps Gemma 4's layer scalar as blk.N.layer_output_scale while llama.cpp's converter writes
    blk.N.layer_output_scale.weight: the reader leaves it at its initial 1, so a model whose scalars differ is
    refused, naming the tensor."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    small = dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=64)
    folder, _ = fp16_model(tmp_path / "gemma4", "gemma4_text", **small)
    with torch.device("meta"):
        mapped = get_gguf_hf_weights_map(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)),
                                         TensorProcessor())
    assert mapped["blk.0.layer_output_scale"] == "model.layers.0.layer_scalar"
    assert "blk.0.layer_output_scale.weight" not in mapped
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.layer_scalar"] = torch.tensor([0.5], dtype=torch.float16)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"layers.0.layer_scalar of 'gemma4_text' is not 1 \(\[0.5\]\)"):
        export_gguf(folder, folder / "x.gguf")
    assert not list(folder.glob("*.gguf"))


def test_config_values_the_reader_would_not_read_back_are_refused(tmp_path):
    """transformers' reader takes Gemma 2's soft-caps at 50 and 30, Qwen2-MoE's expert width at 1408 and Gemma 4's
    per-layer-input width at 256: other values are refused, naming the model's value and the one the reader would
    rebuild."""
    folder, _ = fp16_model(tmp_path / "gemma2", "gemma2", attn_logit_softcapping=20.0)
    with pytest.raises(UnsupportedModelError, match=r"'gemma2' .*'attn_logit_softcapping': \(20.0, 50.0\)"):
        export_gguf(folder, folder / "x.gguf")
    folder, _ = fp16_model(tmp_path / "qwen2_moe", "qwen2_moe", moe_intermediate_size=64)
    with pytest.raises(UnsupportedModelError, match=r"'moe_intermediate_size': \(64, 1408\)"):
        export_gguf(folder, folder / "x.gguf")
    # Gemma 4: the reader reads no per-layer-input width (nor head_dim, soft-cap, KV sharing, ...)
    small = dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=64)
    folder, _ = fp16_model(tmp_path / "gemma4", "gemma4_text", **small)
    with pytest.raises(UnsupportedModelError, match=r"'gemma4_text' .*'hidden_size_per_layer_input': \(8, 256\)"):
        export_gguf(folder, folder / "x.gguf")
    # and its keys shared with values, whose full layers' key/value head count differs from the sliding layers'
    folder, _ = fp16_model(tmp_path / "gemma4_kv", "gemma4_text", attention_k_eq_v=True, num_global_key_value_heads=2,
                           **small)
    with pytest.raises(UnsupportedModelError, match=r"'attention_k_eq_v': \(True, False\)"):
        export_gguf(folder, folder / "x.gguf")
    assert [p.name for p in tmp_path.glob("*/*.gguf")] == []


def test_values_only_training_reads_do_not_stop_an_export(tmp_path):
    """Dropout, initialisation and a sliding-window layer count without a sliding window change no logit: exported."""
    folder, _ = fp16_model(tmp_path / "qwen2", "qwen2", initializer_range=0.01, attention_dropout=0.1,
                           max_window_layers=1)
    export_gguf(folder, folder / "model.gguf")
    assert torch.equal(logits(folder), logits(folder, "model.gguf"))


def test_llama3_rope_scaling_travels_in_rope_freqs_as_llama_cpp_reads_it(tmp_path):
    """Llama 3's rope scaling: llama.cpp divides each rotary pair's plain frequency by the file's rope_freqs, which
    transformers' reader skips (it rebuilds plain rope). So the proof is in two parts: the reader loads the file to
    the logits of the source model with plain rope, exactly; and plain frequency / rope_freqs is the source model's own
    Llama 3 inverse frequency."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM

    llama3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=64)
    folder, _ = fp16_model(tmp_path / "llama3", "llama", rope_parameters=llama3)
    export_gguf(folder, folder / "model.gguf")
    plain = AutoConfig.from_pretrained(folder)
    plain.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    (tmp_path / "plain").mkdir()
    plain.save_pretrained(tmp_path / "plain")
    for f in folder.glob("*.safetensors"):
        (tmp_path / "plain" / f.name).symlink_to(f)
    assert torch.equal(logits(tmp_path / "plain"), logits(folder, "model.gguf"))

    freqs = next(t for t in gguf.GGUFReader(folder / "model.gguf").tensors if t.name == "rope_freqs.weight")
    scaled = AutoModelForCausalLM.from_pretrained(folder).model.rotary_emb.inv_freq
    plain_freq = AutoModelForCausalLM.from_pretrained(tmp_path / "plain").model.rotary_emb.inv_freq
    assert not torch.allclose(plain_freq, scaled)  # the scaling is there to carry
    torch.testing.assert_close(plain_freq / torch.from_numpy(freqs.data.copy()), scaled, rtol=1e-6, atol=0)


def test_other_rope_scaling_is_refused_in_one_line(tmp_path):
    folder, _ = fp16_model(tmp_path / "linear", "llama", rope_parameters=dict(rope_type="linear", factor=2.0,
                                                                              rope_theta=10000.0))
    done = subprocess.run([sys.executable, "-m", "hfsplit.cli", "export-gguf", folder, folder / "x.gguf"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "rope scaling 'linear' of 'llama' is not exported yet" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not list(folder.glob("*.gguf"))


def test_a_sentencepiece_tokenizer_without_tokenizer_json_is_refused_naming_the_fix(tmp_path):
    folder, _ = fp16_model(tmp_path / "spm", "llama")
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.model").write_bytes(b"a SentencePiece model")
    done = subprocess.run([sys.executable, "-m", "hfsplit.cli", "export-gguf", folder, folder / "x.gguf"],
                          capture_output=True, text=True)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "is a SentencePiece tokenizer without tokenizer.json" in done.stderr
    assert "convert_hf_to_gguf.py" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not list(folder.glob("*.gguf"))


def test_falcon_is_written_as_llama_cpp_runs_multi_query_attention(tmp_path):
    """Falcon-7B's multi-query layout: one key/value head in the file's keys (llama.cpp splits attn_qkv into
    n_head + 2 x n_head_kv heads by them), attn_qkv the checkpoint's query_key_value unchanged ([q heads; k; v] is
    llama.cpp's order when there is one group); grouped-query Falcon is refused naming what the reader would rebuild."""
    import gguf
    from safetensors import safe_open

    import inspect

    from transformers.models.falcon import modeling_falcon

    # Falcon-7B's published config still carries a Bloom switch that transformers' Falcon does not read
    assert "apply_residual_connection_post_layernorm" not in inspect.getsource(modeling_falcon)
    folder, _ = fp16_model(tmp_path / "falcon", "falcon", apply_residual_connection_post_layernorm=False)
    export_gguf(folder, folder / "model.gguf")
    reader = gguf.GGUFReader(folder / "model.gguf")
    assert reader.fields["falcon.attention.head_count_kv"].contents() == 1
    assert reader.fields["falcon.attention.layer_norm_epsilon"].contents() == pytest.approx(1e-5)
    qkv = next(t for t in reader.tensors if t.name == "blk.0.attn_qkv.weight")
    with safe_open(folder / "model.safetensors", "pt") as f:
        source = f.get_tensor("transformer.h.0.self_attention.query_key_value.weight")
    assert torch.equal(torch.from_numpy(qkv.data.copy()), source)

    folder, _ = fp16_model(tmp_path / "falcon40b", "falcon", new_decoder_architecture=True, num_kv_heads=2)
    with pytest.raises(UnsupportedModelError, match=r"'new_decoder_architecture': \(True, False\)"):
        export_gguf(folder, folder / "x.gguf")
