"""`hfsplit merge`: equal to peft's merge_and_unload (bitwise in the saved dtype), sharded, atomic, refusing bad input."""
import json
import subprocess
import sys

import pytest
import torch

from hfsplit.errors import CheckpointError
from hfsplit.ship.merge import merge_adapter
from tests.ship.conftest import write_adapter, write_base


def peft_merged(base, adapter, **load):
    """peft's own merge: the oracle."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16, **load)
    if getattr(model, "is_quantized", False):
        model = model.dequantize()  # as peft merges a 4-bit base: in 16 bits, after dequantizing
    return PeftModel.from_pretrained(model, adapter).merge_and_unload().state_dict()


def loaded(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).state_dict()


def assert_bitwise(expected, got, base):
    assert set(expected) == set(got)
    differ = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not differ, differ[:5]
    changed = [k for k in expected if not torch.equal(expected[k], base[k])]
    assert changed  # the adapter did change the weights it targets


def test_merge_equals_peft_bitwise_on_a_bf16_llama_in_shards_with_tokenizer(bf16_llama, tmp_path):
    base, adapter = bf16_llama
    out = merge_adapter(base, adapter, tmp_path / "merged", max_shard_size="100KB")
    assert_bitwise(peft_merged(base, adapter), loaded(out), loaded(base))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).stat().st_size <= 100_000 + 4096 for s in shards)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]  # no temporary folder left


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_merge_moe_fused_experts_with_expert_parameter_lora_equals_peft(tmp_path, arch):
    """Qwen3-MoE: checkpoint experts one by one, the model's fused (out, in); gpt-oss: fused and transposed
    (in, out). LoRA on q_proj and on both expert parameters."""
    base = write_base(tmp_path / "base", arch)
    adapter = write_adapter(base, tmp_path / "adapter", target_modules=["q_proj"],
                            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    out = merge_adapter(base, adapter, tmp_path / "merged")
    assert_bitwise(peft_merged(base, adapter), loaded(out), loaded(base))
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:  # written as save_pretrained writes them
        stored = "experts.3.gate_proj.weight" if arch == "qwen3_moe" else "experts.gate_up_proj"
        assert f"model.layers.0.mlp.{stored}" in f.keys()


@pytest.mark.parametrize("bits", [4, 8])
def test_merge_into_a_bitsandbytes_base_equals_peft_after_dequantizing(bf16_llama, tmp_path, bits):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    base, adapter = bf16_llama
    quantization = (BitsAndBytesConfig(load_in_8bit=True) if bits == 8 else
                    BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                       bnb_4bit_compute_dtype=torch.bfloat16))
    quantized = tmp_path / f"base-{bits}bit"
    AutoModelForCausalLM.from_pretrained(base, quantization_config=quantization, device_map="cpu",
                                         dtype=torch.bfloat16).save_pretrained(quantized)
    out = merge_adapter(quantized, adapter, tmp_path / "merged")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    expected = peft_merged(quantized, adapter, device_map="cpu")
    got = loaded(out)
    assert set(expected) == set(got)
    assert not [k for k in expected if not torch.equal(expected[k], got[k])]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "hfsplit.cli", *map(str, args)], capture_output=True, text=True)


def test_the_cli_merges_and_refuses_bad_input_in_one_line_with_exit_2(bf16_llama, tmp_path):
    base, adapter = bf16_llama
    done = run_cli("merge", base, adapter, tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()
    other = write_adapter(write_base(tmp_path / "wide", hidden=96), tmp_path / "wide-adapter", target_modules=["q_proj"])
    (tmp_path / "no-config").mkdir()
    cases = {
        "no adapter_config.json": (base, tmp_path / "no-config"),
        "trained on another model": (base, other),
        "not a model folder": (tmp_path / "missing", adapter),
    }
    for expected, (b, a) in cases.items():
        failed = run_cli("merge", b, a, tmp_path / "bad")
        lines = [line for line in failed.stderr.splitlines() if line.startswith("hfsplit merge:")]
        assert failed.returncode == 2 and len(lines) == 1 and expected in lines[0], failed.stderr
        assert not (tmp_path / "bad").exists()
    with pytest.raises(CheckpointError, match="another model"):
        merge_adapter(base, other, tmp_path / "bad")


def test_a_hub_name_base_merges_through_the_hub_cache(bf16_llama, tmp_path):
    """BASE as `org/name`, resolved offline through huggingface_hub's own cache lookup."""
    import os

    from hfsplit.checkpoint.synthetic import write_hub_cache

    base, adapter = bf16_llama
    write_hub_cache(tmp_path / "hub", "someone/tiny-llama", base)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "hfsplit.cli", "merge", "someone/tiny-llama", adapter,
                           tmp_path / "out"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_bitwise(peft_merged(base, adapter), loaded(tmp_path / "out"), loaded(base))
    assert (tmp_path / "out" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_merge_on_at_the_end_of_training_streams_shards_of_max_shard_size(tiny_checkpoint, tmp_path):
    """A LoRA run with --merge and --max-shard-size 40KB (one rank, no launcher): merged/ is shards of at most 40 KB
    (a larger tensor alone), its index, and a model transformers loads."""
    import os
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT")}
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(root / "recipes" / "finetune.py"), "--model", tiny_checkpoint("llama"),
                           "--method", "lora", "--merge", "--max-shard-size", "40KB", "--max-memory", "1GiB",
                           "--max-steps", "2", "--seq-len", "64", "--global-batch", "2", "--output-dir", out],
                          capture_output=True, text=True, env={**env, "PYTHONPATH": str(root)}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    index = json.loads((out / "merged" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    held = {s: [k for k, v in index["weight_map"].items() if v == s] for s in shards}
    # at most 40 KB of tensors a shard, or one tensor larger than that alone (as save_pretrained shards)
    assert len(shards) > 2 and all((out / "merged" / s).stat().st_size <= 40_000 + 8192 or len(held[s]) == 1
                                   for s in shards)
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert set(merged.state_dict()) >= set(index["weight_map"])
