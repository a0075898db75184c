"""Two launcher "machines" on this host run the same fine-tune as one machine with two processes.

`accelerate launch --num_machines 2 --machine_rank 0|1 --main_process_ip 127.0.0.1` with one
process per machine gives the same world (size 2, global ranks 0 and 1) as one machine with two
processes, so the loss curve must be the same, and the model it saves must load with transformers.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hfsplit.training.options import TINY_RECIPE
from tests.parallel.launcher import free_port, kill_tree

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "recipes/accelerate_cpu.yaml"
TIMEOUT_S = 300.0


def finetune_args(model: Path, out: Path) -> list[str]:
    return [str(ROOT / "recipes/finetune.py"), "--config", str(TINY_RECIPE), "--model", str(model), "--pp", "2", "--max-memory", "2x1GiB",
            "--max-steps", "6", "--seq-len", "64", "--micro-batch-size", "2", "--micro-batches", "4",
            "--dtype", "float32", "--output-dir", str(out)]


def start(launch_flags: list[str], args: list[str], *, log: Path) -> subprocess.Popen:
    """One `accelerate launch` in its own session, stdout and stderr to `log`.out / `log`.err."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG), *launch_flags, *args]
    return subprocess.Popen(cmd, cwd=log.parent, env=env, stdout=open(f"{log}.out", "w"),
                            stderr=open(f"{log}.err", "w"), start_new_session=True)


def wait_all(procs: dict[str, subprocess.Popen], *, logs: dict[str, Path], timeout_s: float = TIMEOUT_S) -> None:
    """Wait for every launcher; on a failure or the timeout kill them all and raise with their stderr tails."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = {name: p.poll() for name, p in procs.items()}
        failed = [name for name, code in codes.items() if code not in (None, 0)]
        if all(code == 0 for code in codes.values()):
            return
        if failed or time.monotonic() > deadline:
            kill_tree(procs.values())
            why = f"{', '.join(failed)} failed" if failed else f"timed out after {timeout_s:.0f}s"
            tails = "".join(f"\n--- {name} (exit {codes[name]}), stderr tail:\n"
                            f"{Path(f'{logs[name]}.err').read_text(errors='replace')[-3000:]}" for name in procs)
            raise AssertionError(f"{why}{tails}")
        time.sleep(0.1)


def losses_of(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


@pytest.mark.slow
def test_two_machines_give_the_one_machine_loss_curve(tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_checkpoint("llama")
    one, two = tmp_path / "one-machine", tmp_path / "two-machines"

    logs = {"one machine": tmp_path / "one"}
    procs = {"one machine": start(["--num_processes", "2", "--main_process_port", str(free_port())],
                                  finetune_args(model, one), log=logs["one machine"])}
    wait_all(procs, logs=logs)

    port = str(free_port())
    logs = {f"machine {r}": tmp_path / f"machine{r}" for r in (0, 1)}
    procs = {}
    try:
        for r in (0, 1):  # started together, as on two hosts; --num_processes counts all machines' processes
            flags = ["--num_machines", "2", "--num_processes", "2", "--machine_rank", str(r),
                     "--main_process_ip", "127.0.0.1", "--main_process_port", port]
            procs[f"machine {r}"] = start(flags, finetune_args(model, two), log=logs[f"machine {r}"])
    except BaseException:
        kill_tree(procs.values())
        raise
    wait_all(procs, logs=logs)

    expected = losses_of(one)
    assert len(expected) == 6
    assert losses_of(two) == pytest.approx(expected, rel=1e-6)
    assert "pp=2" in Path(f"{logs['machine 0']}.out").read_text()  # global rank 0 ran on machine 0

    loaded = AutoModelForCausalLM.from_pretrained(two / "model", dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(one / "model", dtype=torch.float32).state_dict()
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, reference[name], rtol=1e-6, atol=0, msg=name)
