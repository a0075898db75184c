"""Small real checkpoints written from transformers model classes with random weights.

Used by the built-in default run, the tests and the benchmarks, so that every path
reads genuine safetensors files in the layouts users have: one file or sharded,
tied or untied, a plain folder or a hub cache.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

from hfsplit.checkpoint.mxfp4 import BLOCKS, QUANT_METHOD, SCALES, pack_experts
from hfsplit.models.shrink import shrunk_config

ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3", "phi3", "olmo2")
# Families doing work outside their blocks (hfsplit.models.families.FAMILIES), with non-default factors so that a
# stage skipping that work shows in the logits.
FAMILY_OVERRIDES = {
    "gemma": {},
    "gemma2": dict(final_logit_softcapping=3.0, attn_logit_softcapping=5.0, sliding_window=4, query_pre_attn_scalar=16),
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0),
    "cohere": dict(logit_scale=0.25),
    # local and global rope with different bases, alternating sliding window: a stage using one rope or one
    # mask for every layer shows in the logits
    "gemma3_text": dict(final_logit_softcapping=3.0, sliding_window=4, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "full_attention"] * 2,
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                         "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "cohere2": dict(logit_scale=0.25, sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2),
    # MoE: `save_pretrained` writes the experts one by one (transformers merges them on load); top-2 of 4
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
    # gpt-oss: attention sinks, sliding and full layers alternating, biased router and experts (`nonzero_biases`),
    # a SwiGLU clamp low enough to bite on tiny random weights, and YaRN rope (its attention scaling ≠ 1)
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4, swiglu_limit=0.2,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128}),
}
# Parameters a family's `_init_weights` zeroes but its forward uses: random here, so that a stage skipping them
# shows in the logits (gpt-oss initialises its expert biases to zero).
ZERO_INITIALISED = {"gpt_oss": ("experts.gate_up_proj_bias", "experts.down_proj_bias")}


# The recipe's built-in tiny model (`recipes/finetune.py` without --model, `hfsplit plan --config` of a tiny recipe).
TINY_MODEL = dict(arch="llama", num_layers=4, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=256,
                  max_positions=1024)


def tiny_model(folder: str | Path = "tiny-llama") -> str:
    """The built-in tiny Llama (`TINY_MODEL`: random weights, the tiny tokenizer), written to `folder` unless it is
    there, and its path: what the recipe trains without --model, to try hfsplit on. Several ranks may ask at once:
    each writes a copy aside, the first renamed into place stays."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        spec = dict(TINY_MODEL)
        aside = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
        write_tiny_checkpoint(aside, spec.pop("arch"), sharded=True, **spec)
        try:
            os.replace(aside, folder)
        except OSError:  # another rank's copy is in place
            shutil.rmtree(aside, ignore_errors=True)
    return str(folder)


def tiny_config(arch: str = "llama", *, tied: bool = False, num_layers: int = 4, hidden: int = 64,
                heads: int = 4, kv_heads: int = 2, intermediate: int = 128, vocab: int = 256,
                max_positions: int = 512, **overrides):
    """A transformers config of `arch` with tiny dimensions (fp32)."""
    from transformers import AutoConfig

    if arch not in ARCHITECTURES and arch not in FAMILY_OVERRIDES:  # any other causal LM: its defaults shrunk
        return shrunk_causal_lm_config(arch, tied=tied, **overrides)
    kwargs = dict(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
        max_position_embeddings=max_positions, tie_word_embeddings=tied, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if arch == "qwen3":
        kwargs["head_dim"] = hidden // heads  # Qwen3's default head_dim is a fixed 128
    kwargs.update(FAMILY_OVERRIDES.get(arch, {}), **({"head_dim": hidden // heads} if arch in FAMILY_OVERRIDES else {}))
    kwargs.update(overrides)
    if "layer_types" in kwargs and "layer_types" not in overrides:  # the family's sliding/full pattern, any depth
        kwargs["layer_types"] = [kwargs["layer_types"][i % 2] for i in range(num_layers)]
    config = AutoConfig.for_model(arch, **kwargs)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return config


def shrunk_causal_lm_config(model_type: str, *, tied: bool = False, **overrides):
    """transformers' default config of `model_type` (the flagship's switches and layer kinds) with tiny sizes
    (`hfsplit.models.shrink`), `overrides` applied after."""
    from transformers import AutoConfig

    config = shrunk_config(AutoConfig.for_model(model_type))
    for key, value in {"tie_word_embeddings": tied, **overrides}.items():
        setattr(config, key, value)
    if not getattr(config, "architectures", None):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    return config


def write_checkpoint(path: str | Path, config, *, seed: int = 0, max_shard_size: Optional[str] = None,
                     dtype=None) -> Path:
    """Write a randomly initialised model of `config` with `save_pretrained`.

    Args:
        path: output folder.
        config: a transformers config.
        seed: torch seed for the weights.
        max_shard_size: e.g. "40KB" for a sharded checkpoint; None writes one `model.safetensors`.
        dtype: torch dtype to save in (default: the model's, fp32).
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    nonzero_biases(model)
    if dtype is not None:
        model = model.to(dtype)
    path = Path(path)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return path


def nonzero_biases(model) -> None:
    """Fill the parameters `ZERO_INITIALISED` names for the model's family with small random values."""
    import torch

    suffixes = ZERO_INITIALISED.get(model.config.model_type, ())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(suffixes):
                param.normal_(0.0, 0.02)


def write_mxfp4_checkpoint(path: str | Path, config, *, seed: int = 0, max_shard_size: Optional[str] = None) -> Path:
    """A randomly initialised gpt-oss checkpoint laid out as the published ones: every fused expert parameter
    quantized to MXFP4 and stored as its `_blocks` and `_scales` (`checkpoint.mxfp4.pack_experts`), the other
    tensors as `save_pretrained` writes them, and config.json's `quantization_config` naming mxfp4 with the
    published `modules_to_not_convert`."""
    from safetensors.torch import load_file, save_file


    path = write_checkpoint(path, config, seed=seed, max_shard_size=max_shard_size)
    index = path / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    for shard in shard_files(path):
        tensors = load_file(path / shard)
        for name in [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
            tensors[name + BLOCKS], tensors[name + SCALES] = pack_experts(tensors.pop(name))
            if weight_map is not None:
                weight_map[name + BLOCKS] = weight_map[name + SCALES] = weight_map.pop(name)
        save_file(tensors, path / shard, metadata={"format": "pt"})
    if weight_map is not None:
        data = json.loads(index.read_text())
        index.write_text(json.dumps({**data, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    config_file = path / "config.json"
    data = json.loads(config_file.read_text())
    data["quantization_config"] = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                              "model.embed_tokens", "lm_head"],
                                   "quant_method": QUANT_METHOD}
    config_file.write_text(json.dumps(data, indent=2))
    return path


TINY_TOKENIZER_DIR = Path(__file__).parent / "tiny_tokenizer"


def tiny_tokenizer():
    """The tiny tokenizer shipped with hfsplit (vocab 256, ChatML chat template), loaded offline."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR))


def write_tiny_checkpoint(path: str | Path, arch: str = "llama", *, tied: bool = False, sharded: bool = True,
                          seed: int = 0, mxfp4: bool = False, **config_overrides) -> Path:
    """A tiny `arch` checkpoint in `path`; sharded into several safetensors files unless `sharded=False`; with
    `mxfp4` (gpt-oss), its experts stored MXFP4-packed as the published checkpoints store them."""
    config = tiny_config(arch, tied=tied, **config_overrides)
    write = write_mxfp4_checkpoint if mxfp4 else write_checkpoint
    path = write(path, config, seed=seed, max_shard_size="60KB" if sharded else None)
    tokenizer = tiny_tokenizer()
    if len(tokenizer) <= config.vocab_size:  # a complete model folder, as users have them
        tokenizer.save_pretrained(path)
    return path


def write_hub_cache(cache_dir: str | Path, repo_id: str, source: str | Path, *, revision: str = "main",
                    commit: str = "0" * 40) -> Path:
    """Lay out the files of folder `source` as huggingface_hub's cache holds repo `repo_id`.

    With `HF_HUB_CACHE=cache_dir` and `HF_HUB_OFFLINE=1`, `hf_hub_download(repo_id, name)`
    then resolves through the hub library's own offline lookup.

    Returns:
        The snapshot folder.
    """
    cache_dir = Path(cache_dir)
    repo = cache_dir / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    blobs = repo / "blobs"
    blobs.mkdir(exist_ok=True)
    for file in sorted(Path(source).iterdir()):
        if file.is_file():
            blob = blobs / f"{file.name}.blob"
            shutil.copyfile(file, blob)
            link = snapshot / file.name
            if link.exists() or link.is_symlink():
                link.unlink()
            link.symlink_to(Path("../../blobs") / blob.name)
    return snapshot


def shard_files(path: str | Path) -> list[str]:
    """Names of the safetensors files a checkpoint folder's index lists (or the single file)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"]
