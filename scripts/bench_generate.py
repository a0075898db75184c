"""Benchmark: pipelined generation on the split stages against the relay, at pp=2 on two CPU ranks, in one run.

Writes a random Llama checkpoint, then under torchrun (2 CPU ranks, one thread each) loads it split in two pipeline
stages (`split_from_pretrained(..., pp=2)`) and generates greedily for a batch of left-padded prompts of different
lengths, alternating:
  - the relay: the whole batch through the stages in turn (`generate(micro_batches=1, prefill_chunks=1)`), as
    `device_map` runs it;
  - pipelined: the batch cut into micro-batches that flow through the stages together (`generate(micro_batches=m)`),
    the prompts' pass cut along the sequence too (`prefill_chunks`: its default, or `MxC` for C chunks).
All produce the same tokens (checked); it prints tokens/s of each (median of the repeats) and their ratio.

    python scripts/bench_generate.py --sequences 16 --new-tokens 32 --prompt-length 512 --micro-batches 2 2x1 4

It also prints each rank's share of the wall time computing in its stages ("busy") and blocked receiving hidden
states or tokens ("waiting"), and the median time of a decode step's forward by rows: what cutting costs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = dict(num_layers=8, hidden=768, heads=12, kv_heads=4, intermediate=2048, vocab=16000)
SMALL = dict(num_layers=4, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256)  # --small: a smoke run


def prompts(*, sequences: int, vocab: int, longest: int = 32):
    """(ids, attention mask): `sequences` prompts of `longest // 2` to `longest` tokens, left-padded."""
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.zeros(sequences, longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row in range(sequences):
        n = int(torch.randint(longest // 2, longest + 1, (), generator=gen))
        ids[row, longest - n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[row, longest - n:] = 1
    return ids, mask


def timed(run) -> tuple[float, object]:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    out = run()
    dist.barrier()
    return time.perf_counter() - start, out


class Busy:
    """Seconds this rank spends inside its stages' forwards (forward hooks) and blocked receiving hidden states or
    tokens (`PipelinedGeneration`'s receives, wrapped): busy over wall is the share of the run it computes, about
    half in the relay at pp=2 and near all when the stages work at once; and each decode forward's seconds by its
    rows, which show what cutting the batch costs (a forward of 8 rows against one of 16)."""

    def __init__(self, stages) -> None:
        from hfsplit.parallel.generation import PipelinedGeneration

        self.seconds, self.waiting, self.started = 0.0, 0.0, 0.0
        self.decode: dict[int, list[float]] = {}
        for stage in stages:
            stage.register_forward_pre_hook(self.start)
            stage.register_forward_hook(self.stop)
        for name in ("receive_hidden", "chosen"):
            setattr(PipelinedGeneration, name, self.timed(getattr(PipelinedGeneration, name)))

    def start(self, *_) -> None:
        self.started = time.perf_counter()

    def stop(self, _module, inputs, _output) -> None:
        seconds = time.perf_counter() - self.started
        self.seconds += seconds
        if inputs[0].shape[1] == 1:  # one new token a row: a decode step
            self.decode.setdefault(inputs[0].shape[0], []).append(seconds)

    def timed(self, receive):
        def wrapped(*args, **kwargs):
            started = time.perf_counter()
            try:
                return receive(*args, **kwargs)
            finally:
                self.waiting += time.perf_counter() - started
        return wrapped


def cut_of(text: str) -> tuple[int, object]:
    """(micro-batches, prefill chunks) of a cut written `M` (the default chunks: None) or `MxC`."""
    m, _, c = text.partition("x")
    return int(m), int(c) if c else None


def worker(checkpoint: str, *, sequences: int, new_tokens: int, prompt: int, cuts: list[str], repeats: int,
           schedule: str = "GPipe", split_for: str = "generation") -> None:
    """One rank: load the split, time the relay and each cut alternately, print the medians and each rank's busy
    share (rank 0)."""
    import torch
    import torch.distributed as dist

    from hfsplit.load.launch import split_from_pretrained
    from hfsplit.plan import TrainingSpec

    torch.set_num_threads(1)
    # planned for what it runs: `new_tokens` generated after the prompts (the head on the new positions only), or
    # (--split-for forward) a forward scoring every position, which gives the head's stage fewer blocks
    spec = TrainingSpec(method="inference", dtype="float32", seq_len=prompt + new_tokens, micro_batch_size=sequences,
                        rollout_tokens=new_tokens if split_for == "generation" else 0)
    model = split_from_pretrained(checkpoint, "2x8GiB", pp=2, tp=1, dp=1, schedule=schedule, dtype=torch.float32,
                                  spec=spec)
    ids, mask = prompts(sequences=sequences, vocab=model.config.vocab_size, longest=prompt)
    greedy = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    times: dict[str, list[float]] = {cut: [] for cut in ["1x1", *cuts]}
    busy = {cut: 0.0 for cut in times}
    waiting = {cut: 0.0 for cut in times}
    outputs, watch = {}, Busy(model.stages)
    for repeat in range(repeats + 1):  # the first round warms up
        for cut in times:
            before, blocked = watch.seconds, watch.waiting
            m, chunks = cut_of(cut)
            seconds, outputs[cut] = timed(lambda: model.generate(ids, mask, micro_batches=m, prefill_chunks=chunks,
                                                                 **greedy))
            if repeat:
                times[cut].append(seconds)
                busy[cut] += watch.seconds - before
                waiting[cut] += watch.waiting - blocked
    same = all(torch.equal(outputs[cut], outputs["1x1"]) for cut in cuts)
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, {cut: (busy[cut] / sum(times[cut]), waiting[cut] / sum(times[cut]))
                                    for cut in times})
    forwards = [None] * dist.get_world_size()
    dist.all_gather_object(forwards, {rows: 1e3 * statistics.median(s) for rows, s in watch.decode.items()})
    tokens = sequences * new_tokens
    if dist.get_rank() == 0:
        rates = {cut: tokens / statistics.median(t) for cut, t in times.items()}
        print("RESULT " + json.dumps({"rates": rates, "same_tokens": same, "shares": shares, "forwards": forwards,
                                      "layers": [s.layers for s in model.plan.stages]}), flush=True)
    dist.destroy_process_group()


def run_ranks(checkpoint: str, args) -> dict:
    """Two CPU ranks under torchrun running `worker`; its result line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           __file__, "--worker", checkpoint, "--sequences", str(args.sequences), "--new-tokens", str(args.new_tokens),
           "--prompt-length", str(args.prompt_length), "--schedule", args.schedule, "--split-for", args.split_for,
           "--repeats", str(args.repeats), "--micro-batches", *map(str, args.micro_batches)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"the ranks failed:\n{out.stdout[-3000:]}\n{out.stderr[-4000:]}")


def free_port() -> int:
    """A TCP port free right now (torchrun's static rendezvous needs a real one)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-length", type=int, default=32,
                        help="the longest prompt; prompts are half that to all of it, left-padded")
    parser.add_argument("--micro-batches", nargs="+", default=["2", "4"],
                        help="the pipelined cuts to time: M micro-batches (the prompts in the default chunks) or MxC "
                             "(in C chunks; Mx1: each micro-batch's prompts in one pass)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--schedule", default="GPipe",
                        help="the training schedule the split is planned for (Interleaved1F1B: two stages a rank)")
    parser.add_argument("--split-for", choices=["generation", "forward"], default="generation",
                        help="what the split is balanced for: generating --new-tokens (the head on the new positions "
                             "only), or a forward scoring every position (the head's stage takes fewer blocks)")
    parser.add_argument("--small", action="store_true", help="a tiny model: a smoke run in seconds, not a figure")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, sequences=args.sequences, new_tokens=args.new_tokens, prompt=args.prompt_length,
                      cuts=args.micro_batches, repeats=args.repeats, schedule=args.schedule, split_for=args.split_for)

    from hfsplit.checkpoint.synthetic import write_tiny_checkpoint
    from hfsplit.planning.rollout import prefill_chunks_for

    with tempfile.TemporaryDirectory() as tmp:
        model = SMALL if args.small else MODEL
        folder = write_tiny_checkpoint(Path(tmp) / "bench", "llama", **model)
        load = os.getloadavg()[0]
        result = run_ranks(str(folder), args)
    relay = result["rates"]["1x1"]
    print(f"load average (1 min) before / after the run: {load:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"Llama {model}, fp32, stages {result['layers']}; {args.sequences} sequences × {args.new_tokens} new "
          f"tokens after prompts of {args.prompt_length // 2}-{args.prompt_length} tokens, greedy; same tokens in "
          f"every cut: {result['same_tokens']}")
    print(f"{'micro-batches x prompt chunks':>29}  {'tokens/s':>9}  {'× relay':>8}  {'busy rank 0 / 1':>16}  {'waiting 0 / 1':>14}")
    for cut, rate in result["rates"].items():
        busy = " / ".join(f"{100 * share[cut][0]:.0f}%" for share in result["shares"])
        waiting = " / ".join(f"{100 * share[cut][1]:.0f}%" for share in result["shares"])
        m, chunks = cut_of(cut)
        chunks = chunks or prefill_chunks_for(prompt_length=args.prompt_length, micro_batches=m, pp=2)
        print(f"{f'{m} x {chunks}':>29}  {rate:9.1f}  {rate / relay:8.2f}  {busy:>16}  {waiting:>14}"
              + ("  (the relay)" if cut == "1x1" else ""))
    for rank, forwards in enumerate(result["forwards"]):
        print(f"rank {rank}: a decode step's forward, median: "
              + ", ".join(f"{rows} rows {ms:.1f} ms"
                          for rows, ms in sorted(forwards.items(), key=lambda item: -int(item[0]))))


if __name__ == "__main__":
    main()
