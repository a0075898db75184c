"""Elastic runs: a machine lost mid-run under torchrun --nnodes 1:2, the run finishes on the rank left."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hfsplit.training.resume import latest_checkpoint
from tests.parallel.launcher import ROOT, free_port, kill_tree, launch, run_command

STEPS, SAVE_EVERY = 40, 5
# Rendezvous timeouts that make a restart take seconds, not minutes: the survivor's new round closes
# 1 s after it is alone (last_call_timeout), and the agent checks its workers every 0.2 s.
RDZV_CONF = "join_timeout=60,last_call_timeout=1,close_timeout=5"


def recipe_args(out: Path) -> list[str]:
    return ["--max-steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--seq-len", "64", "--dtype", "float32",
            "--peer-timeout", "30", "--output-dir", str(out)]


def torchrun(port: int, out: Path, *, log: Path) -> subprocess.Popen:
    """One launcher "machine" of the elastic job, in its own session (so its whole tree can be killed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc_per_node", "1",
           "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "elastic-test", "--rdzv-conf", RDZV_CONF, "--monitor-interval", "0.2",
           str(ROOT / "recipes/finetune.py"), *recipe_args(out)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(f"{log}.out", "w"), stderr=open(f"{log}.err", "w"),
                            start_new_session=True)


def records_of(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines[:-1]] + ([json.loads(lines[-1])] if lines and lines[-1].endswith("}")
                                                         else [])


def wait_until(condition, *, procs, logs, timeout_s: float, what: str) -> float:
    deadline = time.monotonic() + timeout_s
    while not condition():
        failed = [str(log) for p, log in zip(procs, logs) if p.poll() is not None]
        if failed or time.monotonic() > deadline:
            tails = "".join(f"\n--- {log}:\n{Path(f'{log}.err').read_text(errors='replace')[-3000:]}" for log in logs)
            raise AssertionError(f"waiting for {what}: {'exited: ' + ', '.join(failed) if failed else 'timed out'}"
                                 f"{tails}")
        time.sleep(0.05)
    return time.time()


@pytest.mark.slow
def test_a_lost_machine_restarts_the_run_on_the_rank_left_and_keeps_the_loss_curve(tmp_path):
    from transformers import AutoModelForCausalLM

    out, port = tmp_path / "elastic", free_port()
    logs = [tmp_path / "machine0", tmp_path / "machine1"]
    first = torchrun(port, out, log=logs[0])
    procs = [first]
    try:
        time.sleep(1.0)  # the first launcher hosts the rendezvous store: let it bind the port
        procs.append(torchrun(port, out, log=logs[1]))
        wait_until(lambda: (out / f"checkpoint-{SAVE_EVERY}").is_dir() and latest_checkpoint(out) is not None,
                   procs=procs, logs=logs, timeout_s=240, what="the first checkpoint")
        kill_tree([procs[1]])  # the second machine goes away, launcher and worker
        killed = time.time()
        done_before = max(r["step"] for r in records_of(out) if "loss" in r)
        resumed = wait_until(lambda: any("restart" in r for r in records_of(out)), procs=[first], logs=logs[:1],
                             timeout_s=120, what="the restart")
        code = first.wait(timeout=240)
    finally:
        kill_tree(procs)
    stdout = Path(f"{logs[0]}.out").read_text()
    assert code == 0, Path(f"{logs[0]}.err").read_text()[-4000:]
    records = records_of(out)
    (restart,) = [r for r in records if "restart" in r]
    print(f"\n{[line for line in stdout.splitlines() if line.startswith('elastic ')]}\n"
          f"killed after step {done_before}; resumed {resumed - killed:.1f} s after the kill; restart record: {restart}")
    assert restart["restart"] == "restart" and restart["ranks_lost"] == 1
    assert restart["old_plan"]["pp"] == 2 and restart["new_plan"]["pp"] == 1 and restart["new_plan"]["world_size"] == 1
    assert restart["new_plan"]["micro_batches"] * restart["new_plan"]["dp"] == \
        restart["old_plan"]["micro_batches"] * restart["old_plan"]["dp"]  # the global batch is kept
    assert restart["steps_redone"] <= SAVE_EVERY
    step_s = restart["seconds_lost"] - restart["restart_s"] - restart["reload_s"]
    assert restart["seconds_lost"] <= resumed - killed + step_s + 1.0
    # every step done, the later record of a redone step counting; the curve of the uninterrupted run
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(losses) == list(range(1, STEPS + 1))
    reference = tmp_path / "uninterrupted"
    (expected,) = launch("tests.training.cases:finetune_losses", world_size=1, timeout_s=300,
                         kwargs={"runs": [dict(max_steps=STEPS, seq_len=64, dtype="float32", output_dir=str(reference))]})[0]
    assert [losses[s] for s in range(1, STEPS + 1)] == pytest.approx(expected, rel=1e-4)
    model = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32)
    assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()
