"""The split model against unsplit transformers: logits, gradients, greedy generation.

Each launch runs every check for one split, so the matrix (architectures × splits ×
schedules × tied) costs a handful of process launches.
"""
import pytest

from hfsplit.checkpoint import load_config

pytestmark = pytest.mark.slow

SPLITS = {
    # name: (arch, tied, ranks, split options)
    # the first stage's embedding table in host RAM, looked up there (hfsplit.apply.host_embedding)
    "llama-pp2-gpipe-uneven-host-embedding": ("llama", False, 2, dict(tp=1, pp=2, layers=[(0, 1), (1, 4)],
                                                                      schedule="GPipe", host_embedding=True)),
    "mistral-tp2": ("mistral", False, 2, dict(tp=2, pp=1, layers=[(0, 4)], schedule="GPipe")),
    "qwen2-tied-pp2xtp2-1f1b-uneven": ("qwen2", True, 4, dict(tp=2, pp=2, layers=[(0, 3), (3, 4)], schedule="1F1B")),
    "mistral-pp2-interleaved1f1b": ("mistral", False, 2,
                                    dict(tp=1, pp=2, layers=[(0, 1), (1, 2), (2, 3), (3, 4)], schedule="Interleaved1F1B")),
    "llama-tied-pp2-zbv": ("llama", True, 2,
                           dict(tp=1, pp=2, layers=[(0, 1), (1, 2), (2, 3), (3, 4)], schedule="ZBVZeroBubble")),
    # per-head q/k norms: replicated under TP, their gradients summed over the TP group
    "qwen3-pp2-1f1b": ("qwen3", False, 2, dict(tp=1, pp=2, layers=[(0, 2), (2, 4)], schedule="1F1B")),
    "qwen3-tied-pp2xtp2-1f1b": ("qwen3", True, 4, dict(tp=2, pp=2, layers=[(0, 2), (2, 4)], schedule="1F1B")),
    # fused qkv and gate_up projections, post-norm blocks: pipeline splits (their TP plans use styles
    # hfsplit does not shard yet, so the planner keeps them at tp=1)
    "phi3-tied-pp2-gpipe-uneven": ("phi3", True, 2, dict(tp=1, pp=2, layers=[(0, 3), (3, 4)], schedule="GPipe")),
    "olmo2-pp2-interleaved1f1b": ("olmo2", False, 2,
                                  dict(tp=1, pp=2, layers=[(0, 1), (1, 2), (2, 3), (3, 4)], schedule="Interleaved1F1B")),
}


@pytest.mark.parametrize("name", list(SPLITS))
def test_split_matches_transformers(name, launch, tiny_checkpoint):
    check_split_matches_transformers(*SPLITS[name], launch=launch, tiny_checkpoint=tiny_checkpoint)


def check_split_matches_transformers(arch: str, tied: bool, ranks: int, split: dict, *, launch, tiny_checkpoint) -> None:
    """One launch of `ranks` processes checks logits, loss, gradients, generation and parameter placement."""
    checkpoint = str(tiny_checkpoint(arch, tied=tied))
    results = launch("tests.parallel.cases:split_matches_transformers", world_size=ranks,
                     kwargs=dict(checkpoint=checkpoint, **split))
    assert_split_matches(results, checkpoint=checkpoint, tp=split["tp"], tied=tied)
    on_host = split.get("host_embedding", False)
    first = next(r for r in results if r["coords"] == (0, 0))
    # the plan's decision ran (its step applied), and the table lives where it says: marked for the host, read there
    assert ("host_embedding" in first["applied"]) == on_host
    if on_host:
        assert first["embedding_at"] == [(first["host"], first["host"])], first["embedding_at"]


def assert_split_matches(results: list, *, checkpoint: str, tp: int, tied: bool, declared: bool = True,
                         packs: bool = True) -> None:
    """The per-rank results of `cases.split_matches_transformers` show the split equal to transformers (`declared`:
    a declared family's stage, whose packed rows run example by example under sdpa; a followed model's own forward
    builds transformers' block-diagonal mask instead; `packs`: the proof found packed rows isolated in this model,
    else the run turns packing off and only unpacked layouts are held to transformers)."""
    for r in results:
        assert r["logits_diff"] <= 1e-5
        assert r["generate_equal"], r["generated"]
        bad = {n: d for n, d in r["grad_rel_diff"].items() if d > 1e-5}
        assert not bad, bad
        # a packed row [A B C]: each example's logits as alone
        assert not packs or r["packed_logits_diff"] <= 1e-5, r["packed_logits_diff"]
        assert not packs or r["block_mask_logits_diff"] <= 1e-5, r["block_mask_logits_diff"]  # with the L x L mask
    # under sdpa (only there) the packed rows ran example by example (models/varlen.py)
    assert all(r["varlen_ran"] == (r["attention"] == "sdpa" and declared) for r in results), \
        [r["attention"] for r in results]
    layouts = ("packed", "padded", "joined") if packs else ("padded",)
    for r in results:
        assert not packs or r["joined_logits_diff"] <= 1e-5, r["joined_logits_diff"]  # a micro-batch one row (flash)
        # packed rows, padded rows of varying lengths, rows joined: the token-mean step's gradients as transformers'
        for layout in layouts:
            # packed or joined rows: within 1e-5 of transformers, or no further from it than its own fp32 model is
            # from float64 (a recurrence amplifies fp32 rounding in its decay parameters: Qwen3-Next's split 1.7e-5
            # from transformers there, transformers 1e-3 from float64; docs/design.md)
            spread = r.get(f"{layout}_grad_spread", {})
            bad = {n: d for n, d in r[f"{layout}_grad_rel_diff"].items() if d > max(1e-5, spread.get(n, 0.0))}
            assert not bad, (layout, {n: (d, spread.get(n)) for n, d in bad.items()})
    for key in ("loss_diff", *(f"{layout}_loss_diff" for layout in layouts)):
        assert any(key in r and r[key] <= 1e-5 for r in results), key
    assert_every_parameter_once(results, checkpoint=checkpoint, tp=tp, tied=tied)


def assert_every_parameter_once(results: list, *, checkpoint: str, tp: int, tied: bool) -> None:
    """Across the ranks each parameter is held exactly once per TP rank, sharded ones as 1/tp of their elements."""
    from transformers import AutoModelForCausalLM

    held: dict[str, list] = {}
    for r in results:
        for name, (local, full) in r["numels"].items():
            held.setdefault(name, []).append((local, full))
    for name, pieces in held.items():
        assert len(pieces) == tp, (name, pieces)
        local, full = pieces[0]
        assert local in (full, full // tp), (name, pieces)
        assert sum(p[0] for p in pieces) in (full, full * tp), (name, pieces)
    config = load_config(checkpoint)
    import torch

    with torch.device("meta"):
        names = {n for n, _ in AutoModelForCausalLM.from_config(config).named_parameters()}
    if tied:  # a last stage without the embeddings keeps its own copy of the shared matrix
        assert set(held) - names <= {"lm_head.weight"}
        names |= set(held)
    assert set(held) == names


@pytest.mark.parametrize("arch, tied, split", [
    ("llama", False, dict(pp=2, tp=1, schedule="1F1B")),
    ("qwen2", True, dict(pp=1, tp=2, schedule="GPipe")),
    ("phi3", False, dict(pp=1, tp=2, schedule="GPipe")),  # gathered outputs: their weights split all the same
])
def test_split_from_pretrained_holds_the_planned_bytes(arch, tied, split, launch, tiny_checkpoint):
    checkpoint = str(tiny_checkpoint(arch, tied=tied))
    results = launch("tests.parallel.cases:planned_split_runs", world_size=2,
                     kwargs=dict(checkpoint=checkpoint, max_memory="2x2GiB", **split))
    assert [r["stage_indices"] for r in results] == ([(0,), (1,)] if split["pp"] == 2 else [(0,), (0,)])
    for r in results:
        assert r["logits_diff"] <= 1e-5
        assert r["weight_bytes"] == r["planned_weight_bytes"]


@pytest.mark.parametrize("pp, layers, message", [
    (4, [(0, 1), (1, 2), (2, 3), (3, 4)], "needs pp=4 × tp=1 × dp=1 = 4 processes but 2 were launched"),
    (2, [(0, 1), (1, 2), (2, 4)], "3 stages but pp=2 × virtual_stages=1 = 2 slots"),
])
def test_plan_not_matching_the_launch_fails_on_every_rank(pp, layers, message, launch, tiny_checkpoint):
    results = launch("tests.parallel.cases:bad_plan_error", world_size=2,
                     kwargs=dict(checkpoint=str(tiny_checkpoint("llama")), pp=pp, layers=layers), timeout_s=60)
    assert all(message in r for r in results), results


def test_distributed_from_pretrained_plans_inference_by_default(launch, tiny_checkpoint):
    """Under a launcher, `from_pretrained(path, max_memory)` plans for inference, as on one process: on a budget
    where every training plan is refused (the LoRA plan at seq 2048 it used to make among them), the model loads
    and generates what transformers generates."""
    checkpoint = str(tiny_checkpoint("llama"))
    results = launch("tests.parallel.cases:default_intent_runs", world_size=2,
                     kwargs=dict(checkpoint=checkpoint, max_memory="2x6MiB"))  # full fits at 8 MiB since the planner turns the knobs
    for r in results:
        assert r["method"] == "inference"
        assert all("no split fits the budget" in why for why in r["refused"].values()), r["refused"]
        assert r["generated"] == r["expected"]


def test_both_paths_apply_what_the_plan_lists_for_every_method(launch, tiny_checkpoint):
    """`from_pretrained` on one process and under a launcher records the plan's steps in the plan's order for LoRA,
    QLoRA and full fine-tuning; the single-process model leaves only the adapters to peft (`LEFT_TO_PEFT`)."""
    from hfsplit.apply.steps import LEFT_TO_PEFT
    from tests.parallel.cases import steps_by_method

    checkpoint = str(tiny_checkpoint("llama"))
    one = steps_by_method(checkpoint=checkpoint, single=True)
    ranks = launch("tests.parallel.cases:steps_by_method", world_size=2, kwargs=dict(checkpoint=checkpoint))
    for method in ("lora", "qlora", "full"):
        for r in ranks:
            assert r[method]["applied"] == r[method]["steps"], (method, r[method])
        assert one[method]["applied"] == tuple(s for s in one[method]["steps"] if s.kind not in LEFT_TO_PEFT), method
        assert [s.kind for s in one[method]["steps"]] == [s.kind for s in ranks[0][method]["steps"]], method
        assert "checkpointing" in [s.kind for s in one[method]["applied"]]
