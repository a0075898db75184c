"""Data for fine-tuning: datasets → fixed-length token rows → deterministic micro-batches.

Three formats, each turned into examples of `input_ids` and `labels` (labels equal the inputs where the loss
counts and -100 elsewhere; the model shifts them itself, as transformers' `ForCausalLMLoss` does):

- "text": documents, each followed by EOS;
- "instruction": alpaca columns `instruction` / `input` / `output`; loss on the response only;
- "chat": a `messages` list rendered with the tokenizer's chat template; loss on assistant turns only.

and then into rows of `seq_len` (`hfsplit.training.packing`): instruction and chat examples are packed by default,
several a row by best-fit decreasing, each isolated by its position ids; without packing one example a row, padded.
Text documents are joined and cut into full blocks by default (the remainder is dropped); with packing each is an
example of its own.
"""
from __future__ import annotations

import codecs
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from hfsplit.errors import HfsplitError
from hfsplit.training.packing import (  # noqa: F401  (TokenRows, IGNORE_INDEX re-exported)
    IGNORE_INDEX, Example, TokenRows, packed_rows, padded_rows,
)

BUNDLED_DIR = Path(__file__).parent / "bundled"

BUILDER_BY_SUFFIX = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".txt": "text",
    ".text": "text",
}
TEXT_SUFFIXES = (".json", ".jsonl", ".csv", ".txt", ".text")
FORMATS = ("text", "instruction", "chat")

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


class DatasetError(HfsplitError, ValueError):
    """A dataset that cannot be read or turned into training rows (missing columns, empty, ...)."""


# ---------------------------------------------------------------------------------------------
# loading


def builder_for(source: str) -> tuple[str, dict[str, Any]]:
    """The `datasets.load_dataset` builder name and arguments for a local file, folder or hub name.

    Args:
        source: a local `.json`/`.jsonl`/`.csv`/`.parquet`/`.txt` file, a local folder, or a hub name.
    """
    path = Path(os.path.expanduser(source))
    if path.is_dir():
        if not any(p.is_file() and p.suffix.lower() in BUILDER_BY_SUFFIX for p in path.rglob("*")):
            kinds = ", ".join(sorted(BUILDER_BY_SUFFIX))
            raise DatasetError(f"dataset folder {source!r} holds no data files ({kinds}); put the examples in such "
                               "files or pass a file")
        return str(path), {}
    suffix = path.suffix.lower()
    if path.is_file():
        if suffix not in BUILDER_BY_SUFFIX:
            raise DatasetError(
                f"cannot tell the file type of {source!r} from its extension {suffix!r}; "
                f"use one of {sorted(BUILDER_BY_SUFFIX)}"
            )
        return BUILDER_BY_SUFFIX[suffix], {"data_files": str(path)}
    if suffix in BUILDER_BY_SUFFIX:
        # Looks like a file, not a hub name: say so instead of a confusing hub lookup error.
        raise DatasetError(f"dataset file {source!r} does not exist; pass --dataset an existing file or folder, or "
                           "a hub dataset name")
    return source, {}


def is_blank_file(path: Path) -> bool:
    """Whether `path` holds nothing but whitespace (only its start is read)."""
    with path.open("rb") as f:
        return not f.read(1 << 16).strip()


def load_examples(source: str, *, split: str = "train", **load_kwargs: Any):
    """Load raw examples (a `datasets.Dataset`) from a local file or folder, or a hub dataset name.

    Args:
        source: path or hub name, see `builder_for`.
        split: the split to load; local files land in "train".
        load_kwargs: passed on to `datasets.load_dataset` (e.g. `cache_dir`, `name`, `revision`).
    """
    import datasets

    builder, kwargs = builder_for(source)
    # An empty file fails deep inside the builders (StopIteration, "no columns"), so catch it first.
    if "data_files" in kwargs and is_blank_file(Path(kwargs["data_files"])):
        raise DatasetError(f"dataset file {source!r} is empty; add examples to it or pass another dataset")
    for path in local_text_files(source):  # pyarrow keeps invalid UTF-8 as it is, to fail later on the first row
        check_utf8(path)
    for path in local_files(source, (".parquet",)):  # else `datasets` logs its own error line before failing
        check_parquet(path)
    try:
        dataset = datasets.load_dataset(builder, split=split, **kwargs, **load_kwargs)
    except UnicodeDecodeError as err:
        raise not_utf8(source, err) from None
    except datasets.exceptions.DatasetGenerationError as err:
        if isinstance(err.__cause__, UnicodeDecodeError):
            raise not_utf8(source, err.__cause__) from None
        raise DatasetError(f"could not read dataset {source!r}: {first_line(err.__cause__ or err)}; fix the file "
                           "(.jsonl: one JSON object a line; .csv: a header row) or pass another") from err
    except (datasets.exceptions.DataFilesNotFoundError, datasets.data_files.EmptyDatasetError) as err:
        raise DatasetError(f"dataset {source!r}: {first_line(err)}; pass a json/jsonl/csv/parquet/txt file or a folder "
                           "of them") from err
    except ValueError as err:
        # How `datasets` reports a split with zero rows, e.g. a JSON file holding `[]`.
        if "corresponds to no data" in str(err):
            raise DatasetError(f"dataset {source!r} (split {split!r}) has no examples; add examples or pass "
                               "another dataset") from err
        if "data_files" not in kwargs and not Path(source).exists():
            raise
        # a local file its reader cannot parse (pyarrow: "Parquet magic bytes not found", ...)
        raise DatasetError(f"could not read dataset {source!r}: {first_line(err)}; fix the file or pass "
                           "another") from err
    if len(dataset) == 0:
        raise DatasetError(f"dataset {source!r} (split {split!r}) has no examples; add examples or pass "
                           "another dataset")
    return dataset


def bundled_dataset_path(name: str) -> Path:
    """Path of a dataset shipped with hfsplit: "tiny_alpaca.jsonl", "tiny_chat.jsonl" or "tiny_text.txt"."""
    path = BUNDLED_DIR / name
    if not path.is_file():
        found = sorted(p.name for p in BUNDLED_DIR.iterdir() if p.suffix in BUILDER_BY_SUFFIX)
        raise DatasetError(f"no bundled dataset {name!r}; bundled: {found}")
    return path


# ---------------------------------------------------------------------------------------------
# format detection


def detect_format(columns: Sequence[str]) -> str:
    """The format that a dataset's columns imply: "chat", "instruction" or "text".

    Args:
        columns: the dataset's column names.
    """
    if "messages" in columns:
        return "chat"
    if "instruction" in columns and "output" in columns:
        return "instruction"
    if "text" in columns:
        return "text"
    raise DatasetError(
        f"cannot tell the dataset format from its columns {list(columns)}; expected 'messages' (chat), "
        "'instruction' + 'output' (instruction) or 'text' (text), or pass format= and rename the columns"
    )


def check_columns(columns: Sequence[str], format: str) -> None:
    """Raise `DatasetError` when the columns that `format` needs are missing."""
    needed = {"text": ["text"], "instruction": ["instruction", "output"], "chat": ["messages"]}
    if format not in needed:
        raise DatasetError(f"unknown dataset format {format!r}; use one of {list(FORMATS)}")
    missing = [c for c in needed[format] if c not in columns]
    if missing:
        optional = " (and optionally 'input')" if format == "instruction" else ""
        raise DatasetError(
            f"dataset format {format!r} needs columns {needed[format]}{optional}, but the dataset has "
            f"{list(columns)} (missing {missing}); rename the columns or pass another format="
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


def packs_by_default(format: str) -> bool:
    """Whether rows of `format` are packed when the run does not say: instruction and chat examples are, text
    keeps its concatenation into full blocks."""
    return format in ("instruction", "chat")


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


def local_files(source: str, suffixes: tuple[str, ...]) -> list[Path]:
    """The local files with `suffixes` that `source` names (itself, or those in its folder); none for a hub name."""
    path = Path(os.path.expanduser(source))
    found = sorted(path.rglob("*")) if path.is_dir() else [path] if path.is_file() else []
    return [p for p in found if p.is_file() and p.suffix.lower() in suffixes]


def check_parquet(path: Path) -> None:
    """A `DatasetError` for a .parquet file that does not begin and end with parquet's magic bytes."""
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(max(path.stat().st_size - 4, 0))
        tail = f.read(4)
    if head != b"PAR1" or tail != b"PAR1":
        raise DatasetError(f"{path} is not a parquet file (no PAR1 magic bytes: corrupt, cut short or another "
                           "format); re-export it, or give it the suffix of its format (.jsonl, .csv)")


def local_text_files(source: str) -> list[Path]:
    """The local json/jsonl/csv/txt files `source` names (itself, or those in its folder); none for a hub name."""
    return local_files(source, TEXT_SUFFIXES)


def check_utf8(path: Path, *, chunk: int = 1 << 20) -> None:
    """DatasetError naming the first byte of `path` that is not UTF-8 (read a chunk at a time)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with path.open("rb") as f:
        while True:
            block = f.read(chunk)
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as err:
                raise not_utf8(str(path), err, offset=offset) from None
            if not block:
                return
            offset += len(block)


def not_utf8(source: str, err: UnicodeDecodeError, *, offset: int = 0) -> DatasetError:
    """The one line for a dataset file that is not UTF-8 text."""
    return DatasetError(f"dataset {source!r} is not UTF-8 text (byte {err.object[err.start:err.start + 1]!r} at "
                        f"offset {offset + err.start}: {err.reason}); re-save it as UTF-8 (e.g. iconv -f latin1 -t "
                        "utf-8)")


def first_line(err: BaseException) -> str:
    """An exception's message cut to its first line (libraries' messages run on over several)."""
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


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
