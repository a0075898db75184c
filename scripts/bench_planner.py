"""Planner speed, and our split next to accelerate's `infer_auto_device_map` on the same budgets.

    python scripts/bench_planner.py            # all tables
    python scripts/bench_planner.py --timing   # only the planning-time tables

Prints markdown tables (published in docs/benchmarks/planner.md). Both splits are judged by the same
cost model: weights, LoRA state and the activations a training step really keeps.
"""
from __future__ import annotations

import time

import torch

from hfsplit import TrainingSpec, make_plan
from hfsplit.budget import format_bytes, parse_max_memory
from hfsplit.checkpoint import load_config
from hfsplit.planning.costs.model import model_costs
from hfsplit.planning.reserve import reserve_for

GiB = 2**30


def llama_405b_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)


PLAN_IN_FRESH_PROCESS = """
import sys, time
from hfsplit import TrainingSpec, make_plan
from hfsplit.checkpoint import load_config
sys.path.insert(0, {scripts!r})
from bench_planner import llama_405b_config
config = llama_405b_config() if {model!r} == "405b" else load_config({model!r})
load_config("Qwen/Qwen2.5-0.5B")  # imports, not planning
start, cpu = time.perf_counter(), time.process_time()
plan = make_plan(config, {budget!r}, spec=TrainingSpec(method="lora", seq_len={seq}))
shape = f"pp={{plan.pp}} tp={{plan.tp}} dp={{plan.dp}} {{plan.schedule}}"
print(time.perf_counter() - start, time.process_time() - cpu, shape)
"""
CLI_CASES = [
    "meta-llama/Llama-3.1-70B --max-memory 4x24GiB --seq-len 2048 --lora-r 16",
    "Qwen/Qwen2.5-14B --max-memory 24GiB,12GiB,12GiB --seq-len 2048 --lora-r 16",
]


def _fresh(code: str, cache: str) -> str:
    import os
    import subprocess
    import sys

    env = {**os.environ, "HFSPLIT_CACHE": cache, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout


def planning_times() -> list[tuple[str, str, tuple, tuple, str]]:
    """make_plan in a fresh process, (wall, CPU) seconds: first with an empty trace cache (cold), then with the
    one it left. One thread: on a quiet machine wall ≈ CPU; on a shared one the CPU time is the steadier figure."""
    import tempfile
    from pathlib import Path

    cases = [("Llama-3.1-70B (80 layers)", "meta-llama/Llama-3.1-70B", "8x80GiB", 2048),
             ("Llama-3.1-405B shape (126 layers)", "405b", "16x80GiB", 4096)]
    rows = []
    for name, model, budget, seq in cases:
        cache = tempfile.mkdtemp(prefix="bench_planner_")
        code = PLAN_IN_FRESH_PROCESS.format(scripts=str(Path(__file__).parent), model=model, budget=budget, seq=seq)
        cold_wall, cold_cpu, shape = _fresh(code, cache).split(" ", 2)
        warm_wall, warm_cpu, _ = _fresh(code, cache).split(" ", 2)
        rows.append((f"{name}, seq {seq}", budget, (float(cold_wall), float(cold_cpu)),
                     (float(warm_wall), float(warm_cpu)), shape.strip()))
    return rows


def cli_times() -> list[tuple[str, tuple, tuple]]:
    """(wall, CPU) seconds of `hfsplit plan` as a user runs it (no-fit diagnosis included): empty cache, then warm."""
    import resource
    import shlex
    import subprocess
    import sys
    import tempfile
    import os

    rows = []
    for case in CLI_CASES:
        cache = tempfile.mkdtemp(prefix="bench_planner_cli_")
        env = {**os.environ, "HFSPLIT_CACHE": cache, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        runs = []
        for _ in range(2):
            start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run([sys.executable, "-m", "hfsplit.cli", "plan", *shlex.split(case)], capture_output=True, env=env)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            runs.append((time.perf_counter() - start, cpu))
        rows.append((case, *runs))
    return rows


def accelerate_split(config, budgets: dict[str, int]) -> dict[str, list[int]]:
    """Layers per device from accelerate's balanced `infer_auto_device_map` on the meta model."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    block = type(model.model.layers[0]).__name__
    max_memory = {int(k): v for k, v in budgets.items()}
    balanced = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=[block], dtype=torch.bfloat16)
    device_map = infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=[block],
                                       dtype=torch.bfloat16)
    layers: dict[str, list[int]] = {k: [] for k in budgets}
    for module, device in device_map.items():
        if module.startswith("model.layers."):
            layers[str(device)].append(int(module.split(".")[2]))
    return layers


def device_bytes(costs, layers: list[int], *, first: bool, last: bool, in_flight: int) -> tuple[int, int]:
    """(weight bytes, step bytes) of a device holding `layers` under our cost model."""
    weights = len(layers) * costs.block.param_bytes + first * costs.embed.param_bytes + last * costs.head.param_bytes
    state = len(layers) * costs.block.state_bytes + first * costs.embed.state_bytes + last * costs.head.state_bytes
    acts = in_flight * (len(layers) * costs.block.activation_bytes + first * costs.embed.activation_bytes
                        + last * costs.head.activation_bytes)
    return weights, state + acts + costs.spec.reserve_bytes


def split_row(model: str, budget: str, label: str, counts, weights, steps, budgets) -> str:
    devices = list(budgets)
    mean = sum(weights) / len(weights)
    fits = [step <= budgets[d] for step, d in zip(steps, devices)]
    return (f"| {model} | {budget} | {label} | {'/'.join(map(str, counts))} | "
            + " / ".join(f"{format_bytes(w)} ({100 * w / budgets[d]:.0f}%)" for w, d in zip(weights, devices))
            + f" | {max(weights) / mean:.2f} | "
            + " / ".join(f"{format_bytes(x)}{'' if f else ' ✗'}" for x, f in zip(steps, fits))
            + f" | {'yes' if all(fits) else 'no'} |")


def comparison(model: str, budget: str) -> list[str]:
    config = load_config(model)
    budgets = parse_max_memory(budget)
    # Both splits are charged the reserve the planner measures for these (GPU) budgets.
    spec = TrainingSpec(method="lora", seq_len=2048, reserve_bytes=reserve_for(budgets))
    costs = model_costs(config, spec, tp=1)
    devices = list(budgets)
    theirs = accelerate_split(config, budgets)
    # accelerate's device_map runs one device at a time: one micro-batch in flight.
    measured = [device_bytes(costs, theirs[d], first=i == 0, last=i == len(devices) - 1, in_flight=1)
                for i, d in enumerate(devices)]
    rows = [split_row(model, budget, "accelerate balanced", [len(theirs[d]) for d in devices],
                      [w for w, _ in measured], [t for _, t in measured], budgets)]
    # One stage per device, like accelerate's map, so the rows compare placements stage for stage.
    ours = make_plan(config, budgets, spec=spec, tp=1, pp=len(budgets), schedule="1F1B")
    stage_of = {s.devices[0][0]: s for s in ours.stages}
    rows.append(split_row(model, budget, f"hfsplit {ours.schedule} m={ours.micro_batches}",
                          [stage_of[d].num_layers for d in devices], [stage_of[d].memory.weights for d in devices],
                          [stage_of[d].memory.total for d in devices], budgets))
    return rows


def main() -> None:
    import os
    import sys

    print(f"load average {os.getloadavg()[0]:.1f} at the start, {os.cpu_count()} cores")
    print("| model | budget | first plan in a fresh process, empty trace cache (wall / CPU) "
          "| same, trace cache warm (wall / CPU) | plan |\n|---|---|---|---|---|")
    for name, budget, cold, warm, shape in planning_times():
        print(f"| {name} | {budget} | {cold[0] * 1e3:.0f} / {cold[1] * 1e3:.0f} ms | {warm[0] * 1e3:.0f} / "
              f"{warm[1] * 1e3:.0f} ms | {shape} |")
    print()
    print("| `hfsplit plan` | empty trace cache (wall / CPU) | cache warm (wall / CPU) |\n|---|---|---|")
    for case, cold, warm in cli_times():
        print(f"| `{case}` | {cold[0]:.1f} / {cold[1]:.1f} s | {warm[0]:.1f} / {warm[1]:.1f} s |")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    if "--timing" in sys.argv[1:]:
        return
    print()
    print("| model | budget | split | layers per device | weights per device (of budget) | max/mean weights "
          "| LoRA step bytes per device (seq 2048) | fits |")
    print("|---|---|---|---|---|---|---|---|")
    for model, budget in (("Qwen/Qwen2.5-14B", "24GiB,12GiB,12GiB"), ("meta-llama/Llama-3.1-8B", "16GiB,12GiB"),
                          ("meta-llama/Llama-3.1-70B", "4x48GiB")):
        for row in comparison(model, budget):
            print(row)


if __name__ == "__main__":
    main()
