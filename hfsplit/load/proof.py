"""The proof that hfsplit's split computes what transformers computes, for the user's own config, before a weight is
read.

The config is shrunk (`hfsplit.models.shrink`: same class, flags and layer kinds, tiny sizes), built with random
weights on the CPU, and run twice: whole, as transformers' model, and split into two pipeline stages built as a run
builds them, chained in one process. Their logits and every parameter's gradient must agree within 1e-5 (fp32). A
packed row (examples restarting their position ids) is run too: each example's logits must equal the example run
alone, or packing is turned off for the model, with the reason. The verdict is cached by the config's hash (a
second call costs a file read), and a failure names the first block whose output differs.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch
from torch import nn

from hfsplit.apply.load import checkpoint_buffers, materialize_buffers, set_parameter
from hfsplit.apply.tp import apply_tp, full_tensor, shard_layout
from hfsplit.errors import UnsupportedModelError
from hfsplit.models.families import check_causal_lm, tp_degree_error, tp_findings
from hfsplit.models.layout import decoder_layout, meta_model
from hfsplit.models.shrink import shrunk_config
from hfsplit.parallel.stage import build_stage_module
from hfsplit.plan import Stage, StageMemory
from hfsplit.planning.costs.cache import read_cache, write_cache

TOLERANCE = 1e-5
MAX_PARAMETERS = 20_000_000
PROOF_VERSION = 4  # 2: per-layer inputs carried, decoder-level buffers (verdicts of 1 refused Gemma 3n/4, Falcon-H1);
# 3: recurrent mixers run packed examples alone (verdicts of 2 turned packing off for Qwen3.5, Mamba2 hybrids), and
# fields under their own names shrunk (verdicts of 2 refused Ernie 4.5 MoE, Kimi Linear); 4: decoders building their
# masks without the position ids given them and `seq_idx` (verdicts of 3 turned packing off for Granite 4, AFMoE)
_SEQ = 12
_PACKED = (6, 5, 5)  # examples of a packed row, each longer than the shrunk sliding windows


@dataclass(frozen=True)
class Verdict:
    """What the proof found for one config.

    Args:
        model_type: the config's model type.
        split: the split equals transformers (logits and gradients at pp=2).
        packing: a packed row's examples equal each example alone (else packing is turned off for the model).
        reason: why `split` or `packing` is False, in one line ("" when both hold).
        logits_diff, grad_diff: the largest absolute differences measured.
    """

    model_type: str
    split: bool
    packing: bool
    reason: str = ""
    logits_diff: float = 0.0
    grad_diff: float = 0.0

    def line(self) -> str:
        """The verdict as `hfsplit check` prints it."""
        if not self.split:
            return f"{self.model_type}: refused: {self.reason}"
        packed = "packed rows isolated" if self.packing else f"packing off ({self.reason})"
        return (f"{self.model_type}: split equals transformers (pp=2, logits {self.logits_diff:.1e}, gradients "
                f"{self.grad_diff:.1e}); {packed}")


def proven_split(config) -> Verdict:
    """The verdict for `config` (cached by its hash); UnsupportedModelError naming the cause when the split
    differs from transformers or the shrunk model cannot be built."""
    verdict = verdict_of(config)
    if not verdict.split:
        name = getattr(config, "_name_or_path", "") or ""
        raise UnsupportedModelError(
            f"{name + ': ' if name else ''}model_type {verdict.model_type!r}: its split is refused: {verdict.reason}; "
            "load it in a single process (hfsplit.from_pretrained without a distributed launch) or with transformers")
    return verdict


def tp_line(config) -> str:
    """Whether tp=2 shards `config`'s model type, as `hfsplit check` without `--tp` prints it: what the tp=2 sweep
    found for the type (the proof on this config runs on two ranks: `hfsplit.load.tp_proof.proven_tp`)."""
    import transformers

    if why := tp_degree_error(config, 2):
        return f"{config.model_type}: {why}"
    rounding = tp_findings(transformers.__version__).get("rounding", {}).get(config.model_type)
    return f"{config.model_type}: tp=2 shards it" + (f" (proven in float64: {rounding})" if rounding else "")


def verdict_of(config) -> Verdict:
    """The proof's verdict for `config`, from the cache or measured now."""
    check_causal_lm(config)
    key = config_key(config)
    if (cached := read_cache("proof", key)) is not None:
        return Verdict(**cached)
    verdict = measured_verdict(config)
    write_cache("proof", key, asdict(verdict))
    return verdict


def config_key(config) -> str:
    """The config's hash: every field but its name and where it was read from."""
    data = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    text = json.dumps(data, sort_keys=True, default=str)
    return f"{PROOF_VERSION}|{hashlib.sha256(text.encode()).hexdigest()}"


def measured_verdict(config) -> Verdict:
    """Build the shrunk model, split it at pp=2 and compare (see the module docstring)."""
    kind = config.model_type
    try:
        tiny = shrunk_config(config)
        whole = tiny_model(tiny)
    except Exception as error:  # any failure to build is the reason, named
        return Verdict(kind, False, False, unbuilt_reason(config, error))
    try:
        stages = split_stages(whole, pp=2)
    except UnsupportedModelError as error:
        return Verdict(kind, False, False, str(error))
    except Exception as error:
        return Verdict(kind, False, False, f"its stages could not be built ({_short(error)})")
    try:
        logits_diff, grad_diff, where = compared(whole, stages)
    except Exception as error:
        return Verdict(kind, False, False, failed_forward_reason(whole, error))
    if where:
        return Verdict(kind, False, False, where, logits_diff, grad_diff)
    packing, why = packed_rows_isolated(whole, stages)
    return Verdict(kind, True, packing, why, logits_diff, grad_diff)


def unbuilt_reason(config, error: BaseException) -> str:
    """Why the shrunk model could not be built: transformers' own failure where the config, unshrunk, fails to build
    too (on the meta device: no memory), so that the shrinking is not blamed for a config transformers cannot use."""
    try:
        meta_model(config)
    except Exception as unshrunk:
        return f"transformers cannot build a model from this config, unshrunk too ({_short(unshrunk)})"
    return f"the shrunk model could not be built ({_short(error)})"


def failed_forward_reason(whole: nn.Module, error: BaseException) -> str:
    """Why the split forward failed: transformers' own forward where the whole model fails too, else the split."""
    try:
        with torch.no_grad():
            whole(input_ids=_examples(whole), use_cache=False)
    except Exception as own:
        return f"transformers' own forward fails on this config, unsplit too ({_short(own)})"
    return (f"the split forward failed ({_short(error)}); likely cause: its forward needs more than the hidden state "
            "between its blocks")


def tiny_model(tiny) -> nn.Module:
    """The shrunk model, fp32 on the CPU, every parameter perturbed (so a skipped zero bias or unit norm shows)."""
    from transformers import AutoModelForCausalLM

    size = sum(p.numel() for p in meta_model(tiny).parameters())
    if size > MAX_PARAMETERS:  # a size field the shrinking does not know: never build a big model by surprise
        raise UnsupportedModelError(f"its config could not be shrunk ({size / 1e6:.0f}M parameters left; a field "
                                    "hfsplit does not know keeps a flagship size)")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return model.eval()


def split_stages(whole: nn.Module, *, pp: int, tp_mesh=None) -> list[nn.Module]:
    """`whole` split into `pp` stages built as a run builds them, holding copies of its parameters; with `tp_mesh`
    (a 1-D DeviceMesh, on every rank of it), each stage sharded as a run shards it, holding this rank's slices."""
    config = whole.config
    n = config.num_hidden_layers
    bounds = [round(i * n / pp) for i in range(pp + 1)]
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = whole.state_dict()
    stages = []
    for i in range(pp):
        stage = Stage(index=i, pp_rank=i, devices=(("cpu",),), layers=(bounds[i], bounds[i + 1]), has_embed=i == 0,
                      has_head=i == pp - 1, memory=StageMemory(0, 0, 0, 0, 0), budget=0, time_s=0.0)
        module = build_stage_module(config=config, stage=stage, tied=tied)
        if tp_mesh is not None:
            apply_tp(module, tp_mesh=tp_mesh, body_name=module.body_name)
        for name, param in list(module.named_parameters()):
            source = state[name] if name in state else state[_tied_source(whole)]
            set_parameter(module, name, nn.Parameter(local_part(source.detach().clone(), param)))
        for name in checkpoint_buffers(module):
            owner, _, leaf = name.rpartition(".")
            module.get_submodule(owner)._buffers[leaf] = state[name].detach().clone()
        if getattr(module, "shares_embedding", False):
            module.lm_head.weight = module.body.embed_tokens.weight
        materialize_buffers(module, device=torch.device("cpu"))
        stages.append(module.eval())
    return stages


def local_part(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`full` as `param` holds it: unchanged, or, where tensor parallelism made `param` a DTensor, this rank's slice
    of it (as the checkpoint reader slices it: part `tp_rank` of each packed block) wrapped as `param`'s DTensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return full
    if (layout := shard_layout(param)) is not None:
        dim, packed = layout
        parts, index = param.device_mesh.size(), param.device_mesh.get_local_rank()
        full = torch.cat([block.chunk(parts, dim)[index] for block in full.chunk(packed, dim)], dim)
    return DTensor.from_local(full.contiguous(), param.device_mesh, param.placements, run_check=False)


def _tied_source(whole: nn.Module) -> str:
    embed = whole.get_input_embeddings().weight
    return next(name for name, p in whole.named_parameters() if p is embed)


def run_split(stages: list[nn.Module], ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None):
    x = ids
    for stage in stages:
        x = stage(x, position_ids=position_ids)
    return x


def both_backward(whole: nn.Module, stages: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, transformers' logits, the split's) of one seeded batch, each backward through the same random weighting
    of its logits (every parameter then holds its gradient)."""
    ids = _examples(whole)
    want = whole(input_ids=ids, use_cache=False).logits
    got = run_split(stages, ids)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    return ids, want, got


def _examples(whole: nn.Module) -> torch.Tensor:
    """The proof's seeded batch of token ids."""
    vocab = whole.config.get_text_config().vocab_size
    return torch.randint(3, vocab, (2, _SEQ), generator=torch.Generator().manual_seed(2))


def compared(whole: nn.Module, stages: list[nn.Module]) -> tuple[float, float, str]:
    """(logits diff, gradient diff, "" or where they first differ)."""
    ids, want, got = both_backward(whole, stages)
    logits_diff = (want - got).abs().max().item()
    grads = split_gradients(whole, stages)
    grad_diffs = {name: (p.grad - grads[name]).abs().max().item() if p.grad is not None and name in grads else
                  float("inf") if (p.grad is None) != (name not in grads) else 0.0
                  for name, p in whole.named_parameters()}
    grad_diff = max(grad_diffs.values(), default=0.0)
    if logits_diff <= TOLERANCE and grad_diff <= TOLERANCE:
        return logits_diff, grad_diff, ""
    return logits_diff, grad_diff, first_difference(whole, stages, ids, logits_diff, grad_diffs)


def split_gradients(whole: nn.Module, stages: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Every parameter's gradient in the split, summed where two stages hold a copy (tied embeddings)."""
    grads: dict[str, torch.Tensor] = {}
    tied = getattr(whole.config, "tie_word_embeddings", False) and whole.get_output_embeddings() is not None
    embed = _tied_source(whole) if tied else None
    head = next((n for n, p in whole.named_parameters(remove_duplicate=False)
                 if p is whole.get_output_embeddings().weight and n != embed), None) if tied else None
    for stage in stages:
        for name, p in stage.named_parameters():
            if p.grad is None:
                continue
            name = embed if embed and name == head else name
            grad = full_tensor(p.grad)  # a tensor-parallel shard gathered (collective: `hfsplit.load.tp_proof`)
            grads[name] = grads[name] + grad if name in grads else grad
    return grads


def first_difference(whole, stages, ids, logits_diff: float, grad_diffs: dict[str, float]) -> str:
    """One line naming the first block whose output differs (or the first gradient), and the likely cause."""
    want, got = block_outputs(whole, lambda: whole(input_ids=ids, use_cache=False)), \
        block_outputs(whole, lambda: run_split(stages, ids), stages)
    boundary = stages[0].layer_range[1]  # both stage kinds record their layers
    for index in sorted(want):  # (`not <=`: a NaN differs)
        if index in got and not (want[index] - got[index]).abs().max().item() <= TOLERANCE:
            cause = ("state one block hands a later block outside the hidden state" if index >= boundary else
                     "work its forward does before the blocks that the stage does not redo")
            return (f"the split differs from transformers: block {index}'s output first (logits {logits_diff:.2g} "
                    f"off; stages hold blocks 0-{boundary - 1} | {boundary}-); likely cause: {cause}")
    if not logits_diff <= TOLERANCE:
        return (f"the split differs from transformers after its blocks: logits {logits_diff:.2g} off; likely cause: "
                "work its forward does after the blocks (norm, head, scaling) that the last stage does not redo")
    name = max(grad_diffs, key=grad_diffs.get)
    return (f"the split's gradients differ from transformers: {name} {grad_diffs[name]:.2g} off; likely cause: a "
            "parameter used by more than one stage")


def block_outputs(whole: nn.Module, run, stages: Optional[list[nn.Module]] = None) -> dict[int, torch.Tensor]:
    """{block index: its output (the first tensor of it)} over one run."""
    outputs: dict[int, torch.Tensor] = {}
    blocks = []
    for module in stages or [whole]:
        found = getattr(module, "body", None)
        layers = found.layers.items() if stages else enumerate(whole.get_submodule(decoder_layout(whole).layers))
        blocks += [(int(i), b) for i, b in layers]
    handles = [b.register_forward_hook(_recorder(outputs, i)) for i, b in blocks]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return outputs


def _recorder(outputs: dict, index: int):
    def record(module, args, output):
        first = output[0] if isinstance(output, (tuple, list)) else output
        if torch.is_tensor(first):
            outputs[index] = first.detach()
    return record


def packed_rows_isolated(whole: nn.Module, stages: list[nn.Module]) -> tuple[bool, str]:
    """Whether a packed row's examples each give what they give alone (and why not)."""
    vocab = whole.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(4)
    examples = [torch.randint(3, vocab, (n,), generator=gen) for n in _PACKED]
    ids = torch.cat(examples)[None]
    positions = torch.cat([torch.arange(n) for n in _PACKED])[None]
    try:
        with torch.no_grad():
            alone = torch.cat([whole(input_ids=e[None], use_cache=False).logits[0] for e in examples])
            packed = run_split(stages, ids, positions)[0]
    except Exception as error:
        return False, f"a packed row fails in its forward ({_short(error)})"
    diff = (packed - alone).abs().max().item()
    if diff <= TOLERANCE:
        return True, ""
    return False, (f"a packed row's examples attend across their boundaries ({diff:.2g} off): a layer of it "
                   "(recurrent or linear attention, or a mask built without the position ids) cannot restart at an "
                   "example boundary")


def _short(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text if len(text) <= 160 else text[:157] + "..."


# --- every causal LM transformers registers ---------------------------------------------------------------------

_OFF = re.compile(r"(?:\d+(?:\.\d+)?(?:e[-+]?\d+)?|nan|inf) off")  # measured gaps: the table keeps the words only
TABLE_START, TABLE_END = "<!-- families-table:start -->", "<!-- families-table:end -->"


def registered_types() -> list[str]:
    """Every causal-LM model type the installed transformers registers (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def default_verdict(model_type: str) -> Verdict:
    """The proof's verdict on transformers' default config of `model_type` (the flagship's flags and layer kinds);
    a config transformers itself cannot make is refused with its reason."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(model_type)
    except Exception as error:
        return Verdict(model_type, False, False, f"transformers cannot make its default config ({_short(error)})")
    try:
        verdict = verdict_of(config)
    except UnsupportedModelError as error:
        return Verdict(model_type, False, False, str(error).split("; hfsplit splits")[0])
    return replace(verdict, model_type=model_type)  # an alias (gpt-sw3) under its own registered name


def all_verdicts(progress: bool = False) -> list[Verdict]:
    """The verdict of every registered causal-LM type (cached per config: a second sweep reads files)."""
    from tqdm import tqdm

    types = registered_types()
    return [default_verdict(t) for t in tqdm(types, desc="proving splits", disable=not progress, unit="type")]


def families_markdown(verdicts: list[Verdict]) -> str:
    """The sweep as docs/guides/families.md shows it: the count, then one row per model type; its tp=2 column the
    committed findings of the tp=2 sweep (`hfsplit.load.tp_proof`) on the installed transformers."""
    import transformers

    tp = tp_findings(transformers.__version__)
    split = [v for v in verdicts if v.split]
    packed = [v for v in split if v.packing]
    sharded = [v for v in split if v.model_type in tp["proven"]]
    rows = ["| model type | split (pp) | packed rows | tp=2 | why not |", "|---|---|---|---|---|"]
    for v in verdicts:
        whys = [v.reason] if (not v.split or not v.packing) else []
        proven = v.split and v.model_type in tp["proven"]
        if v.split and not proven:
            whys.append(f"tp=2: {tp['refused'].get(v.model_type, 'not swept')}")
        elif proven and (rounding := tp.get("rounding", {}).get(v.model_type)):
            whys.append(f"tp=2 proven in float64: {rounding}")
        why = "; ".join(without_measures(w) for w in whys).replace("|", "\\|")
        rows.append(f"| `{v.model_type}` | {'✓' if v.split else 'refused'} | "
                    f"{'✓' if v.packing else '—' if v.split else ''} | {'✓' if proven else '—' if v.split else ''} "
                    f"| {why} |")
    head = (f"**{len(split)} of the {len(verdicts)} causal-LM types of transformers {transformers.__version__} split** "
            f"(equal to transformers in logits and gradients at pp=2, fp32 ≤ {TOLERANCE:g}; {len(packed)} of them "
            f"with packed rows isolated; {len(sharded)} of them also sharded at tp=2, proven on two ranks); the rest "
            "are refused by name, with why. Generated by `python scripts/families_table.py` from `hfsplit check "
            "--all` and the tp=2 sweep.")
    return "\n".join([head, "", *rows])


def without_measures(reason: str) -> str:
    """`reason` without the gaps it measured ("3.1e-02 off" → "off"), as the table and the tp=2 findings keep it."""
    return _OFF.sub("off", reason)


def with_table(document: str, table: str) -> str:
    """`document` with the text between its families-table markers replaced by `table`."""
    start, end = document.index(TABLE_START) + len(TABLE_START), document.index(TABLE_END)
    return f"{document[:start]}\n{table}\n{document[end:]}"
