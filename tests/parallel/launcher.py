"""One launcher for every multi-process test: N CPU ranks as subprocesses, never a hang.

`launch("tests.parallel.cases:some_check", world_size=2, kwargs={...})` starts the ranks
with the environment torchrun would give them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*),
one OMP thread each, runs `some_check(**kwargs)` in each, and returns the per-rank
return values. A rank that fails or a run that passes `timeout_s` kills every rank and
raises with the failing rank's output.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class LaunchError(AssertionError):
    """A rank failed or the run timed out."""


def free_port() -> int:
    """A TCP port free right now (bound to port 0 and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(target: str, *, world_size: int, kwargs: dict | None = None, timeout_s: float = 120.0) -> list:
    """Run `target` ("module:function") on `world_size` CPU ranks; the list of their return values by rank."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "kwargs.pkl").write_bytes(pickle.dumps(kwargs or {}))
        port = free_port()
        procs = [_start_rank(target, rank=r, world_size=world_size, port=port, tmp=tmp) for r in range(world_size)]
        _wait_all(procs, tmp=tmp, timeout_s=timeout_s)
        return [pickle.loads((tmp / f"result{r}.pkl").read_bytes()) for r in range(world_size)]


def _start_rank(target: str, *, rank: int, world_size: int, port: int, tmp: Path) -> subprocess.Popen:
    env = {
        **os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    log = open(tmp / f"log{rank}.txt", "w")
    # Own session per rank so a timeout can kill the rank and anything it started.
    return subprocess.Popen([sys.executable, "-m", "tests.parallel.launcher", target, str(tmp)],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_all(procs: list, *, tmp: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed or time.monotonic() > deadline:
            _kill(procs)
            rank = failed[0] if failed else 0
            why = f"rank {rank} exited with {codes[rank]}" if failed else f"timed out after {timeout_s:.0f}s"
            others = "".join(f"\n--- rank {r} (exit {c}), last lines:\n{(tmp / f'log{r}.txt').read_text()[-1500:]}"
                             for r, c in enumerate(codes) if r != rank)
            raise LaunchError(f"{why}; its output:\n{(tmp / f'log{rank}.txt').read_text()[-6000:]}{others}")
        if all(c == 0 for c in codes):
            return
        time.sleep(0.05)


def run_command(cmd: list[str], *, cwd, env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    """`subprocess.run` for launchers (accelerate launch, torchrun): on a timeout the launcher and every
    worker it started are killed, and the error shows its stderr."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree([proc])
        out, err = proc.communicate()
        raise LaunchError(f"{' '.join(map(str, cmd))} timed out after {timeout_s:.0f}s; stderr:\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def kill_tree(procs) -> None:
    """SIGKILL each process's group and all its descendants (torchrun starts each worker in its own session)."""
    import psutil

    for p in procs:
        try:
            workers = psutil.Process(p.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            workers = []
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for w in workers:
            try:
                w.kill()
            except psutil.NoSuchProcess:
                pass
    for p in procs:
        p.wait()


def _kill(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def _run_rank(target: str, tmp: Path) -> None:
    """Inside a rank: join the group, run the target, store its result, leave the group."""
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    kwargs = pickle.loads((tmp / "kwargs.pkl").read_bytes())
    try:
        result = func(**kwargs)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    (tmp / f"result{os.environ['RANK']}.pkl").write_bytes(pickle.dumps(result))


if __name__ == "__main__":
    _run_rank(sys.argv[1], Path(sys.argv[2]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as recipes/finetune.py: no C++ static teardown once the result is written
