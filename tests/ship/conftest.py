"""Shared fixtures of the ship tests: 16-bit tiny bases (with the bundled tokenizer) and peft adapters with non-zero B."""
import pytest
import torch


def write_base(folder, arch="llama", **overrides):
    """A bf16 `arch` checkpoint in `folder`, sharded, with the tiny tokenizer and a generation config."""
    from hfsplit.checkpoint.synthetic import tiny_config, tiny_tokenizer, write_checkpoint

    config = tiny_config(arch, num_layers=2, **overrides)
    write_checkpoint(folder, config, dtype=torch.bfloat16, max_shard_size="60KB")
    tiny_tokenizer().save_pretrained(folder)
    return folder


def write_adapter(base, folder, *, seed=1, **lora):
    """A peft LoRA adapter of `base` whose B matrices are random (init_lora_weights=False): a merge that changes
    the weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    config = LoraConfig(init_lora_weights=False, **{"r": 4, "lora_alpha": 8, **lora})
    get_peft_model(model, config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def bf16_llama(tmp_path_factory):
    """(base folder, adapter folder): a bf16 tiny Llama and a LoRA on q, v, down and lm_head."""
    root = tmp_path_factory.mktemp("ship-llama")
    base = write_base(root / "base")
    adapter = write_adapter(base, root / "adapter", target_modules=["q_proj", "v_proj", "down_proj", "lm_head"])
    return base, adapter
