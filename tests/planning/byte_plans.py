"""Plans built by hand with byte-sized figures, for the tests of what reads a Plan (its timeline, its charts)."""
from __future__ import annotations

from hfsplit.plan import Plan, Stage, StageMemory, TrainingSpec
from hfsplit.schedules import pp_rank_of_stage, virtual_stages


def byte_plan(*, schedule: str = "1F1B", pp: int = 2, micro_batches: int = 4, times: tuple[float, ...] = (),
              memories: tuple[StageMemory, ...] = (), devices: tuple[tuple[str, ...], ...] = (), budget: int = 100,
              method: str = "lora", checkpointing: str = "off") -> Plan:
    """A plan of `pp` ranks × the schedule's stages a rank, two layers a stage. Stage i runs on `devices[i]`
    (default: its rank's device), takes `times[i]` seconds a micro-batch (default 1) and holds `memories[i]`
    (default: weights 10, gradients 1, optimizer 2, activations 5 with workspace 3, reserve 4)."""
    count = pp * virtual_stages(schedule, pp)
    default = StageMemory(weights=10, gradients=1, optimizer=2, activations=5, reserve=4, workspace=3)
    stages = []
    for i in range(count):
        rank = pp_rank_of_stage(schedule, pp=pp, index=i)
        stages.append(Stage(index=i, pp_rank=rank, devices=(devices[i] if devices else (str(rank),),),
                            layers=(2 * i, 2 * i + 2), has_embed=i == 0, has_head=i == count - 1,
                            memory=memories[i] if memories else default, budget=budget,
                            time_s=times[i] if times else 1.0, checkpointing=checkpointing))
    spec = TrainingSpec(method=method, seq_len=16, activation_checkpointing=checkpointing)
    return Plan(model="hand", model_type="llama", num_layers=2 * count, tp=len(stages[0].devices[0]), pp=pp, dp=1,
                virtual_stages=count // pp, schedule=schedule, micro_batches=micro_batches, spec=spec,
                stages=tuple(stages), step_time_s=1.0, bubble_fraction=0.0)
