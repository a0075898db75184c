"""scripts/gpu_check.py: its CPU path (`--device cpu --tiny`) runs every measurement end to end."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _run(*args, timeout=900):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = _run()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().count("\n") == 0 and "no CUDA GPU" in proc.stdout


@pytest.mark.slow
def test_cpu_tiny_run_prints_every_row_of_the_table():
    proc = _run("--device", "cpu", "--tiny")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    rows = re.findall(r"^(lora|full)\s+(on|off)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)$", out, flags=re.M)
    assert sorted((m, c) for m, c, *_ in rows) == [("full", "off"), ("full", "on"), ("lora", "off"), ("lora", "on")], out
    for _, _, plan, peak, _, tokens in rows:
        assert float(plan) > 0 and float(peak) > 0 and int(tokens) > 0, out
    ratio = re.search(r"transformers \+ peft (\d+) = ([\d.]+)×", out)
    assert ratio and int(ratio.group(1)) > 0 and float(ratio.group(2)) > 0, out
    load = re.search(r"hfsplit.from_pretrained ([\d.]+) s vs .* ([\d.]+) s$", out, flags=re.M)
    assert load and float(load.group(1)) > 0 and float(load.group(2)) > 0, out
    # issue 21's rows: offloaded checkpointing (its host bytes those of the plan) and 8-bit AdamW
    headroom = re.findall(r"^(lora|full)\s+(offload|on)\s+(adamw_torch|adamw_8bit)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
                          r"\s+([\d.]+) / ([\d.]+)", out, flags=re.M)
    assert [(m, c, o) for m, c, o, *_ in headroom] == [("lora", "offload", "adamw_torch"), ("full", "on", "adamw_8bit")]
    (_, _, _, plan, peak, _, host_plan, host), _ = headroom
    assert float(plan) > 0 and float(peak) > 0 and float(host_plan) > 0 and float(host) == float(host_plan), out
    assert re.search(r"offload step time vs checkpointing on the device: [\d.]+×", out), out
    long = re.search(r"long context \(issue 30\): LoRA seq 256, MLP in (\d+) tiles, chunked loss: plan ([\d.]+) GiB", out)
    assert long and int(long.group(1)) >= 2 and float(long.group(2)) > 0, out
