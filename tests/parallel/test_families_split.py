"""Families that do work outside their blocks (hfsplit.models.FAMILIES), split: logits, gradients and greedy
generation equal to transformers. One launch per (family, split) checks all three."""
import pytest

from tests.parallel.test_split_model import check_split_matches_transformers

pytestmark = pytest.mark.slow

SPLITS = {
    # final logit soft-capping on the last stage, alternating sliding window, embedding scale in the module
    "gemma2-pp2-1f1b": ("gemma2", False, 2, dict(tp=1, pp=2, layers=[(0, 2), (2, 4)], schedule="1F1B")),
    # embedding multiplier on the first stage, logits divisor on the last
    "granite-pp2-gpipe": ("granite", False, 2, dict(tp=1, pp=2, layers=[(0, 1), (1, 4)], schedule="GPipe")),
    # logit scale, tied head on the last stage, parallel attention/MLP blocks
    "cohere-tied-pp2-1f1b": ("cohere", True, 2, dict(tp=1, pp=2, layers=[(0, 2), (2, 4)], schedule="1F1B")),
    # soft-capping with heads sharded over TP ranks
    "gemma2-tp2": ("gemma2", False, 2, dict(tp=2, pp=1, layers=[(0, 4)], schedule="GPipe")),
    # embedding scale under a vocabulary-sharded embedding
    "gemma-tp2": ("gemma", False, 2, dict(tp=2, pp=1, layers=[(0, 4)], schedule="GPipe")),
    # a local and a global rope by layer type; the first stage holds sliding layers only
    "gemma3_text-pp2-1f1b": ("gemma3_text", False, 2, dict(tp=1, pp=2, layers=[(0, 1), (1, 4)], schedule="1F1B")),
    # logit scale, tied head, sliding layers from layer_types; the last stage holds one full-attention layer
    "cohere2-tied-pp2-gpipe": ("cohere2", True, 2, dict(tp=1, pp=2, layers=[(0, 3), (3, 4)], schedule="GPipe")),
    "cohere2-tp2": ("cohere2", False, 2, dict(tp=2, pp=1, layers=[(0, 4)], schedule="GPipe")),
    # embedding scale on the first stage only (its module's buffer), head on the last
    "gemma-pp2-gpipe": ("gemma", False, 2, dict(tp=1, pp=2, layers=[(0, 2), (2, 4)], schedule="GPipe")),
    # multipliers inside sharded blocks (residual, attention) and outside them (embedding, logits)
    "granite-tp2": ("granite", False, 2, dict(tp=2, pp=1, layers=[(0, 4)], schedule="GPipe")),
    # parallel attention/MLP blocks with both halves sharded, logit scale on the full logits
    "cohere-tp2": ("cohere", False, 2, dict(tp=2, pp=1, layers=[(0, 4)], schedule="GPipe")),
    # per-type rope and masks on 4 ranks, two stages of two TP ranks (q/k norms replicated, gradients summed):
    # also the tp=2 check of this family
    "gemma3_text-pp2-tp2": ("gemma3_text", False, 4, dict(tp=2, pp=2, layers=[(0, 1), (1, 4)], schedule="1F1B")),
    # soft-capping and sliding masks on 4 ranks: two stages of two TP ranks
    "gemma2-pp2-tp2": ("gemma2", False, 4, dict(tp=2, pp=2, layers=[(0, 2), (2, 4)], schedule="1F1B")),
}


@pytest.mark.parametrize("name", list(SPLITS))
def test_family_split_matches_transformers(name, launch, tiny_checkpoint):
    check_split_matches_transformers(*SPLITS[name], launch=launch, tiny_checkpoint=tiny_checkpoint)


# MoE (experts fused in the module, merged from per-expert checkpoint tensors, whole inside a stage): the split as
# above, then one step with `output_router_logits` set, whose router auxiliary loss spans the layers of both stages.
MOE_SPLITS = {
    # four stages on two ranks: the sums pass rank 0 → 1 → 0 → 1, and a rank holds two stages' routers
    "mixtral-pp2-interleaved1f1b": ("mixtral", dict(tp=1, pp=2, layers=[(0, 1), (1, 2), (2, 3), (3, 4)],
                                                    schedule="Interleaved1F1B")),
    # a first stage of one layer: three layers' router sums continue on the second stage
    "qwen3_moe-pp2-gpipe": ("qwen3_moe", dict(tp=1, pp=2, layers=[(0, 1), (1, 4)], schedule="GPipe")),
}


def test_moe_splits_match_transformers_router_loss_included(launch, tiny_checkpoint):
    """Both families in one launch of two ranks (each case builds its split models in turn)."""
    from tests.parallel.test_split_model import assert_every_parameter_once

    cases = {name: dict(checkpoint=str(tiny_checkpoint(arch)), **split,
                        router_checkpoint=str(tiny_checkpoint(arch, output_router_logits=True, router_aux_loss_coef=0.5)))
             for name, (arch, split) in MOE_SPLITS.items()}
    results = launch("tests.parallel.moe_cases:moe_splits_match_transformers", world_size=2, kwargs=dict(cases=cases))
    for name, case in cases.items():
        per_rank = [r[name] for r in results]
        for r in per_rank:
            assert r["logits_diff"] <= 1e-5, name
            assert r["generate_equal"], (name, r["generated"])
            for grads in (r["grad_rel_diff"], r["router"]["grad_rel_diff"]):
                bad = {n: d for n, d in grads.items() if d > 1e-5}
                assert not bad, (name, bad)
            assert r["router"]["router_grads"], name  # each stage's routers got the loss's gradient
            assert min(r["router"]["aux"]) > 0.5, name  # ≥ 1 for any routing: at coefficient 0.5 a missed term shows
        last = [r for r in per_rank if "loss_diff" in r["router"]]
        assert len(last) == 1 and last[0]["router"]["loss_diff"] <= 1e-5 and last[0]["loss_diff"] <= 1e-5, name
        assert_every_parameter_once(per_rank, checkpoint=case["checkpoint"], tp=1, tied=False)
