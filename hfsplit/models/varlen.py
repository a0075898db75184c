"""Packed rows under sdpa, example by example: each example's attention costs what the example costs alone.

A packed row (position ids restarting at each example) under sdpa used to get transformers' materialised
block-diagonal mask, and sdpa computes every block of the L × L score matrix under a mask: on CPU a packed row cost
1.54× a causal row of the same length at seq 2048 (docs/benchmarks/packing.md). Here a stage (and the
single-process model) hands each layer a `PackedRows` in place of the mask: where each example of each row starts
and ends, found once per micro-batch from the position ids as transformers finds packed examples
(`masking_utils.find_packed_sequence_indices`: a new example wherever a position is not the previous one plus 1).
transformers' sdpa attention function, registered again under its own name (`AttentionInterface.register("sdpa",
...)`), takes a `PackedRows` mask by gathering the examples of equal length of the micro-batch into one batch and
calling transformers' own sdpa function on it, with sdpa's causal flag (or, inside a sliding window shorter than
the examples, a boolean `l × l` window mask), then putting the outputs back in row order. Scaling, GQA and dropout
are transformers' function's own. Any other mask (a tensor, None) goes to transformers' function unchanged, so
models hfsplit does not hand a `PackedRows` run as before.

Not on this path (they keep transformers' block-diagonal mask): eager attention (it computes the whole L × L score
matrix for a causal row too, so a packed row costs what a padded one does; and each family's eager function holds
its own soft-capping or attention sinks), flex and flash attention (transformers' BlockMask and varlen paths),
and every call with a cache (generation).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

IMPLEMENTATION = "sdpa"  # the attention implementation whose packed rows run example by example
_SWITCH = {"on": True, "calls": 0}  # `block_masks()` turns the path off; calls: how often it ran (tests read it)


@dataclass(frozen=True, eq=False)
class PackedRows:
    """Where the examples of a micro-batch's packed rows lie, as a layer's attention mask.

    Args:
        batch, seq: the micro-batch's shape.
        groups: (example length, flat indices into the `batch · seq` positions of every example of that length,
            example after example), one entry per distinct length.
        order: for each flat position, its index in the concatenation of the groups (puts outputs back in order).
        window: the layer type's sliding window (None: full causal attention).
    """

    batch: int
    seq: int
    groups: tuple[tuple[int, torch.Tensor], ...]
    order: torch.Tensor
    window: Optional[int] = None

    def with_window(self, window: Optional[int]) -> "PackedRows":
        """The same examples under a sliding window of `window` tokens (None: full attention)."""
        return PackedRows(self.batch, self.seq, self.groups, self.order, window)

    def index_bytes(self) -> int:
        """Bytes of the index tensors (what the path holds per micro-batch instead of an L × L mask)."""
        return sum(index.numel() * index.element_size() for _, index in self.groups) + \
            self.order.numel() * self.order.element_size()

    def window_mask(self, length: int, device) -> Optional[torch.Tensor]:
        """The boolean `length × length` mask of an example under the window (None: sdpa's causal flag does)."""
        if self.window is None or length <= self.window:
            return None
        q, kv = torch.arange(length, device=device)[:, None], torch.arange(length, device=device)[None, :]
        return ((kv <= q) & (kv > q - self.window))[None, None]


@contextlib.contextmanager
def block_masks():
    """Within it, packed rows under sdpa get transformers' block-diagonal mask again (tests compare both paths)."""
    _SWITCH["on"] = False
    try:
        yield
    finally:
        _SWITCH["on"] = True


def enabled() -> bool:
    """Whether packed rows under sdpa run example by example (outside `block_masks()`)."""
    return _SWITCH["on"]


def calls() -> int:
    """How many attention calls ran example by example in this process."""
    return _SWITCH["calls"]


def example_lengths(position_ids: torch.Tensor) -> list[list[int]]:
    """Per row, the lengths of its examples: a new one wherever a position is not the previous one plus 1."""
    rows = []
    for row in position_ids.tolist():
        lengths, run = [], 0
        for i, p in enumerate(row):
            if i and p != row[i - 1] + 1:
                lengths.append(run)
                run = 0
            run += 1
        rows.append(lengths + [run])
    return rows


def is_packed(position_ids: torch.Tensor) -> bool:
    """Whether some row's position ids restart inside it."""
    return position_ids.shape[-1] > 1 and bool((position_ids.diff(dim=-1) != 1).any())


def packed_rows(lengths: list[list[int]], *, seq: int, device, window: Optional[int] = None) -> PackedRows:
    """The `PackedRows` of rows holding examples of `lengths` (each row's lengths sum to `seq`), index tensors on
    `device` (built from Python lists, so under FakeTensorMode too)."""
    by_length: dict[int, list[int]] = {}
    for r, row in enumerate(lengths):
        start = r * seq
        for n in row:
            by_length.setdefault(n, []).extend(range(start, start + n))
            start += n
    flat = [i for n in sorted(by_length) for i in by_length[n]]
    order = [0] * len(flat)
    for at, i in enumerate(flat):
        order[i] = at
    groups = tuple((n, torch.tensor(by_length[n], dtype=torch.long, device=device)) for n in sorted(by_length))
    return PackedRows(len(lengths), seq, groups, torch.tensor(order, dtype=torch.long, device=device), window)


def packed_rows_of(position_ids: torch.Tensor) -> PackedRows:
    """The `PackedRows` of a micro-batch's position ids `(batch, seq)` (one host read of the ids)."""
    return packed_rows(example_lengths(position_ids), seq=position_ids.shape[-1], device=position_ids.device)


def packed_sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention function, example by example where the mask is a `PackedRows`."""
    if not isinstance(attention_mask, PackedRows):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows = attention_mask
    _SWITCH["calls"] += 1
    batch, seq = query.shape[0], query.shape[2]

    def flat(t: torch.Tensor) -> torch.Tensor:  # (batch, heads, seq, dim) → (batch · seq, heads, dim)
        return t.transpose(1, 2).reshape(batch * seq, t.shape[1], t.shape[3])

    q, k, v = flat(query), flat(key), flat(value)
    outputs = []
    for length, index in rows.groups:
        count = index.numel() // length

        def part(t: torch.Tensor) -> torch.Tensor:  # the group's examples as a batch (count, heads, length, dim)
            return t.index_select(0, index).view(count, length, t.shape[1], t.shape[2]).transpose(1, 2)
        out, _ = sdpa_attention_forward(module, part(q), part(k), part(v), rows.window_mask(length, query.device),
                                        **kwargs)
        outputs.append(out.reshape(count * length, out.shape[2], out.shape[3]))
    out = torch.cat(outputs).index_select(0, rows.order)
    return out.view(batch, seq, out.shape[1], out.shape[2]), None


AttentionInterface.register(IMPLEMENTATION, packed_sdpa_attention_forward)
