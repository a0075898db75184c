"""The Plan: the single contract between deciding a split and doing it.

A Plan is plain data (frozen dataclasses, JSON round trip). Everything downstream
(loading, stage building, training) reads its decisions from here and re-derives none.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Literal, Optional, Union

from hfsplit.budget import format_bytes
from hfsplit.errors import PlanError
from hfsplit.plan.left_out import LeftOut
from hfsplit.plan.steps import (
    Step, autocast_step, checkpointing_step, host_embedding_step, load_step, lora_step, quantize_step, tiled_mlp_step,
    tp_step,
)


Method = Literal["inference", "lora", "qlora", "full"]
Checkpointing = Literal["off", "on", "offload"]
Optim = Literal["adamw_torch", "adamw_8bit", "paged_adamw_8bit"]
CHECKPOINTING = ("off", "on", "offload")  # from the most memory to the least: the planner's order
OPTIMS = ("adamw_torch", "adamw_8bit", "paged_adamw_8bit")  # transformers' `optim` names
_CHECKPOINTING_SPELLINGS = {False: "off", True: "on", "off": "off", "on": "on", "offload": "offload",
                            "false": "off", "true": "on"}


@dataclass(frozen=True)
class ObjectiveCounts:
    """What a training objective asks the planner to count, as data. Each objective's module
    (`hfsplit.objectives`) declares its own; the planner reads them by the spec's `objective` and never names one.

    Args:
        rows_per_example: padded rows one example takes, kept in one micro-batch (2: a preference pair's chosen
            and rejected rows); a packed row holds whole examples.
        head: what the last stage's loss makes of the logits: "tokens" (the causal-LM loss over label tokens) or
            "sequences" (each row's summed fp32 response log-prob, then a loss over them).
        reference: a reference policy's log-probs enter the loss, where the spec names their source
            (`TrainingSpec.reference`: adapters-off or precomputed).
        generation: each step first generates its rows (rollouts) on the stages: the KV cache of the rollout batch
            (`TrainingSpec.rollout_rows` sequences of `rollout_tokens` new tokens) and its decode passes.
        example: what one example is called in the plan's table ("pair").
        parts: what an example's rows are, for the table ("chosen + rejected rows").
        chunked_loss: where the planner may turn the chunked loss on: "yes", "padded" (on padded rows only: its
            head sums each row, and a packed row holds several examples) or "no" (the loss needs whole logits).
    """

    rows_per_example: int = 1
    head: str = "tokens"
    reference: bool = False
    generation: bool = False
    example: str = "example"
    parts: str = ""
    chunked_loss: str = "yes"


# The registered objectives' declarations, by name (their modules: `hfsplit.objectives`; a test checks they agree).
OBJECTIVE_COUNTS = {
    "sft": ObjectiveCounts(),
    "dpo": ObjectiveCounts(rows_per_example=2, head="sequences", reference=True, example="pair",
                           parts="chosen + rejected rows", chunked_loss="padded"),
    "grpo": ObjectiveCounts(reference=True, generation=True, example="completion", chunked_loss="no"),
}

@dataclass(frozen=True)
class TrainingSpec:
    """What a step does; the planner's costs depend on it.

    Args:
        method: "inference" (forward only), "lora" (frozen base + adapters), "qlora" (LoRA on a bitsandbytes
            4-bit / 8-bit base: the blocks' linears quantized, embeddings, norms and lm_head 16-bit) or "full".
        seq_len: tokens per sequence.
        micro_batch_size: sequences per micro-batch.
        dtype: dtype of the weights and activations ("bfloat16", "float16", "float32").
        lora_r: LoRA rank.
        lora_alpha: LoRA alpha (the adapters' scale is alpha / r); None: 2 × `lora_r`.
        lora_dropout: dropout on the adapters' inputs.
        lora_targets: module names LoRA wraps; None means every attention and MLP projection.
        activation_checkpointing: recompute each block's activations in backward: False / "off", True / "on", or
            "offload" (checkpointing with each block's saved input moved to host memory until its recompute,
            `hfsplit.apply.offload`). "off" and "on" are kept as False and True. In a Plan, the most frugal
            setting any stage runs; each stage's own is `Stage.checkpointing`.
        optim: the optimizer, by transformers' names: "adamw_torch" (fp32 moments), "adamw_8bit" or
            "paged_adamw_8bit" (bitsandbytes' 8-bit blockwise moments; paged ones page out under memory pressure
            on CUDA and fall back to non-paged on CPU). In a Plan, 8-bit when any stage runs it (`Stage.optim`).
        reserve_bytes: per-device reserve (context, fragmentation, comm buffers); None: measured for the
            budget's devices by `make_plan` (see `hfsplit.planning.reserve`: 0 on the CPU).
        bnb_4bit_quant_type, bnb_4bit_use_double_quant, load_in_8bit: the QLoRA base's `BitsAndBytesConfig`.
        quantize_experts: 4-bit QLoRA on an MoE quantizes its fused experts too, each expert alone as it is read
            (`hfsplit.apply.quantized_experts`); False keeps them in `dtype`, as transformers + bitsandbytes do. An
            8-bit base keeps them in `dtype` either way.
        chunked_loss: the last stage runs lm_head and the loss a chunk of tokens at a time, never holding a whole
            micro-batch's logits (`hfsplit.models.loss`).
        autocast: QLoRA with a 16-bit compute dtype runs its stage forwards (and their checkpointed recompute)
            under `torch.autocast` to that dtype, as transformers' Trainer does with bf16/fp16, so peft's fp32
            adapters take the 16-bit inputs instead of keeping fp32 copies of them (`hfsplit.apply.autocast`).
            None: on for 16-bit 4-bit QLoRA; False: off. No effect in float32, on an 8-bit base (not measured
            under autocast) or for other methods.
        packing: rows hold several examples, each isolated by its position ids: under sdpa every stage runs each
            example's attention on its own (`hfsplit.models.varlen`: the examples' indices per micro-batch, no
            mask, attention `Σ lᵢ²`), under eager it builds transformers' block-diagonal causal mask (a
            materialised `seq_len²` mask per micro-batch), which the costs count and the calibration times.
        objective: the training objective by its registered name ("sft": the causal-LM loss; "dpo": TRL's DPO loss
            on chosen/rejected pairs, each pair two rows of one micro-batch, so `micro_batch_size` counts rows and
            is even; "grpo": TRL's GRPO on generated completions). What the planner counts for it is its declared
            `ObjectiveCounts` (`counts`).
        reference: the reference policy's log-probs, for an objective that declares one (DPO; GRPO with beta > 0):
            "adapters-off" (a no-grad forward of each step's rows through the same stages with the adapters off,
            before its training pass) or "precomputed" (one no-grad pass over the data before training, the
            log-probs kept on the last stage); None without one.
        reference_pairs: DPO with a precomputed reference: the pairs of the data set whose log-probs the last stage
            keeps (None: not known where the plan was made, counted as one step's pairs).
        rollout_rows, rollout_tokens: an objective that generates (GRPO): the sequences one replica generates per
            step (prompts × generations) and the new tokens of each; 0 otherwise. An inference plan with
            `rollout_tokens` is for generating that many new tokens of each `seq_len` positions: its head runs on
            those positions only, as `generate` runs it, so the head's stage takes as many blocks as the others.
        tiled_mlp: the slices of the sequence each block's MLP and its own norms run in, forward and
            recompute-backward, so the MLP's intermediates and the norms' fp32 copies never exist for the whole
            sequence (`hfsplit.apply.tiled_mlp`); 0: untiled. In a Plan, the
            most any stage runs; each stage's own is `Stage.tiled_mlp`.
        host_embedding: LoRA / QLoRA: the first stage's input embedding table (frozen, never quantized) stays in
            host RAM, its lookup runs on the CPU and only the looked-up rows go to the device
            (`hfsplit.apply.host_embedding`). In a Plan, whether the first stage runs so (`Stage.host_embedding`).
    """

    method: Method = "lora"
    seq_len: int = 2048
    micro_batch_size: int = 1
    dtype: str = "bfloat16"
    lora_r: int = 16
    lora_targets: Optional[tuple[str, ...]] = None
    activation_checkpointing: Union[bool, str] = False
    reserve_bytes: Optional[int] = None
    bnb_4bit_quant_type: str = "nf4"
    bnb_4bit_use_double_quant: bool = True
    load_in_8bit: bool = False
    chunked_loss: bool = False
    autocast: Optional[bool] = None
    packing: bool = False
    optim: str = "adamw_torch"
    quantize_experts: bool = True
    lora_alpha: Optional[int] = None
    lora_dropout: float = 0.0
    objective: str = "sft"
    reference: Optional[str] = None
    reference_pairs: Optional[int] = None
    rollout_rows: int = 0
    rollout_tokens: int = 0
    tiled_mlp: int = 0
    host_embedding: bool = False

    def __post_init__(self):
        mode = checkpointing_mode(self.activation_checkpointing)
        # on and off stay booleans (today's plans and their JSON); offload is the one string
        object.__setattr__(self, "activation_checkpointing", {"off": False, "on": True}.get(mode, mode))

    @property
    def counts(self) -> ObjectiveCounts:
        """What the objective declares for the planner to count (`OBJECTIVE_COUNTS`)."""
        if self.objective not in OBJECTIVE_COUNTS:
            raise PlanError(f"objective {self.objective!r}: choose {', '.join(OBJECTIVE_COUNTS)}")
        return OBJECTIVE_COUNTS[self.objective]

    @property
    def reference_pass(self) -> bool:
        """Whether a reference policy's log-probs enter the loss: the objective declares one and the spec names
        its source."""
        return self.counts.reference and self.reference is not None

    @property
    def rows_per_example(self) -> int:
        """Padded rows one example takes in a micro-batch (a packed row holds whole examples: 1)."""
        return 1 if self.packing else self.counts.rows_per_example

    @property
    def pairs_per_micro_batch(self) -> int:
        """Examples of several rows (DPO's chosen/rejected pairs) one micro-batch holds; 0 where an example is one
        row, and for packed rows (as many as fit each row)."""
        return self.micro_batch_size // self.rows_per_example if self.rows_per_example > 1 else 0

    @property
    def checkpointing(self) -> str:
        """"off", "on" or "offload"; always "off" for inference."""
        return "off" if self.method == "inference" else checkpointing_mode(self.activation_checkpointing)

    @property
    def autocast_dtype(self) -> Optional[str]:
        """The dtype this run's stage forwards autocast to (see `autocast`), or None when they do not."""
        on = self.method == "qlora" and not self.load_in_8bit and self.dtype != "float32" and self.autocast is not False
        return self.dtype if on else None

    @property
    def weights_dtype(self) -> str:
        """The dtype a run holds the weights in: full fine-tuning in 16 bits keeps fp32 master weights (AMP-style,
        the cost model's fp32 masters) and computes under autocast to `dtype` (`full_autocast_dtype`); every other
        method holds them in `dtype` (a LoRA / QLoRA base frozen in 16 bits; peft keeps the adapters fp32)."""
        return "float32" if self.method == "full" and self.dtype in ("bfloat16", "float16") else self.dtype

    @property
    def full_autocast_dtype(self) -> Optional[str]:
        """The dtype full fine-tuning's fp32 master weights compute in under `torch.autocast`, or None when the
        weights are held in the dtype they compute in."""
        return self.dtype if self.weights_dtype != self.dtype else None

    @property
    def alpha(self) -> int:
        """LoRA alpha: `lora_alpha`, else 2 × `lora_r`."""
        return self.lora_alpha if self.lora_alpha is not None else 2 * self.lora_r

    @property
    def experts_in_4bit(self) -> bool:
        """Whether a QLoRA run of this spec holds an MoE's fused experts in 4 bits (see `quantize_experts`)."""
        return self.method == "qlora" and self.quantize_experts and not self.load_in_8bit


@dataclass(frozen=True)
class StageMemory:
    """Estimated bytes one rank of a stage holds at its peak."""

    weights: int
    gradients: int
    optimizer: int
    activations: int  # kept for backward by the micro-batches in flight, plus `workspace`
    reserve: int
    workspace: int = 0  # the transient part of `activations`: the peak of one part running once
    offload: int = 0  # host bytes the activation offload holds at the stage's peak (not device memory: not in total)
    host_weights: int = 0  # weights kept in host RAM (the input embedding table on the host): not in total

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.reserve


def checkpointing_mode(value) -> str:
    """"off", "on" or "offload" for any accepted spelling (False / True / "off" / "on" / "offload")."""
    mode = _CHECKPOINTING_SPELLINGS.get(value.lower() if isinstance(value, str) else value)
    if mode is None:
        raise PlanError(f"activation checkpointing {value!r}: use auto, off, on or offload (or False / True)")
    return mode


def is_8bit(optim: str) -> bool:
    """Whether `optim` (an `OPTIMS` name) keeps bitsandbytes' 8-bit moments."""
    return optim in ("adamw_8bit", "paged_adamw_8bit")


def rank_total(memories) -> int:
    """Peak bytes of one device running several stages (interleaved / V schedules): their state and kept
    activations add up, while the device holds one reserve and one stage's transient workspace at a time."""
    memories = list(memories)
    shared = (len(memories) - 1) * memories[0].reserve + sum(m.workspace for m in memories) - \
        max(m.workspace for m in memories)
    return sum(m.total for m in memories) - shared


@dataclass(frozen=True)
class Stage:
    """One pipeline stage (a virtual stage under interleaved schedules).

    Args:
        index: position in the pipeline, 0 first.
        pp_rank: the pipeline rank that runs it (interleaved: `index % pp`; V-shaped: rank r runs r and 2p-1-r).
        devices: devices of its TP group for each data-parallel replica: `devices[r][t]`.
        layers: decoder blocks `[start, stop)`.
        has_embed: holds the input embeddings.
        has_head: holds the final norm and lm_head (and computes the loss).
        memory: estimated peak per rank.
        budget: the smallest budget among its devices.
        time_s: estimated forward + backward time per micro-batch.
        checkpointing: this stage's activation checkpointing, "off" / "on" / "offload" (None: the spec's).
        optim: the optimizer of this stage's trainable parameters, an `OPTIMS` name (None: the spec's).
        tiled_mlp: the slices each of this stage's blocks runs its MLP in (0: untiled; None: the spec's).
        host_embedding: its input embedding table stays in host RAM, looked up on the CPU (first stage only).
    """

    index: int
    pp_rank: int
    devices: tuple[tuple[str, ...], ...]
    layers: tuple[int, int]
    has_embed: bool
    has_head: bool
    memory: StageMemory
    budget: int
    time_s: float
    checkpointing: Optional[str] = None
    optim: Optional[str] = None
    tiled_mlp: Optional[int] = None
    host_embedding: bool = False

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclass(frozen=True)
class Plan:
    """How a model is split across devices for one kind of step.

    Args:
        model: the name or path the plan was made for.
        model_type: transformers `model_type`.
        num_layers: decoder blocks in the model.
        tp: tensor-parallel degree inside each stage.
        pp: pipeline ranks (physical stages).
        dp: data-parallel replicas.
        virtual_stages: stages per pipeline rank (1 except for interleaved schedules).
        schedule: a torch.distributed.pipelining schedule name (see `hfsplit.schedules.PLANNABLE`).
        micro_batches: micro-batches per step per replica.
        spec: the training spec the costs were computed for.
        stages: pp × virtual_stages stages in pipeline order; `stage.pp_rank` says which rank runs each.
        step_time_s: estimated time of one optimizer step.
        bubble_fraction: the schedule's idle fraction, `(p-1)/(m+p-1)` for 1F1B.
        tied_embeddings: lm_head shares the embedding matrix.
        fused_experts: the model's sparse blocks hold fused MoE experts (3-D parameters; QLoRA may quantize them).
        applied: the steps the run applied to its stages (`apply_plan`'s; empty until a run builds them).
        reference_s: DPO's reference pass over one step's rows (`hfsplit.planning.reference`): with adapters-off,
            seconds within each step (in `step_time_s`); precomputed, the one-off pass's seconds per global batch
            of the data, before training (not in `step_time_s`); 0 for SFT.
        rollout_s: an objective that generates (GRPO, `hfsplit.planning.rollout`): seconds of each step's rollout
            (prefill and decode of the replica's rows), in `step_time_s`; its KV cache is in the stages' memory.
        left_out: a multimodal checkpoint's towers, which the plan (of its language model) leaves out; None for a
            causal LM.
    """

    model: str
    model_type: str
    num_layers: int
    tp: int
    pp: int
    dp: int
    virtual_stages: int
    schedule: str
    micro_batches: int
    spec: TrainingSpec
    stages: tuple[Stage, ...]
    step_time_s: float
    bubble_fraction: float
    tied_embeddings: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)
    applied: tuple[Step, ...] = field(default_factory=tuple)
    fused_experts: bool = False
    reference_s: float = 0.0
    rollout_s: float = 0.0
    left_out: Optional[LeftOut] = None

    def steps(self) -> tuple[Step, ...]:
        """What `hfsplit.apply.steps.apply_plan` does to each stage for this plan, in order: data, one
        `Step(kind, value)` each (printed as its label), e.g. `(("tp", 2), ("checkpointing", "per block"),
        ("load", "this rank's bytes"), ("lora", 16))`."""
        out = []
        if self.tp > 1:
            out.append(tp_step(self.tp))
        if any(self.checkpointing_of(s) != "off" for s in self.stages):
            out.append(checkpointing_step(self))
        if any(self.tiled_mlp_of(s) > 1 for s in self.stages):
            out.append(tiled_mlp_step(self))
        if any(s.host_embedding for s in self.stages):
            out.append(host_embedding_step(self))
        out.append(load_step())
        if self.spec.method == "qlora":
            out.append(quantize_step(self.spec, experts=self.fused_experts))
        if self.spec.method in ("lora", "qlora"):
            out.append(lora_step(self.spec.lora_r))
        if self.spec.autocast_dtype is not None:
            out.append(autocast_step(self.spec.autocast_dtype))
        return tuple(out)

    def checkpointing_of(self, stage: Stage) -> str:
        """Stage `stage`'s activation checkpointing: "off", "on" or "offload"."""
        if self.spec.method == "inference":
            return "off"
        return stage.checkpointing or self.spec.checkpointing

    def tiled_mlp_of(self, stage: Stage) -> int:
        """The slices stage `stage`'s blocks run their MLP in (0: untiled)."""
        if self.spec.method == "inference":
            return 0
        return self.spec.tiled_mlp if stage.tiled_mlp is None else stage.tiled_mlp

    def optim_of(self, stage: Stage) -> str:
        """The optimizer (an `OPTIMS` name) of stage `stage`'s trainable parameters."""
        return stage.optim or self.spec.optim

    @property
    def offload_bytes(self) -> int:
        """Host bytes the activation offload of one replica's pipeline holds at its peak, every rank together."""
        return sum(s.memory.offload * len(s.devices[0]) for s in self.stages)

    @property
    def host_weight_bytes(self) -> int:
        """Host bytes of the weights one replica keeps off its devices (the input embedding table on the host)."""
        return sum(s.memory.host_weights * len(s.devices[0]) for s in self.stages)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(asdict(self), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        data = json.loads(text)
        data["spec"] = TrainingSpec(**{**data["spec"], "lora_targets": _tuple_or_none(data["spec"].get("lora_targets"))})
        data["stages"] = tuple(
            Stage(
                **{
                    **s,
                    "devices": tuple(tuple(group) for group in s["devices"]),
                    "layers": tuple(s["layers"]),
                    "memory": StageMemory(**s["memory"]),
                }
            )
            for s in data["stages"]
        )
        spec = data["spec"]  # a plan written before stages carried their own decisions: the spec's
        data["stages"] = tuple(replace(s, checkpointing=s.checkpointing or spec.checkpointing, optim=s.optim or spec.optim,
                                       tiled_mlp=spec.tiled_mlp if s.tiled_mlp is None else s.tiled_mlp)
                               for s in data["stages"])
        data["notes"] = tuple(data.get("notes", ()))
        data["applied"] = tuple(Step(*step) for step in data.get("applied", ()))
        data["left_out"] = LeftOut.of(data.get("left_out"))
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def stages_of_rank(self, pp_rank: int) -> tuple[Stage, ...]:
        """The stages pipeline rank `pp_rank` runs (several under interleaved schedules)."""
        return tuple(s for s in self.stages if s.pp_rank == pp_rank)

    def device_map(self, layout=None) -> dict[str, str]:
        """An accelerate/transformers `device_map` for single-process use (TP = 1, replica 0).

        Devices are strings accelerate accepts: "0", "1", ... become ints, "cpu" stays.
        `layout` (an `hfsplit.models.DecoderLayout`) names the model's modules; by default those of
        Llama-like models. What runs ahead of the blocks goes with the embeddings, the rest with the head.
        """
        if self.tp != 1:
            raise ValueError("device_map() describes single-process placement; this plan has tp > 1")
        before, layers, after = (("model.embed_tokens",), "model.layers", ("model.norm", "model.rotary_emb", "lm_head"))
        if layout is not None:
            before, layers, after = layout.before, layout.layers, layout.after + layout.outside
        out: dict[str, object] = {}
        ordered = sorted(self.stages, key=lambda s: s.layers[0])
        for stage in ordered:
            device = _accelerate_device(stage.devices[0][0])
            out.update({name: device for name in before} if stage.has_embed else {})
            for layer in range(*stage.layers):
                out[f"{layers}.{layer}"] = device
            out.update({name: device for name in after} if stage.has_head else {})
        return out

    def table(self) -> str:
        """The plan as a text table, one row per device of replica 0: per stage what it holds, how it checkpoints
        (off / on / offload), its optimizer's moments (fp32 / 8-bit) and the host RAM its offload needs."""
        head = (
            f"{self.model} ({self.model_type}, {self.num_layers} layers) — {self.spec.method}, "
            f"seq {self.spec.seq_len} × micro-batch {self.spec.micro_batch_size}, {self.micro_batches} micro-batches, "
            f"{self.spec.dtype}, activation checkpointing {self._uniform(self.checkpointing_of, 'per stage')}"
            f"{', chunked loss' if self.spec.chunked_loss else ''}"
            f"{'' if self.spec.method == 'inference' else ', optimizer ' + self._uniform(self.optim_of, 'per stage')}\n"
            f"split: pp={self.pp} × tp={self.tp} × dp={self.dp}"
            + (f" (virtual stages {self.virtual_stages})" if self.virtual_stages > 1 else "")
            + f", schedule {self.schedule}\n"
            + (f"{self.left_out.line()}\n" if self.left_out else "")
        )
        cols = ("stage", "device", "layers", "weights", "grads", "optim", "activ", "reserve", "total", "budget", "use",
                "ckpt", "moments", "host") + (("mlp",) if self._tiles() else ())
        rows = [row for stage in self.stages for row in self._rows(stage)]
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        tail = (
            f"\nestimated step: {self.step_time_s * 1e3:.1f} ms, bubble {100 * self.bubble_fraction:.1f}%"
        ) + self._rollout_line() + self._reference_line()
        if self.virtual_stages > 1:  # a device's stages share it: their figures together, as the planner fits them
            tail += "\nper device, its stages together: " + ", ".join(
                f"{mine[0].devices[0][0]} {format_bytes(rank_total(s.memory for s in mine))} of "
                f"{format_bytes(mine[0].budget)} ({100 * rank_total(s.memory for s in mine) / mine[0].budget:.0f}%)"
                for mine in (self.stages_of_rank(r) for r in range(self.pp)))
        if any(s.host_embedding for s in self.stages):
            tail += (f"\nhost RAM for the input embedding table: {format_bytes(self.host_weight_bytes)} per replica "
                     f"(looked up on the CPU; the rows go to the device each micro-batch)")
        if self.offload_bytes:
            tail += (f"\nhost RAM for activation offload: {format_bytes(self.offload_bytes)} per replica "
                     f"(column host: per rank)")
        notes = "".join(f"\nnote: {n}" for n in self.notes)
        # loading runs under every plan: the line names what the plan decides
        applied, planned = ([s for s in steps if s.kind != "load"] for steps in (self.applied, self.steps()))
        steps = " → ".join(map(str, applied or planned)) or "nothing (plain stages)"
        runs = f"\n{'applied' if applied else 'applies'} per stage: {steps}"
        return head + "\n".join(lines) + tail + runs + notes

    def _rollout_line(self) -> str:
        """What the objective's generation costs each step (empty where it generates none)."""
        spec = self.spec
        if not spec.counts.generation:
            return ""
        rows = spec.micro_batch_size * self.micro_batches
        return (f"\n{spec.objective.upper()}: rollout of {rows} sequences a replica × up to {spec.rollout_tokens} new "
                f"tokens before each update (KV cache of every sequence on its stages, in activ), "
                f"{self.rollout_s * 1e3:.1f} ms of the step")

    def _reference_line(self) -> str:
        """What the objective's examples and reference cost, as it declares them (empty without a reference)."""
        spec = self.spec
        if not spec.reference_pass:
            return ""
        name, counts = spec.objective.upper(), spec.counts
        if counts.rows_per_example == 1:
            pairs = f"\n{name}: "
        elif not spec.packing:
            pairs = f"\n{name}: {spec.pairs_per_micro_batch} {counts.example}(s) a micro-batch ({counts.parts}), "
        else:
            pairs = f"\n{name}: packed {counts.example}s, {spec.micro_batch_size} full row(s) a micro-batch " \
                f"({counts.parts} isolated in one row), "
        if spec.reference == "precomputed":
            cached = "" if spec.reference_pairs is None else f" for {spec.reference_pairs} {counts.example}s"
            return pairs + (f"reference precomputed: a one-off no-grad pass of {self.reference_s * 1e3:.1f} ms per "
                            f"global batch before training (not in the step); the last stage keeps 8 bytes a "
                            f"pair{cached}")
        how = "each micro-batch" if self.virtual_stages == 1 else "the step's rows at once, stage after stage"
        return pairs + f"reference adapters-off: a no-grad forward of {how}, {self.reference_s * 1e3:.1f} ms of the step"

    def _tiles(self) -> bool:
        return any(self.tiled_mlp_of(s) > 1 for s in self.stages)

    def _uniform(self, of, mixed: str) -> str:
        values = {of(s) for s in self.stages}
        return values.pop() if len(values) == 1 else mixed

    def _rows(self, stage: Stage) -> list[tuple[str, ...]]:
        m = stage.memory
        embed = "+embed" + ("(host)" if stage.host_embedding else "")  # its table in host RAM, looked up on the CPU
        extra = (embed if stage.has_embed else "") + ("+head" if stage.has_head else "")
        layers = f"{stage.layers[0]}-{stage.layers[1] - 1}{extra}" if stage.num_layers else extra or "-"
        training = self.spec.method != "inference"
        moments = ("8-bit" if is_8bit(self.optim_of(stage)) else "fp32") if training else "-"
        decisions = (self.checkpointing_of(stage) if training else "-", moments,
                     format_bytes(m.offload) if m.offload else "-")
        if self._tiles():
            decisions += (f"{self.tiled_mlp_of(stage)} tiles" if self.tiled_mlp_of(stage) > 1 else "whole",)
        return [(str(stage.index), device, layers, format_bytes(m.weights), format_bytes(m.gradients),
                 format_bytes(m.optimizer), format_bytes(m.activations), format_bytes(m.reserve), format_bytes(m.total),
                 format_bytes(stage.budget), f"{100 * m.total / stage.budget:.0f}%") + decisions
                for device in stage.devices[0]]

    def __str__(self) -> str:
        return self.table()


@dataclass(frozen=True)
class Coordinates:
    """Where one global rank sits in the plan's grid."""

    rank: int
    dp: int
    pp: int
    tp: int


def coordinates_of_rank(plan: Plan, *, rank: int) -> Coordinates:
    """The (dp, pp, tp) coordinates of global `rank` under `plan` (row-major over dp, pp, tp)."""
    dp, rest = divmod(rank, plan.pp * plan.tp)
    pp, tp = divmod(rest, plan.tp)
    return Coordinates(rank=rank, dp=dp, pp=pp, tp=tp)


def _tuple_or_none(value):
    return None if value is None else tuple(value)


def _accelerate_device(device: str):
    return int(device) if device.isdigit() else device
