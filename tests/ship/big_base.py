"""A Llama base of about 1.8 GB (bf16: 128256-token vocabulary, hidden 2048, 8 blocks, untied head) and a LoRA adapter
on it, written tensor by tensor (no model is built): the base of the merge's peak-RAM test."""
import torch

BIG_LLAMA = dict(vocab_size=128256, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                 num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False, max_position_embeddings=4096)
TARGETS = ["q_proj", "v_proj", "down_proj", "lm_head"]


def write_big_base(folder):
    """The base folder; its largest tensor's bytes (the embedding, and the head)."""
    from transformers import LlamaConfig

    from hfsplit.checkpoint.writer import StreamingWriter, specs_of
    from hfsplit.models.layout import meta_model

    config = LlamaConfig(**BIG_LLAMA, dtype="bfloat16")
    folder.mkdir(parents=True)
    state = meta_model(config, dtype=torch.bfloat16).state_dict()
    writer = StreamingWriter(folder, specs_of(state.items()), max_shard_size="1GB")
    generator = torch.Generator().manual_seed(0)
    for name, meta in state.items():
        value = torch.empty(meta.shape, dtype=torch.float32).uniform_(-0.05, 0.05, generator=generator)
        writer.write(name, value.to(torch.bfloat16))
        del value
    writer.close()
    config.save_pretrained(folder)
    return folder, max(t.numel() * t.element_size() for t in state.values())


def write_big_adapter(folder, r=8):
    """A LoRA of rank `r` on q, v, down and the head, random A and B (float32), as peft saves it; its bytes."""
    from peft import LoraConfig
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from hfsplit.models.layout import meta_model

    LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS).save_pretrained(folder)
    model = meta_model(LlamaConfig(**BIG_LLAMA))
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS:
            out_features, in_features = module.weight.shape
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(r, in_features, generator=generator) / 50
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(out_features, r, generator=generator) / 50
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder, sum(t.numel() * t.element_size() for t in tensors.values())
