"""What hfsplit knows about model families: which it splits and how they shard (how a model is laid out is
`hfsplit.models.layout`).

models/ holds this knowledge so that the planner, the cost model and the runtime
(apply/, parallel/, training/) agree on it; the cost model and the runtime import it, never each other.

Two levels of support:
- single process (`hfsplit.from_pretrained` without a distributed launch): any decoder-only
  causal LM transformers builds. Whole modules are placed and the model's own forward runs,
  so nothing a family does outside its blocks can be skipped.
- the distributed split (pipeline stages, tensor parallel): a declared family (`FAMILIES`) runs a stage built from
  its blocks, redoing the work its forward does outside them as declared; any other causal LM runs its own forward on
  each stage (`hfsplit.parallel.followed_stage`), proven over pipeline stages on the user's config before a run
  (`hfsplit.load.proof`), and under tensor parallelism only where the tp=2 sweep proved its type on the installed
  transformers (`TP_PROVEN`, `hfsplit.load.tp_proof`).
"""
from __future__ import annotations

import fnmatch
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from hfsplit.errors import UnsupportedModelError


@dataclass(frozen=True)
class Family:
    """The work a family's model forward does outside its decoder blocks, which a pipeline stage built
    from the blocks must redo: the first stage the input side, the last stage the output side.

    Each field names the config attribute holding the factor (the work is skipped where it is None).
    What lives inside modules needs no declaration: Gemma's embedding scale is its embedding module's
    (`embed_scale`, restored with the other non-persistent buffers), attention soft-capping and Granite's
    residual and attention multipliers are the blocks'.

    Args:
        embed_multiplier: the embeddings are multiplied by it (Granite `embedding_multiplier`).
        logit_multiplier: the logits are multiplied by it (Cohere `logit_scale`).
        logit_divisor: the logits are divided by it (Granite `logits_scaling`).
        final_softcap: logits become cap · tanh(logits / cap) (Gemma 2 `final_logit_softcapping`).
        rope_per_layer_type: the rotary embedding takes the layer type and gives each its own table
            (Gemma 3: a local rope for sliding layers, a global one for full-attention layers).
        refused_flags: config flags that change the model's forward in ways no test covers; a config
            setting one is refused by name (Gemma 3's `use_bidirectional_attention`, for embedding models).
        tp_refused_flags: config flags under which the model's own TP plan is wrong, so tp > 1 is refused
            (pipeline stages still split it): Cohere's `use_qk_norm` adds q/k norms holding a weight per head,
            which the plan leaves whole while the heads are sharded.
        router_aux_loss: an MoE whose training loss adds `router_aux_loss_coef` × transformers'
            load-balancing loss over every layer's router logits when `output_router_logits` is set; the
            stages carry its running sums and the last stage adds it (parallel/router.py).
        mask_ignores_positions: the model's own forward builds its masks without the position ids, so a packed
            row called as a transformers model attends across its examples (gpt-oss in transformers 5); the
            single-process model is then handed transformers' packed masks (load/materialize.py).
    """

    embed_multiplier: Optional[str] = None
    logit_multiplier: Optional[str] = None
    logit_divisor: Optional[str] = None
    final_softcap: Optional[str] = None
    rope_per_layer_type: bool = False
    refused_flags: tuple[str, ...] = ()
    tp_refused_flags: tuple[str, ...] = ()
    router_aux_loss: bool = False
    mask_ignores_positions: bool = False

    def position_embeddings(self, rotary_emb: nn.Module, hidden: torch.Tensor, positions: torch.Tensor,
                            kinds) -> dict:
        """The rotary (cos, sin) each layer type of `kinds` receives, as the model's forward computes them."""
        if self.rope_per_layer_type:
            return {kind: rotary_emb(hidden, positions, kind) for kind in kinds}
        shared = rotary_emb(hidden, position_ids=positions)
        return {kind: shared for kind in kinds}

    def input_side(self, config, hidden: torch.Tensor) -> torch.Tensor:
        """The embeddings as the model's forward hands them to its first block."""
        factor = _field(config, self.embed_multiplier)
        return hidden if factor is None else hidden * factor

    def output_side(self, config, logits: torch.Tensor) -> torch.Tensor:
        """The logits as the model's forward returns them, from lm_head's output (in the model's order)."""
        if (cap := _field(config, self.final_softcap)) is not None:
            # one step at a time, as the model does: each rebinding frees the previous logits-sized tensor
            logits = logits / cap
            logits = torch.tanh(logits)
            logits = logits * cap
        if (factor := _field(config, self.logit_multiplier)) is not None:
            logits = logits * factor
        if (divisor := _field(config, self.logit_divisor)) is not None:
            logits = logits / divisor
        return logits


def _field(config, name: Optional[str]):
    return getattr(config, name, None) if name else None


# Families whose distributed split is tested against transformers (logits, gradients, generation), and the
# work each does outside its blocks. Adding one: its line here plus its equality test in tests/models/test_families.py.
FAMILIES = {
    "llama": Family(), "qwen2": Family(), "mistral": Family(), "qwen3": Family(), "phi3": Family(), "olmo2": Family(),
    "gemma": Family(),  # embedding scale inside GemmaTextScaledWordEmbedding
    "gemma2": Family(final_softcap="final_logit_softcapping"),
    "granite": Family(embed_multiplier="embedding_multiplier", logit_divisor="logits_scaling"),
    "cohere": Family(logit_multiplier="logit_scale", tp_refused_flags=("use_qk_norm",)),
    "gemma3_text": Family(final_softcap="final_logit_softcapping", rope_per_layer_type=True,
                          refused_flags=("use_bidirectional_attention",)),
    "cohere2": Family(logit_multiplier="logit_scale"),  # sliding layers come from layer_types, as Gemma 2's
    # experts fused in the module, merged on read (checkpoint/merged.py), every expert on every TP rank, each
    # expert's intermediate dim sharded over TP (apply/tp_experts.py)
    "mixtral": Family(router_aux_loss=True), "qwen3_moe": Family(router_aux_loss=True),
    # attention sinks, sliding/full layers, clamped SwiGLU, biased router and experts, YaRN rope: all inside its
    # modules; its MXFP4 experts are dequantized as read (checkpoint/mxfp4.py); its TP plan shards only the
    # embeddings (embedding_rowwise), so it splits over pipeline stages at tp=1
    "gpt_oss": Family(router_aux_loss=True, mask_ignores_positions=True),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
# Families asked for whose split is not built yet, and what is missing (docs/guides/families.md says more).
NOT_YET: dict[str, str] = {}


def family_of(config) -> Family:
    """The declared family of `config` (UnsupportedModelError naming it when nobody declared it)."""
    check_causal_lm(config)
    if config.model_type not in FAMILIES:
        raise UnsupportedModelError(_unsupported(config, "its family is not declared (its split follows the model's "
                                                         "own forward instead)"))
    family = FAMILIES[config.model_type]
    for flag in family.refused_flags:
        if getattr(config, flag, False):
            raise UnsupportedModelError(_unsupported(config, f"its split with {flag}=True is not verified "
                                                             "against transformers"))
    return family


# `base_model_tp_plan` styles hfsplit shards; a model whose plan has others runs with tp=1. Besides plain
# column- and row-wise linears: a column-wise one whose output is gathered whole on every rank (what follows it needs
# the full width: OLMo 2's q/k norms over all heads, Phi-3's fused [q; k; v] split after it), a row-wise one whose
# input arrives whole and is sliced on each rank (the linear after a gathered one), and the vocabulary-sharded input
# embedding the plan names. The REPLICATED_SUMMED kind stays whole on every rank, its gradient summed over the TP
# group. The MoE kinds: a fused experts module (`moe_tp_experts`) whose `gate_up_proj` is packed column-wise and
# `down_proj` row-wise (apply/tp_experts.py), or, stored transposed (Llama 4's `[experts, in, out]`), `gate_up_proj`
# packed row-wise and `down_proj` column-wise; "packed_colwise" and "packed_rowwise" are accepted only there. MLA's
# `kv_a_proj_with_mqa` (DeepSeek-V3.2, GLM-4-MoE-Lite) stays whole on every rank, its output's rope part (which goes to
# this rank's heads only, bypassing the column-wise kv_b_proj) getting its gradient summed over the TP group.
COLWISE_GATHERED = "colwise_gather_output"
ROWWISE_WHOLE_INPUT = "rowwise_split_input"
EMBEDDING_ROWWISE = "embedding_rowwise"
REPLICATED_SUMMED = "replicated_with_grad_allreduce"
MOE_EXPERTS = "moe_tp_experts"
PACKED_COLWISE = "packed_colwise"
PACKED_ROWWISE = "packed_rowwise"
MLA_KV_A = "mla_kv_a_proj"
# hfsplit's own (TP_PLAN_AMENDS only): a row-wise linear whose output is a tensor of its own, not the view of the summed
# DTensor torch's RowwiseParallel returns, for a model that adds into that output in place (Llama 4's shared expert).
ROWWISE_OWN_OUTPUT = "rowwise_own_output"
TP_STYLES = ("colwise", "rowwise", COLWISE_GATHERED, ROWWISE_WHOLE_INPUT, EMBEDDING_ROWWISE, REPLICATED_SUMMED,
             MOE_EXPERTS, PACKED_COLWISE, PACKED_ROWWISE, MLA_KV_A, ROWWISE_OWN_OUTPUT)
# The pipeline plan a stage builder follows: embeddings → blocks → final norm.
PP_PLAN = ["embed_tokens", "layers", "norm"]


# --- which models -------------------------------------------------------------------------------


def check_causal_lm(config) -> None:
    """Raise UnsupportedModelError unless `config` is a decoder-only model (what single-process loading
    needs: transformers' own forward does the rest)."""
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(_unsupported(config, "encoder-decoder models are not split"))


def check_supported(config) -> None:
    """Raise UnsupportedModelError unless the config is a decoder-only LM hfsplit may split across processes: a
    declared family (`FAMILIES`, its refused flags unset), or any other causal LM, whose split runs the model's own
    forward (`hfsplit.parallel.followed_stage`) and is proven equal on the user's config before a run
    (`hfsplit.load.proof`)."""
    check_causal_lm(config)
    if config.model_type in NOT_YET:
        raise UnsupportedModelError(_unsupported(config, f"its split is not built yet ({NOT_YET[config.model_type]})"))
    if config.model_type in FAMILIES:
        family_of(config)


def _unsupported(config, why: str) -> str:
    name = getattr(config, "_name_or_path", "") or ""
    classes = ", ".join(getattr(config, "architectures", None) or [])
    where = f"{name + ': ' if name else ''}model_type {config.model_type!r}{f' ({classes})' if classes else ''}"
    return (f"{where}: {why}; "
            f"hfsplit splits {', '.join(SUPPORTED_MODEL_TYPES)}; pick such a model, load this one in a single "
            "process (hfsplit.from_pretrained without a distributed launch), or with transformers itself")


def check_pp_plan(base: nn.Module) -> None:
    """Raise UnsupportedModelError unless the model declares the embed → layers → norm pipeline plan."""
    pp_plan = getattr(base.config, "base_model_pp_plan", None) or getattr(base, "_pp_plan", None)
    if not pp_plan or list(pp_plan) != PP_PLAN:
        raise UnsupportedModelError(
            f"{type(base).__name__}: hfsplit splits models whose base_model_pp_plan is embed_tokens → layers → norm "
            f"(found {list(pp_plan) if pp_plan else None}); use the single-process path for this model"
        )


# --- tensor parallelism -------------------------------------------------------------------------


def tp_plan_of(config) -> dict[str, str]:
    """The model's `base_model_tp_plan` ({module pattern: style}) with hfsplit's amendments (`TP_PLAN_AMENDS`), empty
    when it has none."""
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    return {**plan, **TP_PLAN_AMENDS.get(getattr(config, "model_type", None), {})} if plan else plan


# Where transformers' TP plans are wrong, found by the tp=2 sweep (`hfsplit.load.tp_proof`). Replicated modules the
# plans leave out whose gradient is partial on each rank (each rank's is its share of the sum): Apertus's xIELU
# activation holds two scalars applied across the sharded MLP width, Sarvam-MoE's q/k norms a weight per head over
# this rank's heads, GLM-4.5's (`use_qk_norm`, off in glm4_moe's default config, so the proof on the user's config
# found it, not the sweep) one weight over each rank's heads. Gemma 3n's activation sparsity takes the mean and deviation of the gate's output over the whole
# MLP width, so its MLP runs whole on every rank (the gate and up outputs gathered, the down projection's input sliced).
# Llama 4's MoE adds the routed experts' sum into its shared expert's output in place (`out.add_`), which autograd
# refuses on the view torch's row-wise style returns.
_XIELU_SUMMED = {"layers.*.mlp.act_fn": REPLICATED_SUMMED}
TP_PLAN_AMENDS: dict[str, dict[str, str]] = {
    "apertus": _XIELU_SUMMED, "apertus1p5_text": _XIELU_SUMMED,
    "sarvam_moe": {"layers.*.self_attn.q_norm": REPLICATED_SUMMED, "layers.*.self_attn.k_norm": REPLICATED_SUMMED},
    "glm4_moe": {"layers.*.self_attn.q_norm": REPLICATED_SUMMED, "layers.*.self_attn.k_norm": REPLICATED_SUMMED},
    "gemma3n_text": {"layers.*.mlp.gate_proj": COLWISE_GATHERED, "layers.*.mlp.up_proj": COLWISE_GATHERED,
                     "layers.*.mlp.down_proj": ROWWISE_WHOLE_INPUT},
    "llama4_text": {"layers.*.feed_forward.shared_expert.down_proj": ROWWISE_OWN_OUTPUT},
}


def tp_supported(config) -> bool:
    """Whether hfsplit can shard `config`'s model: a declared family, or a followed one whose tensor-parallel split
    the tp=2 sweep proved on the installed transformers (`tp_unproven`); and a plan hfsplit shards
    (`tp_plan_shardable`)."""
    if getattr(config, "model_type", None) not in FAMILIES and tp_unproven(config.model_type) is not None:
        return False
    return tp_plan_shardable(config)


def tp_plan_shardable(config) -> bool:
    """Whether `config` has a TP plan made only of the styles hfsplit implements (packed column-wise parameters only
    inside fused experts), and no flag its family declares the plan wrong under (`Family.tp_refused_flags`)."""
    styles = set(tp_plan_of(config).values())
    return (bool(styles) and styles <= set(TP_STYLES) and tp_refused_flag(config) is None
            and unplaced_packed(config) is None)


# The tp=2 sweep's findings, by transformers version (written by `python scripts/families_table.py`,
# `hfsplit.load.tp_proof`): the followed types whose tensor-parallel split equals transformers, and why the others
# are not proven. A followed split runs the model's own forward, so a new transformers may change what its modules
# do under sharding: each version is proven on its own.
TP_PROVEN = Path(__file__).resolve().parent / "tp_proven.json"


@functools.lru_cache(maxsize=None)
def tp_findings(version: str) -> dict:
    """{"proven": [model types], "refused": {model type: reason}} of the tp=2 sweep on transformers `version` (both
    empty when the sweep never ran on it)."""
    data = json.loads(TP_PROVEN.read_text()) if TP_PROVEN.exists() else {}
    return data.get(version, {"proven": [], "refused": {}})


def tp_unproven(model_type: str) -> Optional[str]:
    """Why the tp=2 sweep did not prove `model_type`'s tensor-parallel split on the installed transformers, in a
    few words (None when it did)."""
    import transformers

    version = transformers.__version__
    found = tp_findings(version)
    if model_type in found["proven"]:
        return None
    reason = found["refused"].get(model_type)
    return f"not proven at tp=2 on transformers {version}" + (f": {reason}" if reason else "")


def expert_tp_params(config) -> dict[str, dict[str, str]]:
    """{fused experts module pattern ("layers.*.mlp.experts"): {its parameter: its style ("packed_colwise", ...)}}
    from the TP plan's `moe_tp_experts` entries and the parameter entries below them."""
    plan = tp_plan_of(config)
    return {module: {key[len(module) + 1:]: style for key, style in plan.items() if key.startswith(module + ".")}
            for module, style in plan.items() if style == MOE_EXPERTS}


def unplaced_packed(config) -> Optional[str]:
    """A packed pattern outside every fused experts module (hfsplit packs only experts), or None."""
    inside = {f"{module}.{name}" for module, params in expert_tp_params(config).items() for name in params}
    packed = (PACKED_COLWISE, PACKED_ROWWISE)
    return next((k for k, s in tp_plan_of(config).items() if s in packed and k not in inside), None)


def tp_whole_parts(config) -> frozenset[str]:
    """Which of "attention" and "mlp" run at full width on every TP rank: those whose column-wise projections'
    outputs the plan gathers (`colwise_gather_output`: OLMo 2's attention, all of Phi-3's block). Their matmuls are
    still split, but what follows the gather (every head's attention, the MLP's activation) is whole on each rank. A
    gathered block pattern naming neither counts as both (the cost model then counts the whole width, never less)."""
    whole = set()
    for pattern, style in tp_plan_of(config).items():
        if style != COLWISE_GATHERED or not pattern.startswith("layers."):
            continue
        if "attn" in pattern or "attention" in pattern:
            whole.add("attention")
        elif "mlp" in pattern or "feed_forward" in pattern:
            whole.add("mlp")
        else:
            whole |= {"attention", "mlp"}
    return frozenset(whole)


def tp_refused_flag(config) -> Optional[str]:
    """The config flag set on `config` under which its family's TP plan is wrong (None when there is none)."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    return next((f for f in (family.tp_refused_flags if family else ()) if getattr(config, f, False)), None)


def tp_style_of(config, module_path: str) -> Optional[str]:
    """The TP style the plan gives `module_path` ("layers.0.self_attn.q_proj"), None when unsharded."""
    for pattern, style in tp_plan_of(config).items():
        if fnmatch.fnmatchcase(module_path, pattern):
            return style
    return None


def valid_tp_degrees(config, max_degree: int) -> list[int]:
    """TP degrees ≤ max_degree dividing attention heads, key-value heads and MLP width (only 1 for a
    model hfsplit cannot shard)."""
    if not tp_supported(config):
        return [1]
    return [t for t in range(1, max_degree + 1) if tp_divides(config, t)]


def tp_divides(config, tp: int) -> bool:
    """Whether `tp` divides the model's attention heads, key-value heads and MLP widths."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return all(w % tp == 0 for w in (heads, kv_heads, *mlp_widths(config)))


def mlp_widths(config) -> tuple[int, ...]:
    """The MLP widths TP splits: the dense MLP's, and each expert's where it differs (Qwen3-MoE)."""
    moe = getattr(config, "moe_intermediate_size", None)
    dense = getattr(config, "intermediate_size", None)
    dense = dense if isinstance(dense, int) else None  # Qwen3.5-MoE has none; Gemma 3n one per layer
    return tuple(w for w in (dense, moe if moe != dense else None) if w)


def tp_degree_error(config, tp: int) -> Optional[str]:
    """Why tensor-parallel degree `tp` cannot shard `config`'s model (None when it can)."""
    if tp > 1 and (flag := tp_refused_flag(config)):
        return (f"tp={tp}: {config.model_type} with {flag}=True has modules holding a weight per attention head "
                f"that its tensor-parallel plan leaves whole while the heads are sharded; use tp=1 (pipeline "
                "stages split it)")
    if tp > 1 and getattr(config, "model_type", None) not in FAMILIES and (why := tp_unproven(config.model_type)):
        return (f"tp={tp}: {config.model_type}'s split follows the model's own forward, and its tensor-parallel split "
                f"is {why}; use tp=1 (pipeline stages split it)")
    if tp > 1 and not tp_supported(config):
        styles = sorted(set(tp_plan_of(config).values()) - set(TP_STYLES))
        packed = unplaced_packed(config)
        what = ", ".join(styles) or (f"{tp_plan_of(config)[packed]} on {packed} outside fused experts" if packed else "no styles")
        return (f"tp={tp}: {config.model_type}'s tensor-parallel plan uses {what}, "
                f"which hfsplit does not shard yet (it shards {', '.join(TP_STYLES)}); use tp=1")
    valid = valid_tp_degrees(config, max(tp, 1))
    if tp not in valid:
        return (f"tp={tp} does not divide the model's attention heads ({config.num_attention_heads}), key-value heads "
                f"({getattr(config, 'num_key_value_heads', None) or config.num_attention_heads}) and MLP width "
                f"({', '.join(map(str, mlp_widths(config)))}); valid degrees: {', '.join(map(str, valid))}")
    return None
