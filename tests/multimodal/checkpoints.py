"""Tiny real multimodal checkpoints (a vision tower around a language model), written by transformers' own classes,
and the language model alone saved as a text checkpoint, for the multimodal-as-text tests."""
from __future__ import annotations

from pathlib import Path

import torch

TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
              patch_size=8)


def multimodal_config(kind: str):
    """gemma3: Gemma 3 (SigLIP tower, sliding and full layers, tied head); mistral3: Mistral 3 (Pixtral tower, its
    head tied by the outer config's flag, not the text config's); qwen3_5, llama4, gemma4 as commented below."""
    import transformers

    if kind == "gemma3":
        return transformers.Gemma3Config(text_config=dict(TEXT, sliding_window=4), vision_config=VISION,
                                         mm_tokens_per_image=4, dtype="float32")
    if kind == "mistral3":
        return transformers.Mistral3Config(text_config=dict(TEXT, model_type="mistral"), dtype="float32",
                                           vision_config=dict(VISION, model_type="pixtral", head_dim=8))
    if kind == "qwen3_5":  # Gated DeltaNet linear attention beside full attention; the vision tower `model.visual`
        return transformers.Qwen3_5Config(
            text_config=dict(TEXT, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                             linear_value_head_dim=8, dtype="float32"), dtype="float32",
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32))
    if kind == "llama4":  # the whole causal LM inside (`language_model.model.layers`, `language_model.lm_head`)
        return transformers.Llama4Config(
            text_config=dict(TEXT, num_local_experts=2, intermediate_size_mlp=64, interleave_moe_layer_step=2,
                             attention_chunk_size=4, dtype="float32"), dtype="float32",
            vision_config=dict(VISION, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32))
    if kind == "gemma4":  # per-layer inputs, sliding and full layers (the full one with its own wider head dim),
        # beside a vision and an audio tower (`model.vision_tower`, `model.audio_tower`, their embedders)
        return transformers.Gemma4Config(
            text_config=dict(TEXT, sliding_window=4, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                             per_layer_config={"3": {"head_dim": 16}}, vocab_size_per_layer_input=128,
                             hidden_size_per_layer_input=8),
            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=2,
                               position_embedding_size=64),
            audio_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, conv_kernel_size=3,
                              subsampling_conv_channels=[8, 4], output_proj_dims=16), dtype="float32")
    raise ValueError(kind)


def multimodal_class(kind: str):
    import transformers

    return {"gemma3": transformers.Gemma3ForConditionalGeneration,
            "mistral3": transformers.Mistral3ForConditionalGeneration,
            "qwen3_5": transformers.Qwen3_5ForConditionalGeneration,
            "llama4": transformers.Llama4ForConditionalGeneration,
            "gemma4": transformers.Gemma4ForConditionalGeneration}[kind]


def write_multimodal(folder: Path, kind: str) -> Path:
    """The tiny `kind` checkpoint saved by transformers' `save_pretrained` (random weights, perturbed norms)."""
    torch.manual_seed(0)
    model = multimodal_class(kind)(multimodal_config(kind)).float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.02)
    model.save_pretrained(folder)
    return folder


def write_text_only(folder: Path, kind: str) -> Path:
    """The same language model as a plain causal-LM checkpoint (its text config, transformers' class for it)."""
    from transformers import AutoModelForCausalLM

    from hfsplit.checkpoint.multimodal import text_config_of

    AutoModelForCausalLM.from_config(text_config_of(multimodal_config(kind))).save_pretrained(folder)
    return folder
