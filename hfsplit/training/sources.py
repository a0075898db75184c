"""Where fine-tuning examples come from, before any of them is tokenized: a dataset source (a local file or folder, or
a hub name) read into examples, each bad file refused in one line, its format detected from the columns, and
the sets bundled with hfsplit. No torch: `hfsplit plan` reads the format (whether rows pack) while it parses
the options; `hfsplit.training.data` turns the examples into token rows.
"""
from __future__ import annotations

import codecs
import os
from pathlib import Path
from typing import Any, Sequence

from hfsplit.errors import HfsplitError

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


class DatasetError(HfsplitError, ValueError):
    """A dataset that cannot be read or turned into training rows (missing columns, empty, ...)."""


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


def packs_by_default(format: str) -> bool:
    """Whether rows of `format` are packed when the run does not say: instruction and chat examples are, text
    keeps its concatenation into full blocks."""
    return format in ("instruction", "chat")


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
