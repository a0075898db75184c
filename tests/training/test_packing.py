"""The packer: best-fit decreasing bins, isolated examples inside a row, the rows of each format packed or padded."""
import random

import pytest
import torch
from transformers.masking_utils import find_packed_sequence_indices

from hfsplit.checkpoint.synthetic import tiny_tokenizer
from hfsplit.training.data import bundled_dataset_path, load_token_rows, token_rows
from hfsplit.training.batches import MicroBatches
from hfsplit.training.packing import (
    IGNORE_INDEX, best_fit_decreasing, pack_row, packed_rows, padded_rows,
)
from tests.training.test_data import ALPACA_PROMPT_NO_INPUT, EOS, PAD, FakeDataset, char_tokenizer, ids

X = IGNORE_INDEX


def test_best_fit_decreasing_puts_each_item_where_it_fits_most_tightly():
    # longest first: 7 opens bin 0 (3 free), 6 opens bin 1 (4 free), 4 fills bin 1, 3 fills bin 0, 2 opens bin 2
    assert best_fit_decreasing([3, 7, 2, 6, 4], 10) == [[1, 0], [3, 4], [2]]
    # best fit, not first fit: 2 goes to the bin with 2 free (bin 1), not the one with 5 (bin 0)
    assert best_fit_decreasing([5, 8, 2], 10) == [[1, 2], [0]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_best_fit_decreasing_never_splits_or_overfills_and_depends_only_on_the_seed(seed):
    rnd = random.Random(seed)
    lengths = [min(512, int(rnd.paretovariate(1.2) * 20)) for _ in range(2000)]
    bins = best_fit_decreasing(lengths, 512, seed=seed)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # every item exactly once
    assert all(sum(lengths[i] for i in b) <= 512 for b in bins)
    assert bins == best_fit_decreasing(lengths, 512, seed=seed)
    other = best_fit_decreasing(lengths, 512, seed=seed + 10)
    assert other != bins  # equal lengths are drawn in another order ...
    # ... and are interchangeable: the bins hold the same lengths whatever the seed
    assert sorted(sorted(lengths[i] for i in b) for b in other) == sorted(sorted(lengths[i] for i in b) for b in bins)
    fill = sum(lengths) / (512 * len(bins))
    assert fill > 0.95  # a long-tailed spread packs tight
    with pytest.raises(ValueError, match="1..512"):
        best_fit_decreasing([513], 512)


def test_a_packed_row_isolates_each_example_and_pads_after_the_last():
    row_ids, labels, positions = pack_row([([1, 2, 3], [X, 2, 3]), ([4, 5], [4, 5])], seq_len=8, pad=0)
    assert row_ids == [1, 2, 3, 4, 5, 0, 0, 0]
    # the second example's first token never learns to follow the first's last; padding is never a label
    assert labels == [X, 2, 3, X, 5, X, X, X]
    # positions restart per example; the padding continues the last one, so transformers sees two sequences
    assert positions == [0, 1, 2, 0, 1, 2, 3, 4]
    found = find_packed_sequence_indices(torch.tensor([positions]))
    assert found.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1]]
    # one example and padding: an ordinary causal row (sdpa builds no mask for it)
    assert find_packed_sequence_indices(torch.tensor([pack_row([([1, 2], [1, 2])], seq_len=5, pad=0)[2]])) is None
    with pytest.raises(ValueError, match="do not fit"):
        pack_row([([1] * 5, [1] * 5), ([2] * 4, [2] * 4)], seq_len=8, pad=0)


def test_packed_and_padded_rows_hold_the_same_examples():
    rnd = random.Random(0)
    examples = [([rnd.randrange(6, 100) for _ in range(n)], None) for n in [5, 1, 9, 12, 3, 7, 7, 2]]
    examples = [(e, [X] + e[1:]) for e, _ in examples]
    packed = packed_rows(examples, seq_len=10, pad=PAD, seed=0)
    padded = padded_rows(examples, seq_len=10, pad=PAD)
    assert padded.examples == packed.examples == len(examples) and len(padded) == len(examples)
    assert len(packed) < len(examples) and packed.packed and not padded.packed
    # every example (the 12-token one cut to 10) appears whole in one packed row, at position ids 0..n-1
    found = []
    for row in range(len(packed)):
        pos = packed.position_ids[row].tolist()
        starts = [i for i, p in enumerate(pos) if p == 0] + [int(packed.lengths[row])]
        found += [packed.input_ids[row, a:b].tolist() for a, b in zip(starts, starts[1:])]
    assert sorted(found) == sorted(e[:10] for e, _ in examples)
    assert int(packed.lengths.sum()) == int(padded.lengths.sum()) == sum(min(len(e), 10) for e, _ in examples)
    assert packed.padding < padded.padding


def test_instruction_examples_pack_into_rows_with_their_masks(chars):
    prompt = ALPACA_PROMPT_NO_INPUT.format(instruction="Hi")
    data = FakeDataset(instruction=["Hi", "Hi"], output=["yo", "abc"])
    seq = 2 * len(prompt) + 8
    rows = token_rows(data, chars, seq_len=seq)  # instruction data packs by default
    first, second = (ids(prompt) + ids("abc") + [EOS]), (ids(prompt) + ids("yo") + [EOS])  # longest first
    assert rows.input_ids.tolist() == [first + second + [PAD]]
    assert rows.labels.tolist() == [[X] * len(prompt) + ids("abc") + [EOS] + [X] * len(prompt) + ids("yo")
                                    + [EOS, X]]
    assert rows.position_ids.tolist() == [list(range(len(first))) + list(range(len(second) + 1))]
    padded = token_rows(data, chars, seq_len=seq, packing=False)
    assert padded.input_ids.tolist() == [second + [PAD] * (seq - len(second)), first + [PAD] * (seq - len(first))]
    assert padded.position_ids.tolist() == [list(range(seq))] * 2


def test_text_packing_isolates_documents_and_cuts_long_ones(chars):
    data = FakeDataset(text=["ab", "cdefghi", "", "jk"])
    joined = token_rows(data, chars, seq_len=4)  # text: concatenated by default
    assert joined.position_ids is None and not joined.packed
    rows = token_rows(data, chars, seq_len=4, packing=True)
    # documents with their EOS: [a b EOS] [c d e f] [g h i EOS] [j k EOS]: four pieces, none fits beside another
    assert sorted(rows.input_ids.tolist()) == sorted([[*ids("ab"), EOS, PAD], [*ids("cdef")], [*ids("ghi"), EOS],
                                                      [*ids("jk"), EOS, PAD]])
    assert all(row[0] == X for row in rows.labels.tolist())


def test_batches_carry_position_ids_and_real_lengths():
    rows = packed_rows([([7] * n, [7] * n) for n in (3, 5, 2, 6, 4, 4)], seq_len=8, pad=PAD)
    batches = MicroBatches(rows, micro_batch_size=1, num_micro_batches=len(rows), seed=0)
    batch = next(batches)
    assert set(batch) == {"input_ids", "labels", "position_ids", "lengths", "index"}
    assert batch["position_ids"].shape == batch["input_ids"].shape
    assert int(batch["lengths"].sum()) == 24
    plain = MicroBatches(padded_rows([([1, 2], [1, 2])] * 4, seq_len=3, pad=PAD), micro_batch_size=2,
                         num_micro_batches=1, seed=0)
    assert next(plain)["position_ids"].tolist() == [[0, 1, 2], [0, 1, 2]]


def test_bundled_instruction_data_packs_rows_at_least_95_percent_full():
    rows = load_token_rows(str(bundled_dataset_path("tiny_alpaca.jsonl")), tiny_tokenizer(), seq_len=512)
    padded = load_token_rows(str(bundled_dataset_path("tiny_alpaca.jsonl")), tiny_tokenizer(), seq_len=512,
                             packing=False)
    assert rows.examples == padded.examples == len(padded)
    assert rows.padding < 0.05 < 0.5 < padded.padding
    assert int(rows.lengths.sum()) == int(padded.lengths.sum())


@pytest.fixture(scope="module")
def chars():
    return char_tokenizer()


def test_the_final_line_says_how_much_padding_packing_removed():
    from hfsplit.training.metrics import TrainResult, summary_line

    # 100 real tokens: one a row they filled 1000 positions (90% padding); packed, 110 (10 of padding): 99% removed
    line = summary_line(TrainResult(losses=[1.0], tokens_per_s=500, trained_tokens_per_s=300, padding=10 / 110,
                                    padded_padding=0.9))
    assert "500 tokens/s (300 trained), padding 9.1% (one example a row: 90.0%; packing removed 99% of it)" in line
    assert "packing removed" not in summary_line(TrainResult(losses=[1.0], padding=0.5))
