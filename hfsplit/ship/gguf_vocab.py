"""The tokenizer of a GGUF export: a byte-level BPE tokenizer.json as llama.cpp reads it, through the `gguf` package's
vocab helpers (`BpeVocab`, `SpecialVocab`); other tokenizer kinds are refused with the fix."""
from __future__ import annotations

import json
from pathlib import Path

from hfsplit.checkpoint.resolve import resolve_file
from hfsplit.errors import CheckpointError, UnsupportedModelError


def tokenizer_folder(model: str) -> Path:
    """The folder holding `model`'s tokenizer.json; a SentencePiece-only tokenizer (tokenizer.model) is refused."""
    try:
        return resolve_file(model, "tokenizer.json").parent
    except CheckpointError:
        try:
            spm = resolve_file(model, "tokenizer.model")
        except CheckpointError:
            raise CheckpointError(f"export-gguf: {model} has no tokenizer.json: save the model's tokenizer in it "
                                  "(AutoTokenizer.from_pretrained(...).save_pretrained(folder))") from None
        raise UnsupportedModelError(f"export-gguf: {spm} is a SentencePiece tokenizer without tokenizer.json; only "
                                    "byte-level BPE tokenizers are exported yet: llama.cpp's convert_hf_to_gguf.py "
                                    "converts SentencePiece ones") from None


def add_tokenizer(writer, model: str, config) -> None:
    """The byte-level BPE tokenizer of `model` (tokenizer.json) as llama.cpp reads it: tokens with their types
    (special added tokens CONTROL, other added tokens USER_DEFINED, padding to the embedding's rows UNUSED), the
    pre-tokenizer's name, merges, special token ids and the chat template (`gguf.SpecialVocab`)."""
    import gguf

    folder = tokenizer_folder(model)
    try:
        vocab = gguf.vocab.BpeVocab(folder)
    except (FileNotFoundError, ValueError) as exc:
        raise UnsupportedModelError(f"export-gguf: {folder}/tokenizer.json is not a byte-level BPE tokenizer ({exc}); "
                                    "only those are exported yet") from None
    data = json.loads((folder / "tokenizer.json").read_text())
    added = {t["content"]: t for t in data.get("added_tokens", [])}
    tokens, types = [], []
    for text, _, _ in vocab.all_tokens():
        token = text.decode("utf-8") if isinstance(text, bytes) else text
        entry = added.get(token)
        kind = (gguf.TokenType.CONTROL if entry["special"] else gguf.TokenType.USER_DEFINED) if entry else gguf.TokenType.NORMAL
        tokens.append(token)
        types.append(kind)
    if len(tokens) > config.vocab_size:
        raise CheckpointError(f"export-gguf: the tokenizer has {len(tokens)} tokens, the model's embedding "
                              f"{config.vocab_size} rows")
    for i in range(len(tokens), config.vocab_size):
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(data, folder))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=config.vocab_size).add_to_gguf(writer, quiet=True)


def pre_tokenizer_name(tokenizer: dict, folder: Path) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer: "gpt-2" for plain byte-level BPE, else the name whose
    split regex transformers' GGUF reader would rebuild (its `GGUF_PRE_TOKENIZER_SPLITS`)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    pre = tokenizer.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    regex = next((p.get("pattern", {}).get("Regex") for p in parts if p.get("type") == "Split"), None)
    name = next((n for n, split in GGUF_PRE_TOKENIZER_SPLITS.items() if split == regex), None)
    if name is None or not any(p.get("type") == "ByteLevel" for p in parts):
        raise UnsupportedModelError(f"export-gguf: {folder}/tokenizer.json splits text in a way llama.cpp has no name "
                                    "for (its pre-tokenizer is not GPT-2's, Llama 3's, Qwen2's, ...)")
    return name
