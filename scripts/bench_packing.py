"""Real tokens per second with packing against padding, pp=2 on 2 CPU ranks, and a one-process transformers loop.

    python scripts/bench_packing.py               # ~15 minutes on 2 quiet CPU cores
    python scripts/bench_packing.py --steps 4 --seq 512

For each data set and sequence length, the recipe (`recipes/finetune.py` under torchrun, 2 ranks, one thread each,
pp=2, 1F1B, micro-batch size 1 × 2 micro-batches, full fine-tuning in float32) trains the same tiny Llama (4 layers,
hidden 128, the bundled tiny tokenizer's 256 ids) twice, side by side: `--packing off` (one example a row, padded to
the sequence length) and `--packing on` (best-fit decreasing, examples isolated by their position ids). Then a
one-process transformers loop (2 threads) on the same examples: `DataCollatorWithFlattening` makes each micro-batch
one row of consecutive examples (at most the sequence length, no padding), the loss the token mean of the step
(`num_items_in_batch`), AdamW. Figures are the median step's real (non-padding) tokens per second, first step left
out.

Data:
- chat: the bundled `tiny_chat.jsonl` (50 conversations, loss on the assistant turns);
- instruction: 3000 generated alpaca rows with a long-tailed length spread: instruction 3 + Poisson(12) words,
  `input` empty half the time else 2 + Poisson(20) words, output min(2000, ⌊4·(1 + Pareto(1.1))⌋) words (words of
  2-9 letters: about 1.3 tokens a letter with the tiny tokenizer), seeded, so the same set every run.

"fill" is the real share of the positions the run's steps trained on; "all rows", of every packed row of the set.

Targets (issue 20): packed real tokens/s ≥ 0.8 × (1 / the padded run's fill) × padded, i.e. packing turns at least
80% of the padding it removes into speed; packed rows ≥ 95% full.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = dict(num_layers=4, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=256, max_positions=2048)
BATCH = dict(micro_batch_size=1, micro_batches=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generated_instructions(path: Path, *, count: int = 3000, seed: int = 0) -> Path:
    """The long-tailed instruction set the module docstring states, as JSON lines."""
    rnd = random.Random(seed)
    import numpy as np

    np_rnd = np.random.default_rng(seed)

    def words(n: int) -> str:
        return " ".join("".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(2, 9)))
                        for _ in range(max(1, n)))

    with path.open("w") as f:
        for _ in range(count):
            output = min(2000, int(4 * (1 + np_rnd.pareto(1.1))))
            row = {"instruction": words(3 + int(np_rnd.poisson(12))),
                   "input": "" if rnd.random() < 0.5 else words(2 + int(np_rnd.poisson(20))), "output": words(output)}
            f.write(json.dumps(row) + "\n")
    return path


def recipe_run(model: Path, data: Path, out: Path, *, seq: int, steps: int, packing: str) -> dict:
    """Median real tokens/s, trained tokens/s and mean padding of a pp=2 recipe run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(ROOT / "recipes/finetune.py"), "--model", str(model), "--dataset", str(data), "--output-dir", str(out),
           "--max-steps", str(steps), "--dtype", "float32", "--seq-len", str(seq), "--pp", "2", "--schedule", "1F1B",
           "--max-memory", "2x8GiB", "--method", "full", "--packing", packing, "--warmup-steps", "1",
           "--micro-batch-size", str(BATCH["micro_batch_size"]), "--micro-batches", str(BATCH["micro_batches"])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    steps_ = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in steps_ if "tokens_per_s" in r]
    timed = steps_[1:] or steps_
    final = next((line for line in proc.stdout.splitlines() if line.startswith("done:")), "")
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "trained_tokens_per_s": statistics.median(r["trained_tokens_per_s"] for r in timed),
            "fill": 1 - statistics.mean(r["padding"] for r in steps_), "final": final}


def flattening_loop(model_path: Path, data: Path, *, seq: int, steps: int) -> dict:
    """transformers on one process: `DataCollatorWithFlattening` micro-batches of consecutive examples (each at most
    `seq` tokens), token-mean loss over the step, AdamW; the median step's real tokens/s."""
    import torch
    from transformers import AutoModelForCausalLM, DataCollatorWithFlattening

    from hfsplit.checkpoint.synthetic import tiny_tokenizer
    from hfsplit.training.data import load_examples, token_rows
    from hfsplit.training.packing import label_tokens

    torch.set_num_threads(1)
    tokenizer = tiny_tokenizer()
    rows = token_rows(load_examples(str(data)), tokenizer, seq_len=seq, packing=False)  # one example a row
    examples = [{"input_ids": r[:n].tolist(), "labels": y[:n].tolist()}
                for r, y, n in zip(rows.input_ids, rows.labels, rows.lengths.tolist())]
    groups, current = [], []
    for e in examples:  # consecutive examples into micro-batches of at most `seq` tokens
        if current and sum(len(x["input_ids"]) for x in current) + len(e["input_ids"]) > seq:
            groups.append(current)
            current = []
        current.append(e)
    collate = DataCollatorWithFlattening(return_tensors="pt")
    batches = [collate(g) for g in groups + ([current] if current else [])]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rates = []
    m = BATCH["micro_batches"]
    for step in range(steps):
        micro = [batches[(step * m + i) % len(batches)] for i in range(m)]
        items = sum(label_tokens(b["labels"]) for b in micro)
        start = time.perf_counter()
        for b in micro:
            logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
            model.loss_function(logits=logits, labels=b["labels"], vocab_size=model.config.vocab_size,
                                num_items_in_batch=items).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:
            rates.append(sum(b["input_ids"].numel() for b in micro) / (time.perf_counter() - start))
    return {"tokens_per_s": statistics.median(rates)}


def packed_fill(data: Path, *, seq: int) -> float:
    """The fill of every packed row of the data set (the runs' steps see a sample of them)."""
    from hfsplit.checkpoint.synthetic import tiny_tokenizer
    from hfsplit.training.data import load_token_rows

    return 1 - load_token_rows(str(data), tiny_tokenizer(), seq_len=seq, packing=True).padding


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 2048])
    args = parser.parse_args()
    from hfsplit.checkpoint.synthetic import write_tiny_checkpoint
    from hfsplit.training.data import bundled_dataset_path

    tmp = Path(tempfile.mkdtemp(prefix="bench_packing_"))
    spec = dict(MODEL)
    model = write_tiny_checkpoint(tmp / "model", "llama", sharded=True, **spec)
    sets = {"chat (bundled tiny_chat)": bundled_dataset_path("tiny_chat.jsonl"),
            "instruction (generated, long-tailed)": generated_instructions(tmp / "instructions.jsonl")}
    load = os.getloadavg()[0]
    print(f"load average at start: {load:.2f} on {os.cpu_count()} cores", file=sys.stderr)
    rows = []
    for name, data in sets.items():
        for seq in args.seq:
            padded = recipe_run(model, data, tmp / f"pad-{seq}-{len(rows)}", seq=seq, steps=args.steps, packing="off")
            packed = recipe_run(model, data, tmp / f"pack-{seq}-{len(rows)}", seq=seq, steps=args.steps, packing="on")
            plain = flattening_loop(model, data, seq=seq, steps=args.steps)
            packed["rows_fill"] = packed_fill(data, seq=seq)
            rows.append((name, seq, padded, packed, plain))
            print(name, seq, padded, packed, plain, file=sys.stderr, flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (start {load:.2f})", file=sys.stderr)
    print("| data | seq | padded: fill | padded real tok/s | packed: fill (all rows) | packed real tok/s "
          "| packed / padded | target 0.8 / fill | transformers flattening, 1 process: real tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, seq, padded, packed, plain in rows:
        ratio, target = packed["tokens_per_s"] / padded["tokens_per_s"], 0.8 / padded["fill"]
        print(f"| {name} | {seq} | {100 * padded['fill']:.1f}% | {padded['tokens_per_s']:.0f} | "
              f"{100 * packed['fill']:.1f}% ({100 * packed['rows_fill']:.1f}%) | {packed['tokens_per_s']:.0f} | "
              f"{ratio:.2f}× | {target:.2f}× ({'met' if ratio >= target else 'not met'}) | "
              f"{plain['tokens_per_s']:.0f} |")


if __name__ == "__main__":
    main()
