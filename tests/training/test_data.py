"""Data: formats → token rows (checked token by token), file types, errors, deterministic batches."""
import json

import pandas as pd
import pytest
import torch

from hfsplit.errors import HfsplitError
from hfsplit.checkpoint.synthetic import tiny_tokenizer
from hfsplit.training.data import (ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, BUNDLED_DIR, IGNORE_INDEX, DatasetError, TokenRows,
                                   bundled_dataset_path, detect_format, load_token_rows, concatenated_text_rows,
                                   token_rows)
from hfsplit.training.batches import MicroBatches, micro_batches

PAD, UNK, BOS, EOS, IM_START, IM_END = range(6)
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
X = IGNORE_INDEX


def char_tokenizer(*, add_bos: bool = False):
    """One token per character, id = ord(char), specials 0-5: expected ids can be written by hand."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials)} | {chr(c): c for c in [10, *range(32, 127)]}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        extra_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    wrapped.chat_template = CHATML
    return wrapped


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


@pytest.fixture(scope="module")
def chars():
    return char_tokenizer()


@pytest.fixture(scope="module")
def tiny():
    return tiny_tokenizer()


# --- text -------------------------------------------------------------------------------------


def test_text_is_packed_into_full_blocks_with_eos_between_documents(chars):
    rows = concatenated_text_rows(["ab", "cde", "", "fg"], chars, seq_len=4)
    # stream: a b EOS c | d e EOS f | g EOS  ← remainder dropped
    expected = torch.tensor([[*ids("ab"), EOS, *ids("c")], [*ids("de"), EOS, *ids("f")]])
    assert torch.equal(rows.input_ids, expected)
    assert torch.equal(rows.labels, expected)


def test_text_shorter_than_one_block_is_an_error(chars):
    with pytest.raises(DatasetError, match="fewer than one block of seq_len=8"):
        concatenated_text_rows(["abc"], chars, seq_len=8)


# --- instruction ------------------------------------------------------------------------------


def test_instruction_masks_prompt_and_padding_and_supervises_response_with_eos(chars):
    prompt = ALPACA_PROMPT_NO_INPUT.format(instruction="Hi")
    rows = token_rows(FakeDataset(instruction=["Hi"], output=["yo"]), chars, seq_len=len(prompt) + 5)
    assert rows.input_ids.tolist() == [[*ids(prompt), *ids("yo"), EOS, PAD, PAD]]
    assert rows.labels.tolist() == [[X] * len(prompt) + [*ids("yo"), EOS, X, X]]


def test_instruction_with_input_uses_the_input_template(chars):
    prompt = ALPACA_PROMPT.format(instruction="Rev", input="ab")
    rows = token_rows(FakeDataset(instruction=["Rev"], input=["ab"], output=["ba"]), chars, seq_len=len(prompt) + 3)
    assert rows.input_ids.tolist() == [[*ids(prompt), *ids("ba"), EOS]]
    assert rows.labels.tolist() == [[X] * len(prompt) + [*ids("ba"), EOS]]


def test_instruction_bos_from_the_tokenizer_starts_the_masked_prompt():
    prompt = ALPACA_PROMPT_NO_INPUT.format(instruction="Hi")
    data = FakeDataset(instruction=["Hi"], output=["yo"])
    rows = token_rows(data, char_tokenizer(add_bos=True), seq_len=len(prompt) + 4)
    assert rows.input_ids.tolist() == [[BOS, *ids(prompt), *ids("yo"), EOS]]
    assert rows.labels.tolist() == [[X, *[X] * len(prompt), *ids("yo"), EOS]]


def test_instruction_truncation_keeps_rows_with_a_response_token_and_drops_the_rest(chars):
    short, long = ALPACA_PROMPT_NO_INPUT.format(instruction="Hi"), ALPACA_PROMPT_NO_INPUT.format(instruction="Hello")
    data = FakeDataset(instruction=["Hi", "Hello"], output=["yo", "yo"])
    rows = token_rows(data, chars, seq_len=len(short) + 1)  # "Hello" prompt is 3 chars longer: no response left
    assert rows.input_ids.tolist() == [[*ids(short), ord("y")]]
    assert rows.labels.tolist() == [[X] * len(short) + [ord("y")]]
    with pytest.raises(DatasetError, match="no instruction example has a response token within seq_len"):
        token_rows(data, chars, seq_len=len(short) - 1)
    assert len(long) > len(short)


# --- chat -------------------------------------------------------------------------------------


def test_chat_supervises_only_assistant_content_and_its_end_token(chars):
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "ok!"},
    ]
    segments = [  # (token ids, supervised?)
        ([IM_START, *ids("system\nS"), IM_END, *ids("\n")], False),
        ([IM_START, *ids("user\nhi"), IM_END, *ids("\n")], False),
        ([IM_START, *ids("assistant\n")], False),
        ([*ids("yo"), IM_END], True),
        (ids("\n"), False),
        ([IM_START, *ids("user\nq"), IM_END, *ids("\n")], False),
        ([IM_START, *ids("assistant\n")], False),
        ([*ids("ok!"), IM_END], True),
        (ids("\n"), False),
    ]
    expected_ids = [t for seg, _ in segments for t in seg]
    expected_labels = [t if sup else X for seg, sup in segments for t in seg]
    rows = token_rows(FakeDataset(messages=[messages]), chars, seq_len=len(expected_ids) + 2)
    assert rows.input_ids.tolist() == [expected_ids + [PAD, PAD]]
    assert rows.labels.tolist() == [expected_labels + [X, X]]


def test_chat_with_malformed_messages_names_the_example(chars):
    with pytest.raises(DatasetError, match="example 1: 'messages' must be a list"):
        token_rows(FakeDataset(messages=[[{"role": "user", "content": "a"}], [{"role": "user"}]]), chars, seq_len=8)


# --- files and errors -------------------------------------------------------------------------

RECORDS = [{"instruction": "Rev", "input": "ab", "output": "ba"}, {"instruction": "Up", "input": "", "output": "UP"}]


def write_records(path, records):
    if path.suffix == ".json":
        path.write_text(json.dumps(records))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif path.suffix == ".csv":
        pd.DataFrame(records).to_csv(path, index=False)
    else:
        pd.DataFrame(records).to_parquet(path)
    return path


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".csv", ".parquet"])
def test_each_file_type_loads_to_the_same_rows(chars, tmp_path, suffix):
    path = write_records(tmp_path / f"d{suffix}", RECORDS)
    rows = load_token_rows(str(path), chars, seq_len=200, cache_dir=str(tmp_path / "cache"))
    expected = token_rows(FakeDataset(**{k: [r[k] for r in RECORDS] for k in RECORDS[0]}), chars, seq_len=200)
    assert torch.equal(rows.input_ids, expected.input_ids) and torch.equal(rows.labels, expected.labels)


def test_txt_file_loads_as_text_one_document_per_line(chars, tmp_path):
    (tmp_path / "d.txt").write_text("ab\ncde\n")
    rows = load_token_rows(str(tmp_path / "d.txt"), chars, seq_len=3, cache_dir=str(tmp_path / "cache"))
    assert rows.input_ids.tolist() == [[*ids("ab"), EOS], [*ids("cde")]]


def test_missing_columns_error_lists_found_and_expected(chars, tmp_path):
    path = write_records(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "b"}])
    with pytest.raises(DatasetError, match=r"\['prompt', 'answer'\].*'messages'.*'instruction' \+ 'output'.*'text'"):
        load_token_rows(str(path), chars, seq_len=8, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DatasetError, match=r"needs columns \['instruction', 'output'\].*has \['prompt', 'answer'\]"):
        load_token_rows(str(path), chars, seq_len=8, format="instruction", cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".txt"])
def test_empty_file_is_an_error(chars, tmp_path, suffix):
    (tmp_path / f"e{suffix}").write_text("")
    with pytest.raises(DatasetError, match="is empty"):
        load_token_rows(str(tmp_path / f"e{suffix}"), chars, seq_len=8, cache_dir=str(tmp_path / "cache"))


def test_dataset_without_rows_is_an_error(chars, tmp_path):
    (tmp_path / "e.json").write_text("[]")
    with pytest.raises(DatasetError, match="has no examples"):
        load_token_rows(str(tmp_path / "e.json"), chars, seq_len=8, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DatasetError, match="has no examples"):
        token_rows(FakeDataset(text=[]), chars, seq_len=8)


def test_bad_paths_and_formats_are_errors(chars, tmp_path):
    assert isinstance(DatasetError("x"), HfsplitError)
    with pytest.raises(DatasetError, match="does not exist"):
        load_token_rows(str(tmp_path / "missing.jsonl"), chars, seq_len=8)
    (tmp_path / "d.xml").write_text("<a/>")
    with pytest.raises(DatasetError, match="extension '.xml'"):
        load_token_rows(str(tmp_path / "d.xml"), chars, seq_len=8)
    with pytest.raises(DatasetError, match="unknown dataset format 'code'"):
        token_rows(FakeDataset(text=["a"]), chars, seq_len=8, format="code")


@pytest.mark.parametrize(
    "columns, expected",
    [(["messages", "text"], "chat"), (["instruction", "input", "output"], "instruction"), (["text", "id"], "text")],
)
def test_detect_format(columns, expected):
    assert detect_format(columns) == expected


# --- batches ----------------------------------------------------------------------------------


def numbered_rows(n: int, seq_len: int = 3) -> TokenRows:
    rows = torch.arange(n).repeat_interleave(seq_len).view(n, seq_len)
    return TokenRows(input_ids=rows, labels=rows + 100)


def take(batches, n):
    return [next(batches)["input_ids"][:, 0].tolist() for _ in range(n)]


def test_batches_have_step_shape_and_cover_each_epoch_once():
    epoch = list(micro_batches(numbered_rows(13), micro_batch_size=2, num_micro_batches=3, seed=0, epoch=0))
    assert len(epoch) == 2  # 13 // 6: the last row does not fill a step
    for batch in epoch:
        assert batch["input_ids"].shape == batch["labels"].shape == (6, 3)
        assert torch.equal(batch["labels"], batch["input_ids"] + 100)
    seen = [i for b in epoch for i in b["input_ids"][:, 0].tolist()]
    assert len(set(seen)) == 12


def test_batches_are_the_same_for_the_same_seed_and_differ_across_seeds_and_epochs():
    def first_epoch(seed, epoch=0):
        batches = micro_batches(numbered_rows(64), micro_batch_size=4, num_micro_batches=2, seed=seed, epoch=epoch)
        return [b["input_ids"].tolist() for b in batches]

    assert first_epoch(7) == first_epoch(7)
    assert first_epoch(7) != first_epoch(8)
    assert first_epoch(7) != first_epoch(7, epoch=1)
    endless = MicroBatches(numbered_rows(64), micro_batch_size=4, num_micro_batches=2, seed=7)
    assert take(endless, 16) == [[row[0] for row in b] for b in first_epoch(7) + first_epoch(7, epoch=1)]


@pytest.mark.parametrize("steps_before", [0, 3, 4, 9])  # start, mid-epoch, epoch boundary, later epoch
def test_state_dict_resume_gives_the_same_next_batches(steps_before):
    run = MicroBatches(numbered_rows(17), micro_batch_size=2, num_micro_batches=2, seed=3)
    take(run, steps_before)
    state = json.loads(json.dumps(run.state_dict()))  # survives a checkpoint file
    resumed = MicroBatches(numbered_rows(17), micro_batch_size=2, num_micro_batches=2, seed=0)
    resumed.load_state_dict(state)
    assert take(resumed, 6) == take(run, 6)


def test_too_few_rows_for_one_step_is_an_error():
    with pytest.raises(DatasetError, match="fewer than one step of 4 micro-batches × 2 rows = 8"):
        MicroBatches(numbered_rows(5), micro_batch_size=2, num_micro_batches=4, seed=0)


# --- bundled data and tokenizer ---------------------------------------------------------------


def test_tiny_tokenizer_fits_the_tiny_models(tiny):
    assert len(tiny) <= 256 and max(tiny.get_vocab().values()) < 256
    assert (tiny.pad_token_id, tiny.bos_token_id, tiny.eos_token_id) == (PAD, BOS, EOS)
    assert tiny.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [IM_START, IM_END]
    text = "Reverse the word.\napple -> elppa, 12 + 30 = 42"
    assert tiny.decode(tiny(text)["input_ids"]) == text


@pytest.mark.parametrize("name, count", [("tiny_alpaca.jsonl", 300), ("tiny_chat.jsonl", 50), ("tiny_text.txt", None)])
def test_bundled_datasets_load_with_the_tiny_tokenizer(tiny, tmp_path, name, count):
    rows = load_token_rows(str(bundled_dataset_path(name)), tiny, seq_len=128, cache_dir=str(tmp_path / "cache"))
    assert rows.input_ids.max() < 256 and rows.seq_len == 128
    if count is not None:  # every example kept (packed several a row)
        assert rows.examples == count and len(rows) < count
    assert sum(p.stat().st_size for p in BUNDLED_DIR.iterdir()) < 200_000


def test_bundled_chat_supervises_exactly_the_assistant_replies(tiny):
    line = bundled_dataset_path("tiny_chat.jsonl").read_text().splitlines()[0]
    messages = json.loads(line)["messages"]
    rows = token_rows(FakeDataset(messages=[messages]), tiny, seq_len=256)
    supervised = [t for t in rows.labels[0].tolist() if t != X]
    replies = "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")
    assert tiny.decode(supervised) == replies


class FakeDataset:
    """Column access, `column_names` and `len`, like `datasets.Dataset`, without the cache machinery."""

    def __init__(self, **columns):
        self.columns = columns

    @property
    def column_names(self):
        return list(self.columns)

    def __len__(self):
        return len(next(iter(self.columns.values())))

    def __getitem__(self, name):
        return self.columns[name]


def test_bundled_files_are_what_the_script_regenerates(tmp_path):
    from hfsplit.checkpoint.synthetic import TINY_TOKENIZER_DIR
    from hfsplit.training.make_tiny import main

    main([str(tmp_path)])
    for committed in [*BUNDLED_DIR.glob("tiny_*"), *TINY_TOKENIZER_DIR.iterdir()]:
        made = tmp_path / ("bundled" if committed.parent == BUNDLED_DIR else "tiny_tokenizer") / committed.name
        assert made.read_bytes() == committed.read_bytes(), committed.name


def test_a_resume_with_another_global_batch_continues_from_the_same_row(tmp_path):
    """Under another split the global batch may change: the rows consumed carry over, or a clear refusal."""
    from hfsplit.training.resume import data_position_for

    rows = TokenRows(input_ids=torch.arange(64).unsqueeze(1), labels=torch.arange(64).unsqueeze(1))
    before = MicroBatches(rows, micro_batch_size=2, num_micro_batches=4, seed=3)
    for _ in range(5):
        next(before)  # 40 rows consumed
    saved = {"batches": before.state_dict(), "rows_per_step": before.batch_size}
    expected_next = next(before)["input_ids"]
    after = MicroBatches(rows, micro_batch_size=2, num_micro_batches=5, seed=3)  # 10 rows a step
    after.load_state_dict(data_position_for(saved, after, folder=tmp_path))
    assert torch.equal(next(after)["input_ids"][:8], expected_next)
    odd = MicroBatches(rows, micro_batch_size=2, num_micro_batches=6, seed=3)  # 12 rows: 40 is not a whole step
    with pytest.raises(HfsplitError, match="keep the global batch at 8 rows"):
        data_position_for(saved, odd, folder=tmp_path)
