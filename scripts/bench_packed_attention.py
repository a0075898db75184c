"""What one packed row costs against one padded row of the same length: why packing at seq 2048 on CPU ranks turns
less of the removed padding into speed than at seq 512 (docs/benchmarks/packing.md).

    python scripts/bench_packed_attention.py            # ~1 minute, one thread
    python scripts/bench_packed_attention.py --seq 512

The bench's tiny Llama (4 layers, hidden 128, 4 heads / 2 KV heads, intermediate 256, 256 ids) under sdpa, one row,
forward + backward, median of 5: causal (how a padded row runs: sdpa's causal flag) against packed position ids
(transformers' block-diagonal mask, and hfsplit's example-by-example path), then sdpa alone on one layer's shapes: the causal flag, the bool block mask, and
each example on its own (what a varlen kernel does). The row holds examples of decreasing length that fill it.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hfsplit.load.materialize import isolate_packed_rows
from hfsplit.models.varlen import block_masks

LENGTHS_2048 = [300, 250, 200, 180, 150, 150, 120, 120, 100, 100, 90, 80, 70, 60, 50, 28]


def example_lengths(seq: int) -> list[int]:
    """The 2048-position row's example lengths scaled to `seq`, the last one filling the row exactly."""
    lengths = [max(1, n * seq // 2048) for n in LENGTHS_2048[:-1]]
    return lengths + [seq - sum(lengths)]


def median_seconds(fn, runs: int = 5) -> float:
    """Median wall time of `fn` over `runs` calls after one warm-up."""
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def model_seconds(seq: int, lengths: list[int]) -> tuple[float, float, float]:
    """(causal, packed with the block mask, packed example by example) forward + backward seconds of the tiny Llama
    on one row of `seq` positions (packed rows as `hfsplit.from_pretrained` runs them: `isolate_packed_rows`)."""
    config = LlamaConfig(vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=256, max_position_embeddings=max(seq, 2048),
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    isolate_packed_rows(model)
    ids = torch.randint(0, 256, (1, seq))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]

    def step(**kw):
        model(input_ids=ids, labels=ids, use_cache=False, **kw).loss.backward()
        model.zero_grad()
    with block_masks():
        masked = median_seconds(lambda: step(position_ids=positions))
    return median_seconds(step), masked, median_seconds(lambda: step(position_ids=positions))


def sdpa_seconds(seq: int, lengths: list[int]) -> tuple[float, float, float]:
    """(causal flag, bool block mask, example by example) forward + backward seconds of one layer's sdpa."""
    q, k, v = (torch.randn(1, 4, seq, 32, requires_grad=True) for _ in range(3))
    example = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = (example[:, None] == example[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    attend = torch.nn.functional.scaled_dot_product_attention

    def each_alone():
        start = 0
        for n in lengths:
            part = slice(start, start + n)
            attend(q[:, :, part], k[:, :, part], v[:, :, part], is_causal=True).sum().backward()
            start += n
    return (median_seconds(lambda: attend(q, k, v, is_causal=True).sum().backward()),
            median_seconds(lambda: attend(q, k, v, attn_mask=mask[None, None]).sum().backward()),
            median_seconds(each_alone))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    seq = parser.parse_args().seq
    torch.set_num_threads(1)
    torch.manual_seed(0)
    lengths = example_lengths(seq)
    causal, packed, varlen = model_seconds(seq, lengths)
    flag, masked, alone = sdpa_seconds(seq, lengths)
    print(f"one row of {seq} positions, {len(lengths)} examples of {min(lengths)}-{max(lengths)} tokens, forward + backward")
    print(f"model: causal {causal * 1e3:.0f} ms, packed (block mask) {packed * 1e3:.0f} ms ({packed / causal:.2f}x); "
          f"at most {causal / packed:.0%} of the removed padding turns into speed")
    print(f"model: packed, example by example (hfsplit.models.varlen) {varlen * 1e3:.0f} ms ({varlen / causal:.2f}x); "
          f"at most {min(1.0, causal / varlen):.0%} of the removed padding turns into speed")
    print(f"sdpa, one layer: causal flag {flag * 1e3:.0f} ms, bool block mask {masked * 1e3:.0f} ms "
          f"({masked / flag:.2f}x), each example alone {alone * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
