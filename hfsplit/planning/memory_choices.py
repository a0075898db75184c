"""What a stage may trade time for memory with, in the order the planner tries them.

Each pipeline rank of a plan runs one `Choice`: activation checkpointing off, on, or offloaded to host memory,
its optimizer's moments in fp32 or bitsandbytes' 8 bits, and its blocks' MLP whole or tiled over the sequence
(`hfsplit.models.tiled_mlp`: one more MLP forward a micro-batch, so tried after every untiled choice). The planner (`search.split_layers`) gives each rank
the first choice of `ladder` under which its layers fit, so a rank pays for recompute, host copies or quantized
moments only when it needs them, and another rank of the same plan need not. The ladder is ordered by the
time model: 8-bit moments cost no modelled time (bitsandbytes' fused step), recompute costs a forward, offload
a forward plus its host copies (hidden behind compute on a GPU, `links.Link.host_copy_s`).

Offload also costs host RAM: with a `"cpu"` entry beside the devices of `max_memory`, each rank may hold its share
of it (`host_share`), since the ranks of one machine share its memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Union

from hfsplit.errors import PlanError
from hfsplit.models.expert_lora import expert_parameters
from hfsplit.plan import CHECKPOINTING, OPTIMS, TrainingSpec, checkpointing_mode

AUTO = "auto"
MIN_SLICE = 1024  # tokens: the shortest slice a tiled MLP runs


@dataclass(frozen=True)
class Choice:
    """One rank's memory decisions: `checkpointing` ("off" / "on" / "offload"), `optim` (an `OPTIMS` name),
    `tiled_mlp` (the slices its blocks' MLP runs in; 0: whole) and `host_embedding` (the input embedding table in
    host RAM: only the first stage holds one)."""

    checkpointing: str
    optim: str
    tiled_mlp: int = 0
    host_embedding: bool = False

    def spec(self, spec: TrainingSpec) -> TrainingSpec:
        """`spec` as a rank running this choice runs it (the cost model's key)."""
        return replace(spec, activation_checkpointing=self.checkpointing, optim=self.optim, tiled_mlp=self.tiled_mlp,
                       host_embedding=self.host_embedding)


def ladder(spec: TrainingSpec, *, activation_checkpointing: Union[bool, str] = AUTO, optim: str = AUTO,
           single_process: bool = False, tiled_mlp: Union[bool, str] = AUTO, tiles: int = 0,
           host_embedding: Union[bool, str] = AUTO, embedding_frozen: bool = False) -> list[Choice]:
    """The choices a rank may run, fastest first: what the user fixed stays fixed, "auto" opens the rest.

    Args:
        spec: what a step does (inference has nothing to checkpoint or optimize).
        activation_checkpointing: "auto", or a fixed setting (False / True / "off" / "on" / "offload").
        optim: "auto" (fp32 moments, 8-bit only where they must fit) or an `OPTIMS` name.
        single_process: the model's own forward in one process, which hfsplit does not offload nor tile.
        tiled_mlp: "auto" (whole, tiled only on the ranks that fit no other way), "on" / True (every rank tiles) or
            "off" / False.
        tiles: the slices a tiled MLP runs in (`mlp_tiles`; 0: the model has no MLP to tile).
        host_embedding: "auto" (each choice, then the same with the input embedding table in host RAM: the lookup
            on the CPU and one host copy of its rows a micro-batch, far less than any other choice costs), "on" / True
            (every choice so) or "off" / False.
        embedding_frozen: the embedding table is frozen and not shared with lm_head (`host_embedding_offered`).
    """
    if spec.method == "inference":
        return [Choice("off", spec.optim)]
    modes = [m for m in CHECKPOINTING if not (single_process and m == "offload")] \
        if activation_checkpointing == AUTO else [checkpointing_mode(activation_checkpointing)]
    if single_process and "offload" in modes:
        raise PlanError("activation checkpointing offload runs on split stages (a launched run); the single-process "
                        "model checkpoints on its device: use activation_checkpointing=True")
    # the single-process model trains with the user's own optimizer: the plan counts the spec's
    optims = ([spec.optim] if single_process else ["adamw_torch", "adamw_8bit"]) if optim == AUTO else [check_optim(optim)]
    tiling = _tiling(tiled_mlp, tiles=tiles, single_process=single_process)
    whole = [Choice(m, o) for m in modes for o in optims] if tiling != "on" else []
    tiled = [Choice(m, o, tiles) for m in modes for o in optims if m != "off" or tiling == "on"] if tiling != "off" else []
    hosts = {AUTO: (False, True), "on": (True,), "off": (False,)}[_embedding_setting(host_embedding, embedding_frozen)]
    return [replace(c, host_embedding=h) for c in whole + tiled for h in hosts]


def _embedding_setting(host_embedding, frozen: bool) -> str:
    """"auto", "on" or "off" for a `host_embedding` setting; "off" where the table is not frozen, "on" refused
    there."""
    mode = {True: "on", False: "off"}.get(host_embedding, str(host_embedding).lower())
    if mode not in (AUTO, "on", "off"):
        raise PlanError(f"host embedding {host_embedding!r}: use auto, on or off")
    if mode == "on" and not frozen:
        raise PlanError("--host-embedding on keeps a frozen, untied input embedding in host RAM: it needs LoRA or "
                        "QLoRA on split stages, an embedding that is no LoRA target and not tied to lm_head; use auto or off")
    return mode if frozen else "off"


def host_embedding_offered(config, spec: TrainingSpec, *, single_process: bool) -> bool:
    """Whether the input embedding table may stay in host RAM: it is frozen (LoRA or QLoRA, not a LoRA target), lm_head
    does not share it (tied: the last stage's head trains through it on the device) and the stages are split (the
    single-process model runs its own forward)."""
    tied = bool(getattr(config, "tie_word_embeddings", False))
    targeted = any("embed" in t for t in spec.lora_targets or ())
    return spec.method in ("lora", "qlora") and not tied and not targeted and not single_process


def _tiling(tiled_mlp, *, tiles: int, single_process: bool) -> str:
    """"auto", "on" or "off" for a `tiled_mlp` setting, refused where there is nothing to tile."""
    mode = {True: "on", False: "off"}.get(tiled_mlp, str(tiled_mlp).lower())
    if mode not in (AUTO, "on", "off"):
        raise PlanError(f"tiled MLP {tiled_mlp!r}: use auto, on or off")
    if mode == "on" and (tiles <= 1 or single_process):
        raise PlanError("a tiled MLP runs on split stages of a model whose blocks have a dense MLP; use "
                        "--tiled-mlp auto or off" + (" (the single-process model runs its own forward)"
                                                     if single_process else ""))
    return "off" if tiles <= 1 or single_process else mode


def mlp_tiles(config, spec: TrainingSpec) -> int:
    """The slices a tiled MLP of `config` runs a micro-batch in: enough that one slice's four intermediate-wide
    tensors (gate, up, the activation, their product) hold no more than one hidden state of the whole micro-batch,
    but no slice under `MIN_SLICE` tokens (each slice runs the MLP's weights again: QLoRA dequantizes them a slice);
    0 where the blocks have no dense MLP (MoE experts are routed, not tiled)."""
    width, hidden = getattr(config, "intermediate_size", None), getattr(config, "hidden_size", None)
    if not width or not hidden or expert_parameters(config) or getattr(config, "num_experts", 0) or \
            getattr(config, "num_local_experts", 0):
        return 0
    width = max(width) if isinstance(width, (list, tuple)) else width  # Gemma 3n: a width per layer
    tokens = spec.seq_len * spec.micro_batch_size
    return max(2, min(math.ceil(4 * width / hidden), math.ceil(tokens / MIN_SLICE)))


def check_optim(optim: str) -> str:
    if optim not in OPTIMS:
        raise PlanError(f"optimizer {optim!r} is unknown; choose auto or one of {', '.join(OPTIMS)} "
                        "(transformers' names)")
    return optim


def frugal_choices(choices: list[Choice]) -> list[Choice]:
    """The choices a no-fit diagnosis's closest split is planned with: the ladder's last optimizer (the fewest bytes of
    moments) with every checkpointing setting, tiling and place of the embedding table it has (neither offload nor a tiled MLP is always the least:
    at one stage offload's pinned copies, at a short sequence the slices' concatenated outputs, can outweigh what they
    free)."""
    return [c for c in choices if c.optim == choices[-1].optim]


def plan_spec(spec: TrainingSpec, used: list[Choice]) -> TrainingSpec:
    """A plan's spec: the most frugal checkpointing any rank runs, and 8-bit moments when any rank keeps them
    (each stage's own are in `Stage.checkpointing` / `Stage.optim`)."""
    mode = max((c.checkpointing for c in used), key=CHECKPOINTING.index)
    optim = next((c.optim for c in used if c.optim != "adamw_torch"), "adamw_torch")
    return Choice(mode, optim, max(c.tiled_mlp for c in used)).spec(spec)


def host_budget(budgets: dict[str, int], *, single_process: bool) -> tuple[dict[str, int], Optional[int]]:
    """(the device budgets, the host RAM for offload): a "cpu" entry beside other devices is the machine's host
    memory in a split run (its ranks' offloaded activations), not a device; None where none is given."""
    if single_process or "cpu" not in budgets or len(budgets) == 1:
        return budgets, None
    return {k: v for k, v in budgets.items() if k != "cpu"}, budgets["cpu"]


def host_share(host: Optional[int], ranks: int) -> Optional[int]:
    """Host bytes one of `ranks` local ranks may hold (None: no limit given)."""
    return None if host is None else host // max(ranks, 1)
