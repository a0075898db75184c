"""Process layout: a rank's place in the (dp, pp, tp) grid, its device, and its groups.

Ranks are laid out row-major over ``(dp, pp, tp)``: neighbours in a TP group are
adjacent ranks (on one machine under torchrun), pipeline neighbours are ``tp`` apart.
Every check that can fail runs here, before any weight is read, so a bad launch
fails with a PlanError on every rank instead of hanging in a collective.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from hfsplit.budget import gpu_index
from hfsplit.errors import PlanError
from hfsplit.parallel.host_memory import fix_mmap_threshold
from hfsplit.plan import Coordinates, Plan, coordinates_of_rank
from hfsplit.schedules import TABLE, pp_rank_of_stage


def schedule_pp_rank(*, schedule: str, pp: int, index: int) -> int:
    """The pipeline rank torch's `schedule` expects stage `index` on: looped (i % pp) or V-shaped."""
    return pp_rank_of_stage(schedule, pp=pp, index=index)


def stage_to_pp_rank(plan: Plan) -> dict[int, int]:
    """Pipeline rank holding each stage index, as the plan says."""
    return {s.index: s.pp_rank for s in plan.stages}


def stage_indices_of_pp_rank(plan: Plan, *, pp_rank: int) -> tuple[int, ...]:
    """The stage indices pipeline rank `pp_rank` runs, in pipeline order."""
    return tuple(sorted(s.index for s in plan.stages_of_rank(pp_rank)))


def check_plan_for_world(plan: Plan, *, world_size: int) -> None:
    """Raise PlanError when `plan` cannot run on `world_size` ranks (before any weight is read)."""
    if world_size != plan.world_size:
        raise PlanError(
            f"the plan needs pp={plan.pp} × tp={plan.tp} × dp={plan.dp} = {plan.world_size} processes but "
            f"{world_size} were launched; launch with --nproc_per_node {plan.world_size} (or plan for {world_size} devices)"
        )
    expected = plan.pp * plan.virtual_stages
    if len(plan.stages) != expected:
        raise PlanError(
            f"the plan has {len(plan.stages)} stages but pp={plan.pp} × virtual_stages={plan.virtual_stages} "
            f"= {expected} slots; make the stage count equal pp × virtual_stages"
        )
    if plan.virtual_stages > 1 and TABLE[plan.schedule].stages_per_rank == 1:
        raise PlanError(
            f"schedule {plan.schedule} runs one stage per rank but the plan has {plan.virtual_stages} per rank; "
            "use Interleaved1F1B / ZBVZeroBubble or virtual_stages=1"
        )
    for s in plan.stages:
        want = schedule_pp_rank(schedule=plan.schedule, pp=plan.pp, index=s.index)
        if s.pp_rank != want:
            raise PlanError(
                f"stage {s.index} is planned on pipeline rank {s.pp_rank} but schedule {plan.schedule} "
                f"runs it on rank {want}; re-plan (the planner's pp_rank must follow the schedule's layout)"
            )
    layers = [i for s in sorted(plan.stages, key=lambda s: s.index) for i in range(*s.layers)]
    if layers != list(range(plan.num_layers)):
        raise PlanError(
            f"the plan's stages cover layers {layers}, not 0..{plan.num_layers - 1} in order; re-plan the model"
        )


def device_of_rank(*, local_rank: int, plan: Optional[Plan] = None, rank: int = 0) -> torch.device:
    """The one place choosing a rank's device. With CUDA: the GPU `plan` put this rank's stage on (the
    planner orders mismatched GPUs along the pipeline, so rank r need not run on GPU r), or before
    there is a plan the launcher's local GPU; without CUDA: the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if plan is None:  # more ranks than GPUs on a host share them round-robin
        return torch.device(f"cuda:{local_rank % torch.cuda.device_count()}")
    index = gpu_index_of_rank(plan, rank=rank, local_rank=local_rank, gpus_per_host=torch.cuda.device_count())
    return torch.device(f"cuda:{index}")


def host_device() -> torch.device:
    """The device of a rank's host RAM: what an input embedding table kept off the device lives on
    (`Stage.host_embedding`); on a CPU rank the same device as the rank's own."""
    return torch.device("cpu")


def gpu_index_of_rank(plan: Plan, *, rank: int, local_rank: int, gpus_per_host: int) -> int:
    """The local GPU index `plan` gives global `rank`: the device its stage was planned on for its
    (dp, tp) place. Budget devices are numbered host after host, so device g is GPU g % gpus_per_host
    of its host; a budget keyed by something else ("cpu") leaves the launcher's local rank."""
    coords = coordinates_of_rank(plan, rank=rank)
    stage = plan.stages_of_rank(coords.pp)[0]
    index = gpu_index(stage.devices[coords.dp][coords.tp])
    return index % gpus_per_host if index is not None else local_rank


@dataclass(frozen=True)
class World:
    """This process's place in the launch, as the launcher (torchrun, accelerate launch) gave it.

    Args:
        rank: the global rank (0 without a launcher).
        world_size: the ranks of the launch (1 without a launcher).
        local_rank: the rank's index on its host (picks its GPU before there is a plan).
        device: the rank's device before there is a plan (`device_of_rank`).
        local_world_size: ranks on this host (CPU ranks share its RAM and cores).
        restart_count: how many times torchrun restarted the worker group after a failure (0 on a first launch).
        run_id: torchrun's --rdzv-id, the same for every launch of one elastic job (None outside an elastic launch).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    local_world_size: int = 1
    restart_count: int = 0
    run_id: Optional[str] = None

    @property
    def launched(self) -> bool:
        """Started by a launcher with more than one rank: loading splits the model over the ranks."""
        return self.world_size > 1


def launcher_world() -> World:
    """The World the launcher's environment describes (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, and
    torchrun's TORCHELASTIC_RESTART_COUNT / TORCHELASTIC_RUN_ID), without joining any group: the one reader of
    that environment (`init_distributed` joins the group it names)."""
    env = os.environ
    world_size = int(env.get("WORLD_SIZE", "1"))
    local_rank = int(env.get("LOCAL_RANK", "0"))
    return World(rank=int(env.get("RANK", "0")), world_size=world_size, local_rank=local_rank,
                 device=device_of_rank(local_rank=local_rank),
                 local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
                 restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
                 run_id=env.get("TORCHELASTIC_RUN_ID"))


def environment_outside_launch() -> dict[str, str]:
    """This process's environment without what a launcher sets, for a child process that must not take itself for
    a rank of this launch (the tp proof's ranks, which meet at their own rendezvous)."""
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                "ROLE_RANK", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")
    return {k: v for k, v in os.environ.items() if k not in launcher}


def joined_world() -> World:
    """The World of the process group this process has joined (after an elastic regroup: the regrouped one)."""
    given = launcher_world()
    return replace(given, rank=dist.get_rank(), world_size=dist.get_world_size())


def init_distributed(*, timeout_s: float = 600.0) -> World:
    """Join the launch's default process group, once: the one way into torch.distributed; this rank's World.

    nccl on GPUs (each rank on its launcher-given GPU first), gloo otherwise; `timeout_s` bounds
    every wait on a peer, so a dead or hung rank ends the run instead of hanging it. Started
    without a launcher (no WORLD_SIZE), a one-rank group on a file store, so the same SPMD code
    runs and no port is needed. Joins nothing when a group already exists (the World is that group's).
    """
    if dist.is_initialized():
        return joined_world()
    world = launcher_world()
    if world.device.type == "cuda":
        torch.cuda.set_device(world.device)  # NCCL's first collective needs one GPU per rank
    else:
        fix_mmap_threshold()  # opt-in: a CPU rank's RSS then follows its live tensors (hfsplit/parallel/host_memory.py)
    timeout = timedelta(seconds=timeout_s)
    if "WORLD_SIZE" in os.environ:  # MASTER_ADDR / MASTER_PORT: read by torch's env:// rendezvous
        dist.init_process_group(backend=backend_for(world.device), timeout=timeout)
        return joined_world()
    store = Path(tempfile.mkdtemp(prefix="hfsplit-pg-")) / "store"
    dist.init_process_group(backend=backend_for(world.device), init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=timeout)
    return joined_world()


def backend_for(device: torch.device) -> str:
    """The process-group backend for `device`: nccl on CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class ParallelContext:
    """What a rank knows about the launch: its coordinates, device, mesh and groups.

    Args:
        plan: the plan being run.
        coords: this rank's (dp, pp, tp) coordinates.
        device: this rank's device.
        mesh: DeviceMesh of shape (dp, pp, tp) with dims named "dp", "pp", "tp".
        tied_group: group of the first and last stage's ranks sharing this rank's (dp, tp) when
            embeddings are tied and those stages sit on different ranks, else None.
    """

    plan: Plan
    coords: Coordinates
    device: torch.device
    mesh: object
    tied_group: Optional[object] = None

    @property
    def host(self) -> torch.device:
        """This rank's host RAM (`host_device`)."""
        return host_device()

    @property
    def pp_group(self):
        return self.mesh["pp"].get_group()

    @property
    def tp_mesh(self):
        return self.mesh["tp"]

    @property
    def dp_group(self):
        return self.mesh["dp"].get_group()

    def global_rank(self, *, pp: int) -> int:
        """The global rank at pipeline position `pp` with this rank's dp and tp."""
        return (self.coords.dp * self.plan.pp + pp) * self.plan.tp + self.coords.tp


def init_parallel(plan: Plan, *, timeout_s: float = 600.0) -> ParallelContext:
    """Join (or reuse) the default process group from the launcher's environment and build the mesh.

    Raises:
        PlanError: the launched world size does not match the plan.
    """
    from torch.distributed.device_mesh import init_device_mesh

    # Checked before init so that a wrong launch never reaches a collective.
    given = joined_world() if dist.is_initialized() else launcher_world()
    check_plan_for_world(plan, world_size=given.world_size)
    world = init_distributed(timeout_s=timeout_s)
    device = device_of_rank(local_rank=world.local_rank, plan=plan, rank=world.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (plan.dp, plan.pp, plan.tp), mesh_dim_names=("dp", "pp", "tp"))
    coords = coordinates_of_rank(plan, rank=world.rank)
    return ParallelContext(plan=plan, coords=coords, device=device, mesh=mesh, tied_group=tied_group(plan, coords=coords))


def tied_group(plan: Plan, *, coords: Coordinates):
    """The group summing tied-embedding gradients between the first and last stage's ranks.

    Every rank takes part in creating every group (new_group is collective), so this is
    called on all ranks in the same order.
    """
    if not plan.tied_embeddings:
        return None
    mapping = stage_to_pp_rank(plan)
    first, last = mapping[0], mapping[len(plan.stages) - 1]
    if first == last:
        return None
    mine = None
    for dp in range(plan.dp):
        for tp in range(plan.tp):
            ranks = [(dp * plan.pp + p) * plan.tp + tp for p in (first, last)]
            group = dist.new_group(ranks)
            if coords.dp == dp and coords.tp == tp and coords.pp in (first, last):
                mine = group
    return mine
