"""Where a QLoRA step's time goes on this device: bitsandbytes' dequantize against the matmuls it feeds.

    python scripts/profile_qlora.py                 # ~2 minutes on 2 quiet CPU cores
    python scripts/profile_qlora.py --tokens 512,2048 --shapes 256x768,4096x14336

Two tables, one thread:
- per `Linear4bit` (NF4 + double quantization, fp32 compute, train mode): one dequantize of the weight
  against one matmul of `tokens × in` by it. Both scale with the weight's size, so their ratio depends on the
  tokens per micro-batch, not on the hidden size;
- one process training the bench's tiny Llama (8×256, seq 256, LoRA r=8 on a 4-bit base, transformers +
  bitsandbytes + peft, activation checkpointing) on the same 16 rows as M micro-batches: step time and the
  share of bitsandbytes' dequantize ops (`dequantize_4bit`, and `dequantize_blockwise` for the double-quantized
  absmax) in the profiler's self time.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def timed(fn, repeats: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def linear_rows(shapes: list[tuple[int, int]], tokens: list[int]) -> None:
    import bitsandbytes.functional as F

    from hfsplit.apply.quantize import quantization_config, quantize_linear

    print("| weight (out × in) | tokens | dequantize ms | matmul ms | dequantize / matmul |\n|---|---|---|---|---|")
    for features, out in shapes:
        layer = quantize_linear(torch.nn.Linear(features, out, bias=False), quantization_config(compute_dtype="float32"),
                                device=torch.device("cpu"))
        weight = layer.weight
        dense = F.dequantize_4bit(weight.data, weight.quant_state)
        dq = timed(lambda: F.dequantize_4bit(weight.data, weight.quant_state))
        for n in tokens:
            x = torch.randn(n, features)
            mm = timed(lambda: x @ dense.t())
            print(f"| {out} × {features} | {n} | {dq:.2f} | {mm:.2f} | {dq / mm:.2f} |", flush=True)


def step_rows(splits: list[int]) -> None:
    from peft import LoraConfig, get_peft_model
    from torch.profiler import profile
    from transformers import AutoModelForCausalLM

    from hfsplit.checkpoint.synthetic import write_tiny_checkpoint
    from hfsplit.apply.quantize import quantization_config

    path = write_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="profile_qlora_")) / "model", "llama", num_layers=8,
                                 hidden=256, heads=8, kv_heads=4, intermediate=768, vocab=256, max_positions=512)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu",
                                                 quantization_config=quantization_config(compute_dtype="float32"))
    model = get_peft_model(model.train(), LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rows = torch.randint(0, 256, (16, 256))

    def step(m: int) -> None:
        for ids in rows.chunk(m):
            model(input_ids=ids, labels=ids).loss.backward()

    print("\n| micro-batches × size | step ms | dequantize share of self time | matmul (aten::mm) share |\n|---|---|---|---|")
    for m in splits:
        ms = timed(lambda: step(m), repeats=1)
        with profile() as prof:
            step(m)
        total = sum(e.self_cpu_time_total for e in prof.key_averages())
        share = lambda *names: sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in names) / total  # noqa: E731
        print(f"| {m} × {16 // m} | {ms:.0f} | {share('bitsandbytes::dequantize_4bit', 'bitsandbytes::dequantize_blockwise'):.1%} "
              f"| {share('aten::mm'):.1%} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="256x768,1024x2816,2048x5632", help="in×out of the weights")
    parser.add_argument("--tokens", default="512,2048")
    parser.add_argument("--micro-batches", default="8,1", help="splits of the bench's 16 rows")
    args = parser.parse_args()
    torch.set_num_threads(1)
    linear_rows([tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")],
                [int(v) for v in args.tokens.split(",")])
    step_rows([int(v) for v in args.micro_batches.split(",")])


if __name__ == "__main__":
    main()
