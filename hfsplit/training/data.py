"""Data for fine-tuning: datasets → fixed-length token rows → deterministic micro-batches.

Three formats, each turned into examples of `input_ids` and `labels` (labels equal the inputs where the loss
counts and -100 elsewhere; the model shifts them itself, as transformers' `ForCausalLMLoss` does):

- "text": documents, each followed by EOS;
- "instruction": alpaca columns `instruction` / `input` / `output`; loss on the response only;
- "chat": a `messages` list rendered with the tokenizer's chat template; loss on assistant turns only.

(read and told apart by `hfsplit.training.sources`, which needs no torch) and then into rows of `seq_len`
(`hfsplit.training.packing`): instruction and chat examples are packed by default, several a row by best-fit
decreasing, each isolated by its position ids; without packing one example a row, padded.
Text documents are joined and cut into full blocks by default (the remainder is dropped); with packing each is an
example of its own.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from hfsplit.training.packing import (  # noqa: F401  (TokenRows, IGNORE_INDEX re-exported)
    IGNORE_INDEX, Example, TokenRows, packed_rows, padded_rows,
)
from hfsplit.training.sources import (  # noqa: F401  (what is read, before any torch, re-exported)
    BUNDLED_DIR, DatasetError, bundled_dataset_path, check_columns, detect_format, load_examples,
    packs_by_default,
)


# The prompts of Stanford Alpaca, so a model fine-tuned here answers prompts written that way.
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)

# ---------------------------------------------------------------------------------------------
# token rows


def eos_id(tokenizer) -> int:
    """The tokenizer's EOS id, or a `DatasetError` saying it needs one."""
    if tokenizer.eos_token_id is None:
        raise DatasetError(f"tokenizer {tokenizer.name_or_path!r} has no eos_token; set tokenizer.eos_token")
    return tokenizer.eos_token_id


def pad_id(tokenizer) -> int:
    """The id used to pad rows: the pad token, else EOS (padding is masked out of the loss anyway)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id(tokenizer)


def encoded_documents(texts: Sequence[str], tokenizer) -> list[list[int]]:
    """Each non-empty document's tokens followed by EOS."""
    eos = eos_id(tokenizer)
    docs = [t for t in texts if t]
    encoded = tokenizer(docs, add_special_tokens=False)["input_ids"] if docs else []
    return [[*ids, eos] for ids in encoded]


def concatenated_text_rows(texts: Sequence[str], tokenizer, *, seq_len: int) -> TokenRows:
    """Documents joined with EOS after each one and cut into full blocks of `seq_len`; the rest is dropped.

    Args:
        texts: the documents; empty ones are skipped.
        tokenizer: a Hugging Face tokenizer with an EOS token.
        seq_len: tokens per row.
    """
    stream = np.fromiter((i for ids in encoded_documents(texts, tokenizer) for i in ids), dtype=np.int64)
    num_rows = len(stream) // seq_len
    if num_rows == 0:
        raise DatasetError(
            f"the text dataset has {len(stream)} tokens, fewer than one block of seq_len={seq_len}; "
            "add text or lower seq_len"
        )
    blocks = torch.from_numpy(stream[: num_rows * seq_len].reshape(num_rows, seq_len))
    return TokenRows(input_ids=blocks, labels=blocks.clone())


def document_examples(texts: Sequence[str], tokenizer, *, seq_len: int) -> list[Example]:
    """Documents as examples of their own (text with packing: isolated documents), each with its EOS; a
    document longer than `seq_len` becomes several examples of `seq_len` tokens (and the rest)."""
    return [(piece, piece) for ids in encoded_documents(texts, tokenizer)
            for piece in (ids[i:i + seq_len] for i in range(0, len(ids), seq_len))]


def supervised(labels: Sequence[int], seq_len: int) -> bool:
    """Whether a row of `labels` cut to `seq_len` has a token the loss counts (the first label never does:
    the shift makes label i the target of position i - 1)."""
    return any(label != IGNORE_INDEX for label in labels[1:seq_len])


def layout_rows(examples: Sequence[Example], tokenizer, *, format: str, seq_len: int, packing: bool,
                seed: int = 0) -> TokenRows:
    """Examples with at least one supervised token as rows: packed by best-fit decreasing, or one a row padded;
    an error when none has one.

    Args:
        examples: (ids, labels) pairs.
        tokenizer: gives the padding id.
        format: the dataset format (for the error message).
        seq_len: tokens per row.
        packing: pack several examples a row (`hfsplit.training.packing.packed_rows`).
        seed: the packer's tie-breaking seed.
    """
    # An example whose response was cut off entirely teaches nothing and would make an all -100 batch (NaN loss).
    kept = [e for e in examples if supervised(e[1], seq_len)]
    if not kept:
        raise DatasetError(
            f"no {format} example has a response token within seq_len={seq_len} "
            f"({len(examples)} examples); raise seq_len or shorten the prompts"
        )
    pad = pad_id(tokenizer)
    if packing:
        return packed_rows(kept, seq_len=seq_len, pad=pad, seed=seed)
    return padded_rows(kept, seq_len=seq_len, pad=pad)


def alpaca_prompt(instruction: str, input: str | None = None) -> str:
    """The alpaca prompt for one example, with or without its `input` section."""
    if input:
        return ALPACA_PROMPT.format(instruction=instruction, input=input)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)


def instruction_examples(examples: Sequence[dict], tokenizer) -> list[Example]:
    """Alpaca examples as (ids, labels): prompt tokens masked, response tokens and the closing EOS supervised.

    Prompt and response are tokenized apart, so the mask is exact whatever merges the tokenizer makes
    (the prompt is tokenized the same way at generation time).

    Args:
        examples: dicts with "instruction", "output" and optionally "input".
        tokenizer: a Hugging Face tokenizer with an EOS token; its BOS (if it adds one) starts the prompt.
    """
    eos = eos_id(tokenizer)
    prompts = [alpaca_prompt(e["instruction"] or "", e.get("input")) for e in examples]
    responses = [e["output"] or "" for e in examples]
    prompt_ids = tokenizer(prompts, add_special_tokens=True)["input_ids"]
    response_ids = tokenizer(responses, add_special_tokens=False)["input_ids"]
    return [([*p, *r, eos], [IGNORE_INDEX] * len(p) + [*r, eos]) for p, r in zip(prompt_ids, response_ids)]


def rendered_chat(tokenizer, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
    """`messages` rendered as text by the tokenizer's chat template."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of each assistant reply (content + end marker).

    Each span is found by rendering the conversation prefix by prefix: it starts where the prefix with a
    generation prompt ends and stops where the prefix including the reply ends. Trailing whitespace the
    template writes after the end marker is left out, since generation stops at the marker.
    """
    full = rendered_chat(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(rendered_chat(tokenizer, messages[:i], add_generation_prompt=True))
        upto = rendered_chat(tokenizer, messages[: i + 1])
        if not full.startswith(upto) or start > len(upto):
            raise DatasetError(
                "the tokenizer's chat template does not render conversations prefix by prefix, so assistant "
                "turns cannot be located; use a template whose output for a conversation's prefix is a prefix"
            )
        end = len(upto.rstrip())
        if end > start:
            spans.append((start, end))
    return full, spans


def chat_example(tokenizer, messages: list[dict]) -> Example:
    """One conversation as (ids, labels): tokens of assistant replies supervised, the rest masked."""
    text, spans = assistant_char_spans(tokenizer, messages)
    # The template writes special tokens (BOS included) itself, so the tokenizer must add none.
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    labels = [
        tok if any(start <= begin < end for start, end in spans) else IGNORE_INDEX
        for tok, (begin, _) in zip(ids, encoded["offset_mapping"])
    ]
    return ids, labels


def checked_messages(messages: Any, index: int) -> list[dict]:
    """`messages` of example `index` if it is a list of {role, content} dicts, else a `DatasetError`."""
    ok = isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    )
    if not ok:
        raise DatasetError(
            f"example {index}: 'messages' must be a list of {{'role': str, 'content': str}} dicts, "
            f"got {str(messages)[:200]}"
        )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def chat_examples(conversations: Sequence[Any], tokenizer) -> list[Example]:
    """Conversations as (ids, labels): only assistant replies and their end token supervised.

    Args:
        conversations: each a list of {"role", "content"} dicts.
        tokenizer: a fast Hugging Face tokenizer with a chat template.
    """
    if not tokenizer.chat_template:
        raise DatasetError(f"tokenizer {tokenizer.name_or_path!r} has no chat template; set tokenizer.chat_template")
    if not tokenizer.is_fast:
        raise DatasetError("chat format needs a fast tokenizer (character offsets locate the assistant turns)")
    return [chat_example(tokenizer, checked_messages(messages, i)) for i, messages in enumerate(conversations)]


def token_rows(dataset, tokenizer, *, seq_len: int, format: str | None = None, packing: bool | None = None,
               seed: int = 0) -> TokenRows:
    """A loaded dataset turned into training rows of `seq_len` tokens.

    Args:
        dataset: a `datasets.Dataset` (or anything with `column_names`, `len` and column access).
        tokenizer: a Hugging Face tokenizer.
        seq_len: tokens per row.
        format: "text", "instruction" or "chat"; None detects it from the columns.
        packing: pack several examples a row, each isolated (text: each document its own example); False: one
            example a row, padded (text: documents joined and cut into blocks); None: `packs_by_default`.
        seed: the packer's tie-breaking seed.
    """
    if len(dataset) == 0:
        raise DatasetError("the dataset has no examples")
    if seq_len < 2:
        raise DatasetError(f"seq_len={seq_len} is too short; use at least 2")
    columns = list(dataset.column_names)
    format = format or detect_format(columns)
    check_columns(columns, format)
    check_text_values(dataset, format)
    packing = packs_by_default(format) if packing is None else packing
    if format == "text" and not packing:
        return concatenated_text_rows(dataset["text"], tokenizer, seq_len=seq_len)
    if format == "text":
        examples = document_examples(dataset["text"], tokenizer, seq_len=seq_len)
    elif format == "instruction":
        inputs = dataset["input"] if "input" in columns else [None] * len(dataset)
        examples = instruction_examples([
            {"instruction": i, "input": x, "output": o}
            for i, x, o in zip(dataset["instruction"], inputs, dataset["output"])
        ], tokenizer)
    else:
        examples = chat_examples(dataset["messages"], tokenizer)
    return layout_rows(examples, tokenizer, format=format, seq_len=seq_len, packing=packing, seed=seed)


def check_text_values(dataset, format: str) -> None:
    """A `DatasetError` naming the first example whose text column holds no string (a number, a list, null)."""
    text = {"text": ("text",), "instruction": ("instruction", "output", "input")}.get(format, ())
    for column in (c for c in text if c in dataset.column_names):
        bad = next((i for i, v in enumerate(dataset[column]) if not isinstance(v, str)
                    and not (column == "input" and v is None)), None)
        if bad is not None:
            raise DatasetError(f"example {bad}: {column!r} holds {dataset[bad][column]!r}, not text; make every "
                               f"{column!r} a string")


def load_token_rows(
    source: str, tokenizer, *, seq_len: int, format: str | None = None, packing: bool | None = None, seed: int = 0,
    split: str = "train", **load_kwargs: Any
) -> TokenRows:
    """Load a dataset (file, folder or hub name) and turn it into training rows; see `token_rows`.

    Args:
        source: path or hub name.
        tokenizer: a Hugging Face tokenizer.
        seq_len: tokens per row.
        format: "text", "instruction", "chat", or None to detect from the columns.
        packing, seed: see `token_rows`.
        split: the split to load.
        load_kwargs: passed on to `datasets.load_dataset`.
    """
    dataset = load_examples(source, split=split, **load_kwargs)
    try:
        return token_rows(dataset, tokenizer, seq_len=seq_len, format=format, packing=packing, seed=seed)
    except DatasetError as err:
        raise DatasetError(f"{source}: {err}") from err
