"""A Plan's steps: what `hfsplit.apply.steps.apply_plan` does to every stage, as data (`Plan.steps()`), and the
label each prints in the plan's table ("applies per stage: ...")."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional

if TYPE_CHECKING:  # the steps read a Plan; the Plan lists its steps (hfsplit.plan imports this module)
    from hfsplit.plan import Plan, TrainingSpec


class Step(NamedTuple):
    """One thing `apply_plan` does to every stage: its kind (the key of apply's table) and its value.

    Kinds, in the order they run: "tp" (the degree), "checkpointing" ("per block"), "tiled_mlp" (the slices, and
    where), "host_embedding" (the stage whose input embedding stays in host RAM), "load" (every plan reads
    its rank's bytes), "quantize" (the base's format), "lora" (the rank), "autocast" (the dtype).
    """

    kind: str
    value: object

    def __str__(self) -> str:
        return _LABELS[self.kind](self.value)


_LABELS = {
    "tp": lambda tp: f"tensor parallel tp={tp}",
    "checkpointing": lambda how: "activation checkpointing per block (non-reentrant)" + (
        "" if how == "per block" else how[len("per block"):]),
    "tiled_mlp": lambda what: f"MLP tiled over the sequence ({what})",
    "host_embedding": lambda stage: f"input embedding in host RAM, looked up on the CPU (stage {stage})",
    "load": lambda what: f"weights read ({what})",
    "quantize": lambda kind: _quantize_label(*kind.partition("; ")[::2]),
    "lora": lambda r: f"LoRA r={r}",
    "autocast": lambda dtype: f"forwards under autocast to {dtype} (adapters take 16-bit inputs)",
}


def _quantize_label(base: str, experts: str) -> str:
    """The quantize step's label: the base's format, then how an MoE's experts are held (`quantize_step`)."""
    return f"base quantized to {base} (bitsandbytes, per block as read{'; ' + experts if experts else ''})"


def tp_step(tp: int) -> Step:
    return Step("tp", tp)


def checkpointing_step(plan: Optional["Plan"] = None) -> Step:
    """The checkpointing step: "per block" where no stage offloads, else which stages keep their blocks' saved
    inputs in host memory (`plan.checkpointing_of` says it per stage; `apply.checkpointing` reads it there)."""
    offloaded = [s.index for s in plan.stages if plan.checkpointing_of(s) == "offload"] if plan else []
    if not offloaded:
        return Step("checkpointing", "per block")
    on = [s.index for s in plan.stages if plan.checkpointing_of(s) == "on"]
    where = "every stage" if len(offloaded) == len(plan.stages) else f"stage {', '.join(map(str, offloaded))}"
    return Step("checkpointing", f"per block, block inputs offloaded to host on {where}"
                + (f" (stage {', '.join(map(str, on))}: on device)" if on else ""))


def tiled_mlp_step(plan: "Plan") -> Step:
    """The tiled-MLP step: the slices of each stage that tiles its blocks' MLP (`plan.tiled_mlp_of` says it per
    stage; `apply.tiled_mlp` reads it there)."""
    tiled = [s for s in plan.stages if plan.tiled_mlp_of(s) > 1]
    counts = {plan.tiled_mlp_of(s) for s in tiled}
    where = "every stage" if len(tiled) == len(plan.stages) else f"stage {', '.join(str(s.index) for s in tiled)}"
    slices = f"{counts.pop()} slices" if len(counts) == 1 else "slices per stage"
    return Step("tiled_mlp", f"{slices} on {where}")


def host_embedding_step(plan: "Plan") -> Step:
    """The host-embedding step: the stage whose input embedding table stays in host RAM (`Stage.host_embedding`;
    `apply.host_embedding` reads it there)."""
    return Step("host_embedding", next(s.index for s in plan.stages if s.host_embedding))


def load_step() -> Step:
    return Step("load", "this rank's bytes")


def quantize_step(spec: TrainingSpec, *, experts: bool = False) -> Step:
    """The quantization step; `experts`: the model holds fused MoE experts (4-bit, or kept in `spec.dtype`)."""
    kind = "int8" if spec.load_in_8bit else f"{spec.bnb_4bit_quant_type}{' + double quant' if spec.bnb_4bit_use_double_quant else ''}"
    if experts:
        kind += (f"; MoE experts {spec.bnb_4bit_quant_type} too, expert by expert" if spec.experts_in_4bit
                 else f"; MoE experts kept in {spec.dtype}")
    return Step("quantize", kind)


def lora_step(r: int) -> Step:
    return Step("lora", r)


def autocast_step(dtype: str) -> Step:
    return Step("autocast", dtype)
