"""Block traces at any TP degree from two real ones, so planning over many devices traces twice, not once per degree.

Under tensor parallelism every tensor a block makes is either whole on each rank (hidden states, norms'
outputs, rotary tables, the mask) or cut by exactly the degree `t` (heads, the MLP width). So the live bytes
at any moment of a trace are `F + S / t`, the same op sequence at every degree. Two traces at degrees 1 and
`t2` (the smallest valid one above 1) give `F` and `S` moment by moment; the peak at any degree is the largest
of `F + S / t` over the moments, and the saved activations, gradients and output are affine likewise.

A derived figure must come out a whole number of bytes with `F, S >= 0`, from traces of equal length; when
it does not (a family whose pieces shrink otherwise) the degree is traced for real. `tests/planning/test_plan_time.py`
checks derived traces against real ones for every declared family.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

from hfsplit.models.families import COLWISE_GATHERED, MLA_KV_A, ROWWISE_WHOLE_INPUT, tp_style_of, valid_tp_degrees
from hfsplit.plan import TrainingSpec
from hfsplit.planning.costs import trace  # its functions looked up when called: tests count the traces
from hfsplit.planning.costs.cache import read_cache, write_cache
from hfsplit.planning.costs.layout import CONFIGS, Layout, Linear

Pair = tuple[int, int]  # (F, S): bytes whole on every rank, bytes cut by the TP degree


@dataclass(frozen=True)
class TpProfile:
    """A block's trace as functions of the TP degree: each sequence keeps only its undominated (F, S) pairs."""

    inference: tuple[Pair, ...]
    forward: tuple[Pair, ...]
    backward: tuple[Pair, ...]
    activations: Pair
    grads: Pair
    out_bytes: Pair

    def at(self, tp: int):
        """The `BlockTrace` at degree `tp`, or None when a figure would not be a whole number of bytes."""
        def value(pair: Pair) -> Optional[int]:
            f, s = pair
            return f + s // tp if s % tp == 0 else None

        seqs = [[value(p) for p in getattr(self, name)] for name in _SEQUENCES]
        scalars = [value(p) for p in (self.activations, self.grads, self.out_bytes)]
        if any(v is None for v in scalars) or any(v is None for seq in seqs for v in seq):
            return None
        return trace.BlockEvents(tuple(seqs[0]), tuple(seqs[1]), tuple(seqs[2]), *scalars).trace()

    def to_record(self) -> dict:
        return {name: [list(p) for p in value] if name in _SEQUENCES else list(value)
                for name, value in vars(self).items()}

    @classmethod
    def from_record(cls, record: dict) -> "TpProfile":
        return cls(**{name: tuple(map(tuple, value)) if name in _SEQUENCES else tuple(value)
                      for name, value in record.items()})


_SEQUENCES = ("inference", "forward", "backward")


def second_degree(config) -> Optional[int]:
    """The smallest valid TP degree above 1 (the second trace of a profile), or None."""
    degrees = valid_tp_degrees(config, 64)
    return degrees[1] if len(degrees) > 1 else None


def fit_profile(one, other, t2: int) -> Optional[TpProfile]:
    """The profile through `one` (a `BlockEvents` at tp=1) and `other` (at tp=`t2`), or None where they do not
    follow `F + S / t` (unequal op sequences, a fraction of a byte, negative parts)."""
    def pair(v1: int, v2: int) -> Optional[Pair]:
        s = Fraction(v1 - v2) * t2 / (t2 - 1)  # v1 = F + S, v2 = F + S / t2
        f = v1 - s
        return (int(f), int(s)) if s.denominator == 1 and f >= 0 and s >= 0 else None

    seqs = []
    for name in _SEQUENCES:
        a, b = getattr(one, name), getattr(other, name)
        pairs = [pair(x, y) for x, y in zip(a, b)] if len(a) == len(b) else [None]
        if None in pairs:
            return None
        seqs.append(_undominated(pairs))
    scalars = [pair(getattr(one, n), getattr(other, n)) for n in ("activations", "grads", "out_bytes")]
    if None in scalars:
        return None
    return TpProfile(*seqs, *scalars)


def _undominated(pairs: list[Pair]) -> tuple[Pair, ...]:
    """The pairs no other pair matches or exceeds in both parts: only they can be the peak at some degree."""
    kept, best_s = [], -1
    for f, s in sorted(set(pairs), key=lambda p: (-p[0], -p[1])):
        if s > best_s:
            kept.append((f, s))
            best_s = s
    return tuple(kept)


def _heads_stay_plural(config, tp: int) -> bool:
    """Whether each rank keeps two or more query and key-value heads. With one, transposes of its size-1 head
    dimension are already contiguous and copy nothing, so the bytes leave the `F + S / t` law (measured: Llama
    with 4 key-value heads at tp=4 keeps 1% less than derived)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return min(heads, kv_heads) // tp >= 2


@functools.lru_cache(maxsize=64)
def block_profile(key: str, spec) -> Optional[TpProfile]:
    """The TP profile of `CONFIGS[key]`'s block under `spec` (two traces), or None if it has no second
    degree or does not follow `F + S / t`."""
    t2 = second_degree(CONFIGS[key])
    if t2 is None:
        return None
    return fit_profile(trace.block_events(key, spec, 1), trace.block_events(key, spec, t2), t2)


def tiling_key(spec) -> str:
    """What a tiled trace tiles, in its cache key: traces from before the block's norms were tiled with its MLP
    (`hfsplit.models.tiled_mlp.block_norms`), or before the norm feeding the MLP ran inside the MLP's slices
    (`mlp_neighbours`), are not read back; untiled keys stay as they were."""
    return "|tiled=mlp,norms,norm-in-mlp" if spec.tiled_mlp > 1 else ""


def block_trace_at(key: str, spec, tp: int):
    """`trace.trace_block(key, spec, tp)`, derived from the block's TP profile (on disk, or two traces) for a
    degree above the profile's second one, else traced."""
    config = CONFIGS[key]
    t2 = second_degree(config) if tp > 1 else None
    if t2 is None or tp <= t2 or not _heads_stay_plural(config, tp):
        return trace.trace_block(key, spec, tp)  # degree 1 and the second degree are the profile's own traces
    name = f"{key}|{sorted(vars(spec).items())}" + tiling_key(spec)
    record = read_cache("tp-profile", name)
    profile = TpProfile.from_record(record) if record else block_profile(key, spec)
    if profile is not None and record is None:
        write_cache("tp-profile", name, profile.to_record())
    derived = profile.at(tp) if profile is not None else None
    return derived if derived is not None else trace.trace_block(key, spec, tp)


def gathered_out(lin: Linear, config) -> bool:
    """Whether the plan gathers `lin`'s column-wise output whole on every rank (`colwise_gather_output`)."""
    return tp_style_of(config, f"layers.0.{lin.name}") == COLWISE_GATHERED


def rank_out_features(lin: Linear, config, tp: int) -> int:
    """The width of `lin`'s output on one TP rank: split where its columns are and its output is not gathered."""
    return lin.out_features // tp if lin.shard == "col" and not gathered_out(lin, config) else lin.out_features


def gather_bytes(layout: Layout, config, *, feature_bytes: int, forwards: int, backwards: int) -> int:
    """All-reduce-equivalent bytes of one block's TP all-gathers (`feature_bytes`: one feature over a micro-batch's
    tokens): each gathered column-wise output in each forward, each whole-input row-wise linear's input gradient in
    each backward (its pieces joined). An all-gather moves half the bytes an all-reduce of the same tensor moves."""
    whole_in = (lin.in_features for lin in layout.linears
                if tp_style_of(config, f"layers.0.{lin.name}") == ROWWISE_WHOLE_INPUT)
    gathered = sum(lin.out_features for lin in layout.linears if gathered_out(lin, config))
    return (gathered * forwards + sum(whole_in) * backwards) * feature_bytes // 2


def rope_grad_features(layout: Layout, config) -> int:
    """The features whose gradient one block's backward all-reduces beyond the hidden state: MLA's shared key rope
    part of each whole `mla_kv_a_proj` output (apply/tp.py `RopeGradSummed`), 0 in other models."""
    return sum(config.qk_rope_head_dim for lin in layout.linears
               if tp_style_of(config, f"layers.0.{lin.name}") == MLA_KV_A)


def block_comm_bytes(layout: Layout, config, spec: TrainingSpec, tp: int, *, hidden_bytes: int,
                     feature_bytes: int) -> int:
    """All-reduce-equivalent bytes one block's TP collectives move per micro-batch: two all-reduces of the hidden
    state (after attention and after the MLP) each way, recompute repeating the forward ones; where the plan
    gathers outputs whole, their all-gathers (`gather_bytes`); MLA's key rope gradient (`rope_grad_features`)."""
    if tp == 1:
        return 0
    training, ckpt = spec.method != "inference", spec.checkpointing != "off"
    forwards = 1 + (training and ckpt)
    return ((2 * forwards + 2 * training) * hidden_bytes
            + training * rope_grad_features(layout, config) * feature_bytes
            + gather_bytes(layout, config, feature_bytes=feature_bytes, forwards=forwards, backwards=int(training)))


def gather_transient_bytes(layout: Layout, config, tp: int, feature_bytes: int) -> int:
    """What the widest gathered output's all-gather holds at once beyond the whole output a single-process trace
    counts: this rank's piece and the gathered buffer (DTensor gathers along the first dim, then joins the pieces
    along the last into the output). Measured: Phi-3 tp=2 held 1.5 × its gate_up output above the plan without it."""
    widest = max((lin.out_features for lin in layout.linears if gathered_out(lin, config)), default=0)
    return 0 if tp == 1 else widest * feature_bytes * (tp + 1) // tp
