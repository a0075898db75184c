"""Faults during a run: a rank killed mid-step, non-finite steps. Never a silent hang, never a lost checkpoint."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hfsplit.training.options import TINY_RECIPE
from hfsplit.training.resume import complete_checkpoints, latest_checkpoint
from tests.parallel.launcher import ROOT, free_port, kill_tree, launch
from tests.training.test_trainer import run_options


def start_recipe_ranks(argv: list[str], *, world_size: int, logs: Path) -> list[subprocess.Popen]:
    """`recipes/finetune.py argv` on `world_size` ranks, each with the environment torchrun gives it."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
               "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        log = open(logs / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "recipes/finetune.py"), *argv], cwd=ROOT, env=env,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def steps_logged(output_dir: Path) -> int:
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip() and "loss" in json.loads(line))


@pytest.mark.slow
@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_rank_killed_or_hung_mid_run_ends_the_others_with_a_clear_error_and_the_last_checkpoint_loads(
        tiny_checkpoint, tmp_path, fault):
    out = tmp_path / "run"
    timeout = 15
    argv = ["--config", str(TINY_RECIPE), "--model", str(tiny_checkpoint("llama")), "--pp", "2", "--max-memory", "2x1GiB", "--seq-len", "64",
            "--max-steps", "1000", "--save-every", "3", "--save-total-limit", "2", "--peer-timeout", str(timeout),
            "--dtype", "float32", "--output-dir", str(out)]
    procs = start_recipe_ranks(argv, world_size=2, logs=tmp_path)
    try:
        deadline = time.monotonic() + 240
        while steps_logged(out) < 11:  # three checkpoints saved (3, 6, 9), then some steps into the fourth
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                (tmp_path / "rank0.log").read_text()[-3000:]
            time.sleep(0.2)
        procs[1].send_signal(fault)  # the last stage dies, or stops answering, mid-run
        killed_at = time.monotonic()
        code = procs[0].wait(timeout=timeout + 60)
        waited = time.monotonic() - killed_at
        print(f"{fault.name}: rank 0 exited {waited:.2f} s after the fault")  # shown with pytest -s
    finally:
        kill_tree(procs)
    log = (tmp_path / "rank0.log").read_text()
    errors = [line for line in log.splitlines() if line.startswith("finetune: ")]
    assert code == 3, log[-3000:]
    assert len(errors) == 1 and "lost contact with another rank" in errors[0], log[-3000:]
    # a dead peer is noticed at once (its sockets close); a hung one when --peer-timeout runs out
    assert waited < (10 if fault == signal.SIGKILL else timeout + 30)
    last = latest_checkpoint(out)
    assert last is not None and last.name in errors[0] and "--resume latest" in errors[0]
    # --save-total-limit 2 held: the two newest complete checkpoints, and the newest loads with plain transformers
    kept = complete_checkpoints(out)
    assert len(kept) == 2 and last == kept[-1] and not (out / "checkpoint-3").exists()
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(last, dtype=torch.float32)
    assert torch.isfinite(loaded(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_non_finite_steps_are_skipped_or_stop_the_run_naming_the_step(tiny_checkpoint, tmp_path, policy):
    # An absurd learning rate blows the weights up after the first update: step 2's loss is not finite.
    run = dict(run_options(tiny_checkpoint("llama"), tmp_path, "full", pp=1, max_memory="1GiB"),
               max_steps=4, learning_rate=1e30, warmup_steps=0, max_grad_norm=0.0, on_nonfinite=policy)
    if policy == "stop":
        with pytest.raises(AssertionError, match=r"NonFiniteError: step 2: loss .* is not finite"):
            launch("tests.training.cases:finetune_losses", world_size=1, kwargs={"runs": [run]}, timeout_s=200)
        assert not (Path(run["output_dir"]) / "model").exists()
        return
    (losses,) = launch("tests.training.cases:finetune_losses", world_size=1, kwargs={"runs": [run]},
                       timeout_s=200)[0]
    records = [json.loads(x) for x in (Path(run["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("skipped")] == [2, 3, 4]
    assert len(losses) == 1  # only step 1 updated the weights


@pytest.mark.slow
def test_a_crash_mid_save_leaves_the_previous_checkpoint_intact(tiny_checkpoint, tmp_path):
    out = tmp_path / "run"
    result = launch("tests.training.cases:crash_mid_save", world_size=2,
                    kwargs={"checkpoint": str(tiny_checkpoint("llama")), "out": str(out)}, timeout_s=200)[0]
    # no half-written checkpoint-2, and its temporary folder cleared by the failing save itself (issue 33)
    assert result["after_crash"] == ["checkpoint-1"]
    assert result["after_retry"] == ["checkpoint-1", "checkpoint-2"]
    assert latest_checkpoint(out) is None  # a folder without trainer_state/ is never resumed from
    from transformers import AutoModelForCausalLM

    for name in ("checkpoint-1", "checkpoint-2"):
        AutoModelForCausalLM.from_pretrained(out / name, dtype=torch.float32)
