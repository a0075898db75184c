"""How llama.cpp stores each transformers architecture `hfsplit export-gguf` writes, and which models it refuses.

The table is data: the GGUF architecture name (a `gguf.MODEL_ARCH_NAMES` value), the tensor layout changes llama.cpp
makes, and the hyper-parameter keys beyond the common ones. An architecture is listed only once transformers' own GGUF
reader, the oracle of the export, loads a tiny export of it to the source model's logits (tests/ship/test_gguf.py).
What the reader would read back differently (a config value it takes at its default, say) is refused before any
tensor is written: `reader_mismatch` asks the reader itself, on a probe file holding the export's keys.
"""
from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hfsplit.errors import UnsupportedModelError


@dataclass(frozen=True)
class GgufArch:
    """How llama.cpp stores one transformers architecture.

    Args:
        name: GGUF `general.architecture` (a `gguf.MODEL_ARCH_NAMES` value).
        permute_qk: q and k rows interleaved per head (llama.cpp's rope layout for Llama; transformers' reader
            undoes it).
        norm_offset: added to RMSNorm weights (Gemma's norms scale by 1 + w; llama.cpp stores 1 + w).
        squeeze: source tensor-name endings llama.cpp stores without their size-1 dims (Qwen2-MoE's shared expert
            gate [1, H] as [H], LFM2's convolution [H, 1, L] as [H, L]).
        per_layer_kv_heads: `attention.head_count_kv` written per layer, 0 on layers without attention (LFM2's
            convolution layers: the reader tells the layer kinds apart this way).
        extra_keys: the optional key groups of `add_hyperparameters` the architecture has.
        renames: (source name ending, the ending gguf's tensor map knows it by).
        ffn_tensor: a weight whose rows are the FFN width, where the config only implies the width (LFM2's).
        reader_skips: source tensor-name endings transformers' reader does not load, leaving them at their initial
            ones: exported only while they hold ones (gguf_tensors.refuse_reader_skipped).
    """

    name: str
    permute_qk: bool = False
    norm_offset: float = 0.0
    squeeze: tuple[str, ...] = ()
    per_layer_kv_heads: bool = False
    extra_keys: tuple[str, ...] = ()
    renames: tuple[tuple[str, str], ...] = ()
    ffn_tensor: str = ""
    reader_skips: tuple[str, ...] = ()


# transformers model_type → GGUF architecture; each proven by tests/ship/test_gguf.py against transformers' reader.
ARCHITECTURES = {
    "llama": GgufArch("llama", permute_qk=True),
    "mistral": GgufArch("llama", permute_qk=True),  # llama.cpp converts Mistral as Llama (no sliding window)
    "qwen2": GgufArch("qwen2"),
    "qwen2_moe": GgufArch("qwen2moe", squeeze=("shared_expert_gate.weight",), extra_keys=("experts",)),
    "qwen3": GgufArch("qwen3"),
    "qwen3_moe": GgufArch("qwen3moe", extra_keys=("experts",)),
    "phi3": GgufArch("phi3"),
    "gemma2": GgufArch("gemma2", norm_offset=1.0, extra_keys=("softcaps", "sliding_window")),
    "gemma3_text": GgufArch("gemma3", norm_offset=1.0, extra_keys=("sliding_window",)),
    # Gemma 4 as llama.cpp's converter writes it: norms as they are (Gemma4RMSNorm scales by w), the full-attention
    # layers' key length and rope width in the plain keys, the sliding layers' in the _swa ones, proportional rope as
    # rope_freqs. The reader maps the layer scalar as blk.N.layer_output_scale, the converter writes it with .weight.
    "gemma4_text": GgufArch("gemma4", extra_keys=("sliding_window", "softcaps", "gemma4"),
                            reader_skips=("layer_scalar",)),
    "starcoder2": GgufArch("starcoder2", extra_keys=("layer_norm",)),
    "lfm2": GgufArch("lfm2", per_layer_kv_heads=True, squeeze=("conv.conv.weight",), extra_keys=("short_conv",),
                     ffn_tensor="feed_forward.w1.weight"),
    "minimax_m2": GgufArch("minimax-m2", extra_keys=("experts", "gating"),
                           renames=(("e_score_correction_bias", "e_score_correction.bias"),)),
    "nemotron": GgufArch("nemotron", norm_offset=1.0, extra_keys=("layer_norm",)),
    "stablelm": GgufArch("stablelm", extra_keys=("layer_norm",)),
    # Falcon with multi-query attention (Falcon-7B's): its fused query_key_value [q heads; k; v] is already llama.cpp's
    # attn_qkv layout, which the reader reads unchanged. Grouped-query Falcon (new_decoder_architecture: 40B, 180B)
    # interleaves q, k, v per group, which llama.cpp's converter regroups; the reader neither regroups nor rebuilds
    # new_decoder_architecture, so reader_mismatch refuses it.
    "falcon": GgufArch("falcon", extra_keys=("layer_norm",)),
}
# Architectures transformers' reader cannot read back, and why (the test checks each why against transformers).
NOT_READ_BACK = {
    "gpt_oss": "in a file with llama.cpp's architecture name 'gpt-oss' it maps no GGUF tensor to GPT-OSS's fused "
               "experts (gate_up_proj and its bias) nor to the experts' down_proj bias, and maps the experts' "
               "down_proj and the attention sinks without the .weight llama.cpp writes them with (blk.N.ffn_down_exps, "
               "blk.N.attn_sinks), so all of them would load uninitialised; its GPT-OSS tensor processor is "
               "registered as 'gpt_oss', and reads blk.N.ffn_*_projs tensors llama.cpp does not write",
    "gemma3n_text": "it has no gemma3n architecture",
    "falcon_h1": "it has no falcon-h1 architecture",
}
# Config entries never compared with what the reader rebuilds: those that describe the file, not the model; those only
# training reads (dropout, initialisation, router losses); model_type, since the table above chooses the layout
# (Mistral reads back as the Llama it equals without a sliding window); max_window_layers and sliding_window_pattern,
# whose effect is compared through layer_types; apply_residual_connection_post_layernorm, a Bloom switch that Falcon's
# published configs (Falcon-7B's) still carry and transformers' Falcon does not read.
_NOT_COMPARED = {"model_type", "architectures", "dtype", "torch_dtype", "transformers_version", "_name_or_path",
                 "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "use_cache", "output_hidden_states",
                 "output_attentions", "return_dict", "id2label", "label2id", "full_attn_idxs", "initializer_range",
                 "attention_dropout", "hidden_dropout", "embedding_dropout", "resid_pdrop", "embd_pdrop",
                 "router_aux_loss_coef", "output_router_logits", "router_jitter_noise", "max_window_layers",
                 "sliding_window_pattern", "apply_residual_connection_post_layernorm"}


def gguf_arch(config) -> GgufArch:
    """The GGUF architecture of `config`; refused by name where no oracle proves the export."""
    model_type = config.model_type
    if model_type in NOT_READ_BACK:
        raise UnsupportedModelError(f"export-gguf: model type {model_type!r} is not exported: transformers' GGUF "
                                    "reader, the proof of the export, cannot read it back "
                                    f"({NOT_READ_BACK[model_type]}); llama.cpp's convert_hf_to_gguf.py may convert "
                                    "the folder")
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(f"export-gguf: model type {model_type!r} is not exported yet (exported: "
                                    f"{', '.join(sorted(ARCHITECTURES))}): no round trip through transformers' GGUF "
                                    "reader proves it; llama.cpp's convert_hf_to_gguf.py may convert the folder")
    for rope in _rope_parameters(config):
        if (rope.get("rope_type", "default"), model_type) in (("llama3", "llama"), ("proportional", "gemma4_text")):
            continue  # llama.cpp's rope_freqs tensor (gguf_tensors.py)
        if rope.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"export-gguf: rope scaling {rope.get('rope_type')!r} of {model_type!r} is "
                                        "not exported yet (only plain rope)")
    if model_type == "mistral" and getattr(config, "sliding_window", None):
        raise UnsupportedModelError("export-gguf: Mistral with a sliding window is not exported (llama.cpp's "
                                    "Llama layout has none)")
    return ARCHITECTURES[model_type]


def _rope_parameters(config) -> list[dict]:
    """The rope parameters of `config`: one dict, or one per attention kind (Gemma 3's sliding and full)."""
    rope = getattr(config, "rope_parameters", None) or {}
    return [v for v in rope.values() if isinstance(v, dict)] or [rope]


def add_hyperparameters(writer, config, arch: GgufArch, ffn_width: int) -> None:
    """The keys llama.cpp (and transformers' reader) take the model's shape from; `ffn_width` is the FFN's."""
    head_dim = full_head_dim(config)
    rope = (getattr(config, "rope_parameters", None) or {}).get("full_attention") or _rope_parameters(config)[0]
    rotary = head_dim if "gemma4" in arch.extra_keys else int(head_dim * rope.get("partial_rotary_factor", 1.0))
    # No general.name: transformers' reader takes a file named exactly "mistral" for its own Mistral layout.
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(ffn_width)
    writer.add_head_count(config.num_attention_heads)
    if arch.per_layer_kv_heads:
        writer.add_head_count_kv([config.num_key_value_heads if kind == "full_attention" else 0
                                  for kind in config.layer_types])
    else:
        writer.add_head_count_kv(_kv_heads(config))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(rotary)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    if "layer_norm" in arch.extra_keys:
        writer.add_layer_norm_eps(next(getattr(config, k) for k in ("norm_epsilon", "layer_norm_eps", "norm_eps",
                                                                    "layer_norm_epsilon") if hasattr(config, k)))
    else:
        writer.add_layer_norm_rms_eps(getattr(config, "rms_norm_eps", None) or config.norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if "experts" in arch.extra_keys:
        writer.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size  # MiniMax-M2: its experts'
        writer.add_expert_feed_forward_length(width)
        if getattr(config, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if "gating" in arch.extra_keys:  # MiniMax-M2's router: sigmoid, which its config does not name
        import gguf

        gating = {"softmax": gguf.ExpertGatingFuncType.SOFTMAX, "sigmoid": gguf.ExpertGatingFuncType.SIGMOID}
        writer.add_expert_gating_func(gating[getattr(config, "scoring_func", "sigmoid")])
    if "sliding_window" in arch.extra_keys and getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if "softcaps" in arch.extra_keys:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(config, key, None):
                getattr(writer, f"add_{key}")(getattr(config, key))
    if "short_conv" in arch.extra_keys:
        writer.add_shortconv_l_cache(config.conv_L_cache)
    if "gemma4" in arch.extra_keys:
        _add_gemma4_keys(writer, config)


def full_head_dim(config) -> int:
    """The head size of the full-attention layers: Gemma 4's global one (its per-layer config), else head_dim."""
    full = [i for i, kind in enumerate(getattr(config, "layer_types", None) or []) if kind == "full_attention"]
    if config.model_type == "gemma4_text" and full:
        return config.per_layer_config[full[0]].head_dim
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _add_gemma4_keys(writer, config) -> None:
    """Gemma 4's keys beyond Gemma 3's, as llama.cpp's converter writes them: the sliding layers' head size, rope
    width and base (the plain keys hold the full layers'), which layers slide, the KV-sharing layer count and the
    per-layer-input width (0 without per-layer inputs)."""
    sliding = config.rope_parameters["sliding_attention"]
    head_dim = config.to_dict()["head_dim"]  # the config's own: `config.head_dim` is ambiguous, full layers differ
    writer.add_key_length_swa(head_dim)
    writer.add_value_length_swa(head_dim)
    writer.add_rope_dimension_count_swa(int(head_dim * sliding.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base_swa(float(sliding["rope_theta"]))
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config.layer_types])
    writer.add_shared_kv_layers(config.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input or 0)


def _kv_heads(config) -> int:
    """The key/value heads attention runs with: Falcon's multi-query attention has one, whatever `num_kv_heads`
    says (transformers' FalconAttention); Gemma 4's config value."""
    if config.model_type == "falcon":
        return config.num_kv_heads if config.new_decoder_architecture or not config.multi_query else 1
    if config.model_type == "gemma4_text":  # the sliding layers' (full ones may differ: `config.num_key_value_heads`
        return config.to_dict()["num_key_value_heads"]  # is then ambiguous); the reader reads one count back
    return config.num_key_value_heads or config.num_attention_heads


def ffn_width(config, arch: GgufArch, shapes: dict) -> int:
    """The FFN width: the config's, or the rows of `arch.ffn_tensor` in `shapes` ({name: shape}) where the config
    derives it (LFM2's `block_auto_adjust_ff_dim`)."""
    if arch.ffn_tensor and getattr(config, "block_auto_adjust_ff_dim", False):
        return next(shape[0] for name, shape in shapes.items() if name.endswith(arch.ffn_tensor))
    return getattr(config, "intermediate_size", None) or config.ffn_hidden_size  # Falcon's is ffn_hidden_size


def reader_mismatch(config, add_keys, tensor_names: list[str], width: int) -> dict:
    """{config key: (the model's value, the value transformers' GGUF reader rebuilds)} for every entry the reader
    would read back differently from a file with these keys (`add_keys(writer)`) and tensors: asked of the reader
    itself, on a probe file whose tensors are single zeros."""
    import gguf
    import numpy as np
    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as folder:
        probe = Path(folder) / "probe.gguf"
        writer = gguf.GGUFWriter(probe, ARCHITECTURES[config.model_type].name)
        add_keys(writer)
        for name in tensor_names:
            writer.add_tensor(name, np.zeros(1, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        rebuilt = AutoConfig.from_pretrained(folder, gguf_file=probe.name).to_dict()
    mine, rebuilt = _rope_spelled_out(_ffn_width_spelled_out(config.to_dict(), width)), _rope_spelled_out(rebuilt)
    return {k: (v, rebuilt.get(k)) for k, v in mine.items()
            if k not in _NOT_COMPARED and not _same(v, rebuilt.get(k))}


def _ffn_width_spelled_out(config: dict, width: int) -> dict:
    """`config` with a derived FFN width (LFM2's `block_auto_adjust_ff_dim`) replaced by the width it derives, as
    the reader writes it."""
    if not config.get("block_auto_adjust_ff_dim"):
        return config
    dropped = {"block_multiple_of", "block_ffn_dim_multiplier"}
    return {**{k: v for k, v in config.items() if k not in dropped}, "intermediate_size": width,
            "block_auto_adjust_ff_dim": False}


def _rope_spelled_out(config: dict) -> dict:
    """`config` with its rope parameters' implicit full rotary width written (1.0 and absent mean the same), and
    Llama 3's rope scaling as the plain rope the reader rebuilds: the scaling travels in the rope_freqs tensor, which
    llama.cpp reads and transformers' reader skips (tests/ship/test_gguf.py proves the tensor on its own)."""
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        if rope.get("rope_type") == "llama3":
            rope = {"rope_theta": rope["rope_theta"], "rope_type": "default"}
        config = {**config, "rope_parameters": {"partial_rotary_factor": 1.0, **rope}}
    return config


def _same(a, b) -> bool:
    """Config values equal, floats to float32 precision (GGUF stores them as float32)."""
    if isinstance(a, float) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b
