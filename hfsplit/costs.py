"""Cost model: bytes and FLOPs of one decoder block, the embeddings and the head.

Sizes come from the real transformers model class built on the meta device, never
from hand formulas. Activation bytes are measured by tracing one block at the real
dimensions under FakeTensorMode (no allocation), so they follow whatever the
attention implementation and MLP really keep for backward.

INTERFACE (implementation in progress): the planner relies on exactly these names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

Method = Literal["inference", "lora", "full"]

DEFAULT_RESERVE_BYTES = 1 << 30  # CUDA context + allocator fragmentation + comm buffers


@dataclass(frozen=True)
class TrainingSpec:
    """What a step does; the planner's costs depend on it.

    Args:
        method: "inference" (forward only), "lora" (frozen base + adapters) or "full" (AdamW on all).
        seq_len: tokens per sequence.
        micro_batch_size: sequences per micro-batch.
        dtype: dtype of the weights and activations ("bfloat16", "float16", "float32").
        lora_r: LoRA rank.
        lora_targets: module names LoRA wraps; None means every attention and MLP projection.
        activation_checkpointing: recompute each block's activations in backward.
        reserve_bytes: fixed per-device reserve (context, fragmentation, comm buffers).
    """

    method: Method = "lora"
    seq_len: int = 2048
    micro_batch_size: int = 1
    dtype: str = "bfloat16"
    lora_r: int = 16
    lora_targets: Optional[tuple[str, ...]] = None
    activation_checkpointing: bool = False
    reserve_bytes: int = DEFAULT_RESERVE_BYTES


@dataclass(frozen=True)
class PartCost:
    """Costs of one part (the embeddings, one decoder block, or norm + head) on one rank.

    All byte figures are for one tensor-parallel rank (already divided by the TP degree
    where the part is sharded).

    Args:
        param_bytes: weights (frozen + trainable) in the model dtype.
        grad_bytes: gradients of the trainable parameters.
        optimizer_bytes: AdamW moments (fp32) plus fp32 master weights under mixed precision.
        activation_bytes: bytes kept for backward per micro-batch (0 for inference).
        workspace_bytes: transient peak while the part runs once (not multiplied by in-flight micro-batches).
        flops: forward + backward (+ recompute) FLOPs per micro-batch.
        comm_bytes: bytes all-reduced across the TP group per micro-batch (forward + backward).
    """

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    workspace_bytes: int
    flops: float
    comm_bytes: int = 0

    @property
    def state_bytes(self) -> int:
        """Bytes held for the whole step whatever the schedule: weights, grads, optimizer."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class ModelCosts:
    """Per-part costs of a model for one training spec and TP degree.

    Args:
        num_layers: decoder blocks.
        tp: tensor-parallel degree these figures are for.
        embed: input embeddings (first stage).
        block: one decoder block (all blocks are alike).
        head: final norm + lm_head (+ loss) on the last stage. With tied embeddings the
            head's param_bytes include the shared matrix again, since the last stage holds a copy.
        tied: whether lm_head shares the embedding matrix.
    """

    num_layers: int
    tp: int
    embed: PartCost
    block: PartCost
    head: PartCost
    tied: bool
    spec: TrainingSpec = field(default_factory=TrainingSpec)


def valid_tp_degrees(config, max_degree: int) -> list[int]:
    """TP degrees ≤ max_degree dividing attention heads, key-value heads and MLP width."""
    raise NotImplementedError


def model_costs(config, spec: TrainingSpec, tp: int = 1) -> ModelCosts:
    """Costs of `config`'s model under `spec` with tensor-parallel degree `tp`."""
    raise NotImplementedError


def estimate_peak_bytes(costs: ModelCosts) -> int:
    """Estimated peak of one training step of the whole model in one process (no pipeline), without reserve."""
    raise NotImplementedError
