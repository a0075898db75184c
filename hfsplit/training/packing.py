"""Examples → fixed-length training rows: one example a row (padded), or packed by best-fit decreasing.

An example is a pair of token lists, its input ids and its labels (-100 where the loss does not count; the model
shifts them itself). Packing puts several examples in one row of `seq_len` as TRL's `bfd` strategy does: longest
first, each into the row whose free space fits it most tightly, never splitting one. Inside a row:

- each example's position ids restart at 0, which is how transformers' mask builders (`create_causal_mask` with
  `position_ids` and no 2-D mask) and its flash-attention path find where one example ends and the next begins:
  attention never crosses examples, sliding windows included;
- each example's first label is -100, so its first token never learns to follow the previous example's last
  (as `DataCollatorWithFlattening`'s `separator_id`);
- the padding that is left at the end continues the last example's positions: a row holding one example is
  then an ordinary causal row (under sdpa no mask is materialised for it), and padding is never a label.

The packer is general: any (ids, labels) pairs, so chosen and rejected answers of a preference pair can share one
row isolated from each other (`pack_row` lays out given examples in order).
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

IGNORE_INDEX = -100

Example = tuple[Sequence[int], Sequence[int]]  # (input ids, labels)


@dataclass(frozen=True)
class TokenRows:
    """Fixed-length training rows: `input_ids` and `labels`, both (num_rows, seq_len) int64.

    Args:
        input_ids: the rows' tokens.
        labels: -100 where the loss does not count.
        position_ids: each position's index within its example; None: every row is one sequence from 0.
        lengths: real (non-padding) tokens per row, padding being at the end; None: every position is real.
        examples: how many examples the rows hold when each would otherwise be a padded row of its own
            (None for text cut into blocks, which has no padded layout).
        sequences: each position's example by its index in the examples given (-1 on padding); None: not kept
            (DPO's packed pairs keep it: each sequence's log-prob is summed by it).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: Optional[torch.Tensor] = None
    lengths: Optional[torch.Tensor] = None
    examples: Optional[int] = None
    sequences: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def packed(self) -> bool:
        """Whether some row holds more than one example."""
        return self.examples is not None and self.examples > len(self)

    def positions(self) -> torch.Tensor:
        """The position ids of every row (0, 1, ... where each row is one sequence)."""
        if self.position_ids is not None:
            return self.position_ids
        return torch.arange(self.seq_len).repeat(len(self), 1)

    def real_tokens(self) -> torch.Tensor:
        """Real (non-padding) tokens per row."""
        return self.lengths if self.lengths is not None else torch.full((len(self),), self.seq_len)

    def select(self, index) -> "TokenRows":
        """The rows at `index` (a slice or index tensor); `examples` is kept only for whole-table views."""
        pick = (lambda t: None if t is None else t[index])
        return TokenRows(self.input_ids[index], self.labels[index], pick(self.position_ids), pick(self.lengths),
                         sequences=pick(self.sequences))

    @property
    def padding(self) -> float:
        """The fraction of positions that are padding."""
        return 1.0 - float(self.real_tokens().sum()) / max(self.input_ids.numel(), 1)

    @property
    def padded_padding(self) -> Optional[float]:
        """The padding fraction of the same examples one a row (None for text cut into blocks)."""
        if self.examples is None or not self.examples:
            return None
        return 1.0 - float(self.real_tokens().sum()) / (self.examples * self.seq_len)


def label_tokens(labels: torch.Tensor) -> int:
    """The tokens a causal-LM loss counts in `labels` `(rows, seq)`: those after the shift that are not -100
    (what transformers' Trainer passes as `num_items_in_batch`)."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def isolated(labels: Sequence[int]) -> list[int]:
    """`labels` with the first one -100: in a packed row the example's first token follows another example's
    last, which it must not learn (the shift makes label i the target of position i - 1)."""
    return [IGNORE_INDEX, *labels[1:]] if len(labels) else []


def truncated(examples: Sequence[Example], seq_len: int) -> list[tuple[list[int], list[int]]]:
    """Each example cut to `seq_len` tokens, as padded rows cut them."""
    return [(list(ids[:seq_len]), list(labels[:seq_len])) for ids, labels in examples]


def pack_row(examples: Sequence[Example], *, seq_len: int, pad: int) -> tuple[list[int], list[int], list[int]]:
    """(input ids, labels, position ids) of one row holding `examples` in order, each isolated, padded to
    `seq_len` (the padding continues the last example's positions and is never a label).

    Args:
        examples: (ids, labels) pairs whose lengths add up to at most `seq_len`.
        seq_len: tokens per row.
        pad: the padding token id.
    """
    ids, labels, positions = [], [], []
    for example_ids, example_labels in examples:
        ids += list(example_ids)
        labels += isolated(example_labels)
        positions += range(len(example_ids))
    if len(ids) > seq_len:
        raise ValueError(f"examples of {len(ids)} tokens do not fit a row of {seq_len}")
    fill = seq_len - len(ids)
    last = positions[-1] + 1 if positions else 0
    return ids + [pad] * fill, labels + [IGNORE_INDEX] * fill, positions + list(range(last, last + fill))


def best_fit_decreasing(lengths: Sequence[int], capacity: int, *, seed: int = 0) -> list[list[int]]:
    """Bins (lists of indices into `lengths`) of at most `capacity`, by best-fit decreasing: longest first,
    each into the bin whose free space fits it most tightly, a new bin when none does.

    Equal lengths are taken in an order drawn from `seed`, so the bins depend on (lengths, capacity, seed) only.
    The number of bins, and the lengths each holds, do not depend on the seed: equal lengths are interchangeable.

    Args:
        lengths: each item's size, at most `capacity`.
        capacity: a bin's size.
        seed: tie-breaking among equal lengths.
    """
    if any(n > capacity or n < 1 for n in lengths):
        raise ValueError(f"every length must be in 1..{capacity}")
    tie = np.random.default_rng([seed, len(lengths)]).permutation(len(lengths))
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], tie[i]))
    bins: list[list[int]] = []
    by_space: dict[int, deque[int]] = {}  # free space → bins with exactly that much, oldest first
    spaces: list[int] = []  # the free spaces some bin has, sorted
    for item in order:
        n = lengths[item]
        at = bisect.bisect_left(spaces, n)
        if at == len(spaces):  # no bin has room: a new one
            bins.append([])
            chosen, space = len(bins) - 1, capacity
        else:
            space = spaces[at]
            chosen = by_space[space].popleft()
            if not by_space[space]:
                del by_space[space], spaces[at]
        bins[chosen].append(item)
        left = space - n
        if left:
            if left not in by_space:
                by_space[left] = deque()
                bisect.insort(spaces, left)
            by_space[left].append(chosen)
    return bins


def packed_rows(examples: Sequence[Example], *, seq_len: int, pad: int, seed: int = 0) -> TokenRows:
    """`examples` packed into rows of `seq_len` by best-fit decreasing (`best_fit_decreasing`, `pack_row`);
    an example longer than `seq_len` is cut to it first, empty ones are dropped.

    Args:
        examples: (ids, labels) pairs.
        seq_len: tokens per row.
        pad: the padding token id.
        seed: the tie-breaking seed of the bins, and of the order of the rows.
    """
    kept = [e for e in truncated(examples, seq_len) if e[0]]
    bins = drawn_bins([len(ids) for ids, _ in kept], seq_len, seed=seed)
    rows = [pack_row([kept[i] for i in members], seq_len=seq_len, pad=pad) for members in bins]
    lengths = [sum(len(kept[i][0]) for i in members) for members in bins]
    return _table(rows, lengths, examples=len(kept))


def drawn_bins(lengths: Sequence[int], capacity: int, *, seed: int) -> list[list[int]]:
    """`best_fit_decreasing`'s bins in an order drawn from `seed`: bins are made longest item first, and rows held
    out for evaluation are the first ones."""
    bins = best_fit_decreasing(lengths, capacity, seed=seed)
    return [bins[i] for i in np.random.default_rng([seed, len(bins)]).permutation(len(bins))]


def packed_groups(groups: Sequence[Sequence[Example]], *, seq_len: int, pad: int, seed: int = 0) -> TokenRows:
    """Groups of examples packed into rows of `seq_len` by best-fit decreasing on each group's total length, a
    group never split across rows (DPO: a pair's chosen and rejected sequences in one row), each example isolated
    (`pack_row`). `sequences` numbers the examples as they are given, group after group.

    Args:
        groups: lists of (ids, labels) pairs, each list's lengths adding up to at most `seq_len`.
        seq_len: tokens per row.
        pad: the padding token id.
        seed: the tie-breaking seed of the bins, and of the order of the rows.
    """
    firsts = np.cumsum([0, *(len(g) for g in groups)])
    bins = drawn_bins([sum(len(ids) for ids, _ in g) for g in groups], seq_len, seed=seed)
    rows, lengths, sequences = [], [], []
    for members in bins:
        examples = [(e, firsts[g] + k) for g in members for k, e in enumerate(groups[g])]
        rows.append(pack_row([e for e, _ in examples], seq_len=seq_len, pad=pad))
        lengths.append(sum(len(ids) for (ids, _), _ in examples))
        owner = [int(n) for (ids, _), n in examples for _ in ids]
        sequences.append(owner + [-1] * (seq_len - len(owner)))
    table = _table(rows, lengths, examples=int(firsts[-1]))
    return TokenRows(table.input_ids, table.labels, table.position_ids, table.lengths, table.examples,
                     sequences=torch.tensor(sequences, dtype=torch.int64))


def padded_rows(examples: Sequence[Example], *, seq_len: int, pad: int) -> TokenRows:
    """One example a row, cut to `seq_len` and padded on the right (pad ids, -100 labels)."""
    kept = truncated(examples, seq_len)
    rows = [pack_row([e], seq_len=seq_len, pad=pad) for e in kept]
    return _table(rows, [len(ids) for ids, _ in kept], examples=len(kept))


def _table(rows: list[tuple[list[int], list[int], list[int]]], lengths: list[int], *, examples: int) -> TokenRows:
    def column(i: int) -> torch.Tensor:
        return torch.tensor([r[i] for r in rows], dtype=torch.int64)

    return TokenRows(input_ids=column(0), labels=column(1), position_ids=column(2),
                     lengths=torch.tensor(lengths, dtype=torch.int64), examples=examples)
