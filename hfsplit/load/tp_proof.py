"""The tp=2 sweep: which followed model types shard over tensor-parallel ranks equal to transformers, proven once per
transformers version, on two ranks.

The per-config proof (`hfsplit.load.proof`) runs in one process, where pipeline stages chain and tensor-parallel
shards do not (each holds a slice and meets the other in collectives). So tensor parallelism over a followed split
(the model's own forward on DTensor-sharded modules, `apply/tp.py`) is proven on two ranks: on the user's own config
before a tp>1 run (`proven_tp`: two child processes, forked where that is safe, cached by the config's hash), and per
type by this sweep, a pre-filter and the families table: every registered causal-LM type whose shrunk default config
has a TP plan hfsplit shards at degree 2 is split into pp=2 stages, each sharded over the two ranks as a run shards
it, and its logits and every parameter's gradient compared with transformers' unsplit model (logits within 1e-5,
gradients within 1e-5 relative to the largest, as the split model's TP tests compare them). A type that differs or
fails is recorded with its reason (the first tensor that differs, or the exception), never stopping the sweep. The
findings are written to `hfsplit/models/tp_proven.json` under the transformers version, which `tp_degree_error` reads.

Where float32 differs, the same comparison runs again with both models in float64 (`in_float64`), and the type is
proven when it passes there: a sharding fault (a gradient not summed, or summed twice, a layout that mismatches the
weights) differs at any precision, while the rounding of a different summation order shrinks with it. Some models'
gradients amplify float32 rounding past the tolerance in transformers' own model (Gated DeltaNet's decay parameters,
Gemma 3n's embedding): there the split is no further from the exact answer than transformers' float32 model is, so
the plain check cannot tell them apart (docs/design.md, "Tensor-parallel proof"). Such types are recorded with the
float32 difference that float64 showed to be rounding.

    python scripts/families_table.py     # runs it (one launch of two gloo ranks) and writes the data and the table
"""
from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from hfsplit.apply.tp import grad_summed_over_tp, shard_layout
from hfsplit.errors import UnsupportedModelError
from hfsplit.load.proof import (
    TOLERANCE, both_backward, config_key, registered_types, split_gradients, split_stages, tiny_model,
    without_measures,
)
from hfsplit.models.families import (
    TP_PROVEN, TP_STYLES, check_causal_lm, tp_degree_error, tp_divides, tp_plan_of, tp_refused_flag, unplaced_packed,
)
from hfsplit.planning.costs.cache import read_cache, write_cache
from hfsplit.models.shrink import shrunk_config
from hfsplit.parallel.mesh import environment_outside_launch

TP = 2
PP = 2
DIFFER = "its shards differ from transformers: "  # how a verdict names the first tensor that differs
LIKELY = ("; likely cause: a parameter its plan leaves whole that sees only a rank's share, its gradient not summed "
          "over the ranks")
UNFINISHED, RANKS_FAILED = "its tp=2 proof did not finish", "its tp=2 proof ranks failed"  # not the model's verdict
RANKS_TIMEOUT_S = 300  # the two ranks of a per-config proof: imports, two tiny models, a few collectives


@dataclass(frozen=True)
class TpVerdict:
    """What the sweep found for one model type at tp=2.

    Args:
        model_type: the registered model type.
        proven: its pp=2 stages sharded at tp=2 equal transformers (logits and gradients).
        reason: why not, in one line ("" when proven).
        logits_diff: the largest absolute logits difference; grad_diff: the largest relative gradient difference (both
            in float32).
        rounding: where float32 differed when float64 proved it ("" when float32 proved it).
    """

    model_type: str
    proven: bool
    reason: str = ""
    logits_diff: float = 0.0
    grad_diff: float = 0.0
    rounding: str = ""

    def line(self) -> str:
        """The verdict as `hfsplit check --tp 2` prints it."""
        if not self.proven:
            return f"{self.model_type}: tp=2 refused: {self.reason}"
        return (f"{self.model_type}: tp=2 shards equal transformers on this config (pp=2 x tp=2, logits "
                f"{self.logits_diff:.1e}, gradients {self.grad_diff:.1e} relative"
                + (f"; proven in float64: {self.rounding})" if self.rounding else ")"))


def tp_sweep(types: Optional[list[str]] = None) -> list[dict]:
    """On each of two ranks of a launch (torchrun's environment, gloo): the verdict (as a dict) of every type of
    `types` (every registered causal-LM type by default). Both ranks build and run the same models in the same order,
    so their collectives meet."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():  # a mismatched collective fails after a minute instead of hanging the sweep
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (TP,))
    out = []
    for model_type in types or registered_types():
        print(f"--- tp=2 {model_type}", flush=True)  # the launcher's error shows the last lines
        out.append(asdict(tp_verdict(model_type, mesh)))
    return out


def tp_verdict(model_type: str, mesh) -> TpVerdict:
    """`model_type`'s default config shrunk, split into pp=2 stages sharded over `mesh`, compared with transformers."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(model_type)
    except Exception as error:
        return TpVerdict(model_type, False, f"its shrunk config could not be made ({_short(error)})")
    return replace(config_tp_verdict(config, mesh), model_type=model_type)


def config_tp_verdict(config, mesh) -> TpVerdict:
    """`config` shrunk, split into pp=2 stages sharded over `mesh`, compared with transformers; collective."""
    model_type = config.model_type
    try:
        tiny = shrunk_config(config)
    except Exception as error:
        return TpVerdict(model_type, False, f"its shrunk config could not be made ({_short(error)})")
    if why := unshardable(tiny):
        return TpVerdict(model_type, False, why)
    try:
        whole = tiny_model(tiny)
    except Exception as error:
        return TpVerdict(model_type, False, f"the shrunk model could not be built ({_short(error)})")
    try:
        stages = split_stages(whole, pp=PP, tp_mesh=mesh)
    except Exception as error:
        return TpVerdict(model_type, False, f"its tp=2 stages could not be built ({_short(error)})")
    if not any(shard_layout(p) for stage in stages for p in stage.parameters()):  # else nothing would be proven
        return TpVerdict(model_type, False, "its tensor-parallel plan matched none of its modules")
    try:
        logits_diff, grad_diff, where = compared_tp(whole, stages, mesh)
    except Exception as error:
        return TpVerdict(model_type, False, f"its tp=2 forward or backward failed ({_short(error)}); likely cause: "
                                            "a module that reads its full width from the config")
    if where and equal_in_float64(whole, mesh):
        return TpVerdict(model_type, True, "", logits_diff, grad_diff,
                         rounding=f"{where.removeprefix(DIFFER).removesuffix(LIKELY)} in float32, equal in float64")
    return TpVerdict(model_type, not where, where, logits_diff, grad_diff)


def equal_in_float64(whole: nn.Module, mesh) -> bool:
    """Whether `whole`'s tp=2 stages equal it (`compared_tp`) with both in float64; collective. False also when
    the model cannot run in float64."""
    try:
        whole64, stages64 = in_float64(whole, mesh)
        return not compared_tp(whole64, stages64, mesh)[2]
    except Exception:
        return False


def in_float64(whole: nn.Module, mesh) -> tuple[nn.Module, list[nn.Module]]:
    """A float64 copy of `whole` (no gradients) and its pp=2 stages sharded over `mesh`, their recomputed buffers
    (rotary tables, scales) in float64 as the copy's are; fused experts run one by one (`grouped_mm` has no float64)."""
    whole64 = copy.deepcopy(whole)
    for p in whole64.parameters():
        p.grad = None
    whole64.double()
    whole64.config._experts_implementation = "eager"
    stages = split_stages(whole64, pp=PP, tp_mesh=mesh)
    for stage in stages:
        for module in stage.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_floating_point():
                    module._buffers[name] = buffer.double()
    return whole64, stages


# --- the proof on the user's own config ---------------------------------------------------------------------------

def proven_tp(config, tp: int = TP, measure=None) -> TpVerdict:
    """The tp=2 verdict for `config` (cached by its hash), before a run at degree `tp`; UnsupportedModelError naming
    why `tp` cannot shard it (`tp_degree_error`: its plan, its sizes, the sweep's type-level finding) or the first
    tensor that differs when its shards do not equal transformers. `measure`: as `tp_verdict_of`'s."""
    if why := tp_degree_error(config, tp):
        raise UnsupportedModelError(why)
    verdict = tp_verdict_of(config, measure)
    if not verdict.proven:
        name = getattr(config, "_name_or_path", "") or ""
        raise UnsupportedModelError(
            f"{name + ': ' if name else ''}model_type {verdict.model_type!r}: its tensor-parallel split is refused on "
            f"this config: {verdict.reason}; use tp=1 (pipeline stages split it)")
    return verdict


def tp_verdict_of(config, measure=None) -> TpVerdict:
    """The tp=2 verdict for `config`: refused by name without a process when hfsplit cannot shard it at all, else
    from the cache ("tp_proof", by the config's hash) or measured now on two child CPU ranks by `measure` (default
    `ranks_verdict`; a launched rank 0's `forked_prover`)."""
    check_causal_lm(config)
    try:
        tiny = shrunk_config(config)
    except Exception as error:
        return TpVerdict(config.model_type, False, f"its shrunk config could not be made ({_short(error)})")
    if why := unshardable(tiny):
        return TpVerdict(config.model_type, False, why)
    key = config_key(config)
    if (cached := read_cache("tp_proof", key)) is not None:
        return TpVerdict(**cached)
    verdict = (measure or ranks_verdict)(config)
    if not verdict.reason.startswith((UNFINISHED, RANKS_FAILED)):  # a crash or a hang may not recur: not kept
        write_cache("tp_proof", key, asdict(verdict))
    return verdict


def ranks_verdict(config, start=None) -> TpVerdict:
    """`config_tp_verdict` measured on two gloo CPU ranks: child processes with their own rendezvous on a free port
    (never a launch's process group, which may already exist in this process), killed after RANKS_TIMEOUT_S or as
    soon as one fails. `start` starts them: `forked_ranks` from this process, which spares each rank the imports of
    torch and transformers (most of a new config's cost), or `interpreter_ranks`; default: forked where that is safe
    (`fork_is_safe`)."""
    with tempfile.TemporaryDirectory(prefix="hfsplit-tp-proof-") as folder:
        start = start or (forked_ranks if fork_is_safe() else interpreter_ranks)
        blamed = blamed_rank(start(config, folder, _free_port()), RANKS_TIMEOUT_S)
        found = Path(folder, "tp_verdict.json")
        if found.exists():
            return TpVerdict(**json.loads(found.read_text()))
        if blamed is None:
            return TpVerdict(config.model_type, False, f"{UNFINISHED} in {RANKS_TIMEOUT_S} s")
        lines = Path(folder, f"rank-{blamed}.log").read_text(errors="replace").splitlines()
        last = next((line for line in reversed(lines) if line.strip()), "no output")
        return TpVerdict(config.model_type, False, f"{RANKS_FAILED} ({last[:160]})")


def fork_is_safe() -> bool:
    """Whether this process can fork the proof's ranks: on Linux (elsewhere fork is unsafe with the system's
    libraries), before CUDA is initialised (a forked child cannot use it), and outside a process group (a child
    would inherit the launch's connections to its peers, and `init_process_group` refuses a second default group)."""
    return sys.platform == "linux" and not torch.cuda.is_initialized() and not dist.is_initialized()


def forked_ranks(config, folder: str, port: int) -> list:
    """The proof's ranks as children forked from this process (torch and transformers already imported), each one's
    output in the folder's `rank-N.log`."""
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    ranks = [fork.Process(target=_forked_main, args=(config, folder, port, rank), daemon=True) for rank in range(TP)]
    for rank in ranks:
        rank.start()
    return ranks


def _forked_main(config, folder: str, port: int, rank: int) -> None:
    log = open(Path(folder, f"rank-{rank}.log"), "w", buffering=1)
    for fd in (1, 2):  # what the C++ side prints (gloo, OpenMP) too
        os.dup2(log.fileno(), fd)
    sys.stdout = sys.stderr = log  # this process's streams may be a capture's (pytest), not fds 1 and 2
    rank_main(config, folder, port, rank)


@contextmanager
def forked_prover(wanted: bool = True):
    """A `measure` for `tp_verdict_of` in a process about to join a launch: a child forked now, before its process
    group and CUDA exist, that later forks the proof's ranks itself (`ranks_verdict` with `forked_ranks`), sparing
    a launched rank 0 the fresh interpreters' imports. `ranks_verdict` where not `wanted` or a fork is unsafe now.
    The child ends when the block does."""
    if not (wanted and fork_is_safe()):
        yield ranks_verdict
        return
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    ours, theirs = fork.Pipe()
    prover = fork.Process(target=_prover_main, args=(theirs, ours))  # not a daemon: daemons fork no children
    prover.start()
    theirs.close()

    def measured(config) -> TpVerdict:
        try:
            ours.send(config)
            if ours.poll(RANKS_TIMEOUT_S + 60):  # its ranks time out first; this only bounds a hung prover
                return ours.recv()
        except (EOFError, OSError):  # the prover ended (a config it could not unpickle): fresh interpreters
            return ranks_verdict(config)
        return TpVerdict(config.model_type, False, f"{UNFINISHED} in {RANKS_TIMEOUT_S} s")

    try:
        yield measured
    finally:
        ours.close()  # the prover's recv ends
        prover.join(timeout=60)
        if prover.exitcode is None:
            prover.kill()
            prover.join()


def _prover_main(theirs, ours) -> None:
    ours.close()  # else this child's own copy keeps its pipe open after the parent is gone
    while True:
        try:
            config = theirs.recv()
        except EOFError:
            return
        theirs.send(ranks_verdict(config, forked_ranks))


def interpreter_ranks(config, folder: str, port: int) -> list[subprocess.Popen]:
    """The proof's ranks in fresh interpreters (`python -m hfsplit.load.tp_proof FOLDER PORT RANK`), reading `config`
    saved in the folder, each one's output in the folder's `rank-N.log`."""
    config.save_pretrained(folder)
    env = environment_outside_launch()
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    ranks = []
    for rank in range(TP):
        with open(Path(folder, f"rank-{rank}.log"), "w") as log:
            ranks.append(subprocess.Popen([sys.executable, "-m", "hfsplit.load.tp_proof", folder, str(port), str(rank)],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
    return ranks


def blamed_rank(ranks: list, timeout_s: float) -> Optional[int]:
    """Wait for the child ranks (forked `multiprocessing.Process`es or `subprocess.Popen`s): the one whose log tells
    why a verdict is missing (the first that failed, else rank 0), or None when some still ran after `timeout_s`.
    Once one has failed or the time is up the others are killed (a rank whose peer died would wait for it until
    gloo's timeout)."""
    deadline = time.monotonic() + timeout_s
    codes: list = [None] * len(ranks)
    failed: list[int] = []
    try:
        while None in codes and not failed and time.monotonic() < deadline:
            time.sleep(0.01)
            codes = [_exit_code(rank) for rank in ranks]
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
    finally:
        for rank in ranks:
            if _exit_code(rank) is None:
                rank.kill()
            if isinstance(rank, subprocess.Popen):
                rank.wait()
            else:
                rank.join()
    return failed[0] if failed else None if None in codes else 0


def _exit_code(rank) -> Optional[int]:
    return rank.poll() if isinstance(rank, subprocess.Popen) else rank.exitcode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(config, folder: str, port: int, rank: int) -> None:
    """One child rank of `ranks_verdict`: `config`'s verdict on the two ranks' own gloo group, written to the folder
    by rank 0."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # a forked rank keeps its parent's thread count; two ranks share the cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP,
                            timeout=timedelta(seconds=120))
    try:
        verdict = config_tp_verdict(config, init_device_mesh("cpu", (TP,)))
        if rank == 0:
            Path(folder, "tp_verdict.json").write_text(json.dumps(asdict(verdict)))
    finally:
        dist.destroy_process_group()


def unshardable(config) -> Optional[str]:
    """Why hfsplit cannot shard `config`'s model at tp=2 without trying (None when it can try)."""
    plan = tp_plan_of(config)
    if not plan:
        return "it declares no tensor-parallel plan (base_model_tp_plan)"
    if other := sorted(set(plan.values()) - set(TP_STYLES)):
        return f"its tensor-parallel plan uses {', '.join(other)}, which hfsplit does not shard"
    if packed := unplaced_packed(config):
        return f"its tensor-parallel plan packs {packed} outside fused experts"
    if flag := tp_refused_flag(config):
        return f"its plan is wrong under {flag}=True"
    if getattr(config, "num_attention_heads", None) is None:  # a composite config (Llama 4's text model is inside)
        return "its config gives no attention heads to divide (num_attention_heads)"
    if not tp_divides(config, TP):
        return "2 does not divide its attention heads, key-value heads and MLP widths (shrunk)"
    return None


def compared_tp(whole: nn.Module, stages: list[nn.Module], mesh) -> tuple[float, float, str]:
    """(logits diff, relative gradient diff, "" or the first tensor that differs) of the sharded stages against
    `whole`; collective (every rank runs it)."""
    _, want, got = both_backward(whole, stages)
    summed_over_tp(stages, mesh)
    logits_diff = (want - got).abs().max().item()
    grads = split_gradients(whole, stages)
    diffs = {name: _relative(p.grad, grads.get(name)) for name, p in whole.named_parameters()}
    grad_diff = max(diffs.values(), default=0.0)
    if not logits_diff <= TOLERANCE:  # (`not <=`: a NaN differs)
        return logits_diff, grad_diff, f"{DIFFER}logits {logits_diff:.2g} off"
    name = next((n for n, d in diffs.items() if not d <= TOLERANCE), None)
    if name is None:
        return logits_diff, grad_diff, ""
    return logits_diff, grad_diff, (f"{DIFFER}{name}'s gradient {diffs[name]:.2g} off (relative){LIKELY}")


def summed_over_tp(stages: list[nn.Module], mesh) -> None:
    """Sum over the TP ranks the gradients of the replicated modules that see only this rank's heads (per-head
    q/k norms), as `SplitModel.sync_grads` sums them in a run."""
    for stage in stages:
        for module in stage.modules():
            if grad_summed_over_tp(module):
                for p in module.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad, group=mesh.get_group())


def _relative(want: Optional[torch.Tensor], got: Optional[torch.Tensor]) -> float:
    if want is None or got is None:
        return 0.0 if want is None and got is None else float("inf")
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def _short(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text if len(text) <= 160 else text[:157] + "..."


# --- the findings, as data ----------------------------------------------------------------------------------------

def findings_of(verdicts: list[dict]) -> dict:
    """The sweep's verdicts as `tp_proven.json` keeps them for one transformers version: the proven types, the
    others' reasons, and where the proven ones differed in float32 when float64 proved them (`rounding`), without
    their measured gaps (so that the file changes only when a verdict does)."""
    ordered = sorted(verdicts, key=lambda v: v["model_type"])
    proven = [v["model_type"] for v in ordered if v["proven"]]
    refused = {v["model_type"]: without_measures(v["reason"]) for v in ordered if not v["proven"]}
    rounding = {v["model_type"]: without_measures(v["rounding"]) for v in ordered if v["proven"] and v.get("rounding")}
    return {"proven": proven, "refused": refused, "rounding": rounding}


def write_findings(verdicts: list[dict]) -> None:
    """Record the sweep's findings under the installed transformers version: the swept types' replace theirs, the
    other types' and other versions' are kept (a sweep of a few types updates only those)."""
    import transformers

    data = json.loads(TP_PROVEN.read_text()) if TP_PROVEN.exists() else {}
    old, new = data.get(transformers.__version__, {}), findings_of(verdicts)
    swept = {v["model_type"] for v in verdicts}
    merged = {part: {t: why for t, why in old.get(part, {}).items() if t not in swept} | new[part]
              for part in ("refused", "rounding")}
    data[transformers.__version__] = {
        "proven": sorted({t for t in old.get("proven", []) if t not in swept} | set(new["proven"])),
        **{part: dict(sorted(found.items())) for part, found in merged.items()}}
    TP_PROVEN.write_text(json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n")


if __name__ == "__main__":  # a child rank of `ranks_verdict` in a fresh interpreter: FOLDER PORT RANK
    from transformers import AutoConfig

    rank_main(AutoConfig.from_pretrained(sys.argv[1]), sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
