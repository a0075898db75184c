"""Generation on the split stages against transformers' `generate`, inside each rank (tests/parallel/launcher.py).

Each check returns plain data for the parent test; one launch runs them all for one split.
"""
from __future__ import annotations

import torch

from tests.parallel.cases import hand_plan

LENGTHS = (7, 3, 5, 7, 1)  # prompts of different lengths, left-padded to 7: uneven micro-batches too


def left_padded_prompts(vocab_size: int, *, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of prompts of `LENGTHS` tokens, left-padded with `pad`, as a tokenizer with
    `padding_side="left"` gives them."""
    gen = torch.Generator().manual_seed(11)
    width = max(LENGTHS)
    ids = torch.full((len(LENGTHS), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        ids[row, width - n:] = torch.randint(3, vocab_size, (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask


def split_and_reference(*, checkpoint: str, tp: int, pp: int, layers: list, schedule: str, micro_batches: int = 2):
    """This rank's split model of a hand-made plan, and transformers' unsplit model, both fp32."""
    from transformers import AutoModelForCausalLM

    from hfsplit.checkpoint import load_config
    from hfsplit.parallel.mesh import init_parallel
    from hfsplit.parallel.split_model import build_split_model

    config = load_config(checkpoint)
    plan = hand_plan(config, tp=tp, pp=pp, layers=layers, schedule=schedule, micro_batches=micro_batches)
    model = build_split_model(plan, checkpoint, ctx=init_parallel(plan), dtype=torch.float32)
    return model, AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


# (micro-batches, prefill chunks): the relay, two cuts, a row a micro-batch; the prompts' pass in chunks of 3, 2, 2
# positions (rows 1 and 4 all padding in the first), and a position a chunk
CUTS = ((1, 1), (2, 1), (3, 1), (5, 1), (2, 3), (1, 7))


def greedy_matches_transformers(model, reference, *, cuts=CUTS, new_tokens: int = 8) -> dict:
    """Greedy continuations of left-padded prompts, cut into each (micro-batches, prefill chunks) of `cuts`, against
    transformers' `generate`: without an end-of-sequence token, and with one that row 0 reaches early (the rows
    that end go on with the pad token; the batch stops when every row has ended)."""
    pad = model.config.pad_token_id
    ids, mask = left_padded_prompts(model.config.vocab_size, pad=pad)
    greedy = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    want = reference.generate(ids, attention_mask=mask, eos_token_id=None, **greedy)
    eos = int(want[0, ids.shape[1] + 2])  # row 0's third new token: it ends there
    want_eos = reference.generate(ids, attention_mask=mask, eos_token_id=eos, **greedy)
    out = {"expected": want.tolist(), "expected_eos": want_eos.tolist(), "eos": eos, "got": {}, "got_eos": {}}
    for cut, chunks in cuts:
        split = dict(micro_batches=cut, prefill_chunks=chunks, **greedy)
        out["got"][f"{cut}x{chunks}"] = model.generate(ids, mask, eos_token_id=None, **split).tolist()
        out["got_eos"][f"{cut}x{chunks}"] = model.generate(ids, mask, eos_token_id=eos, **split).tolist()
    return out


def sampling_checks(model, reference, *, new_tokens: int = 6) -> dict:
    """Sampling: one seed draws the same continuations twice and another seed others; `top_k=1` is greedy; every
    token drawn under `top_k=3` (with temperature and top-p) is among transformers' 3 likeliest for its prefix;
    `num_return_sequences` gives that many rows a prompt, each prompt's first."""
    pad = model.config.pad_token_id
    ids, mask = left_padded_prompts(model.config.vocab_size, pad=pad)
    sample = dict(max_new_tokens=new_tokens, do_sample=True, eos_token_id=None, pad_token_id=pad)
    first = model.generate(ids, mask, seed=3, top_k=3, temperature=0.7, top_p=0.95, **sample)
    again = model.generate(ids, mask, seed=3, top_k=3, temperature=0.7, top_p=0.95, **sample)
    other = model.generate(ids, mask, seed=4, top_k=3, temperature=0.7, top_p=0.95, **sample)
    top1 = model.generate(ids, mask, seed=5, top_k=1, **sample)
    greedy = reference.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=pad)
    full_mask = torch.cat([mask, torch.ones(len(ids), new_tokens, dtype=mask.dtype)], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = reference(first, attention_mask=full_mask, position_ids=positions).logits
    start = ids.shape[1]
    top3 = logits[:, start - 1:-1].topk(3, dim=-1).indices  # the 3 likeliest for each drawn position
    drawn = first[:, start:]
    pairs = model.generate(ids, mask, seed=6, num_return_sequences=2, **sample)
    return {"same_seed_equal": torch.equal(first, again), "other_seed_differs": not torch.equal(first, other),
            "top1_is_greedy": torch.equal(top1, greedy), "in_top3": bool((top3 == drawn[..., None]).any(-1).all()),
            "pairs_shape": tuple(pairs.shape), "pairs_prompts_equal": torch.equal(pairs[::2, :start], ids)
            and torch.equal(pairs[1::2, :start], ids)}


def generation_matches_transformers(*, sampling: bool = True, **split) -> dict:
    """One launch: greedy equality for every cut, and (with `sampling`) the sampling checks."""
    model, reference = split_and_reference(**split)
    out = greedy_matches_transformers(model, reference)
    if sampling:
        out.update(sampling_checks(model, reference))
    return out


def distributed_surface(*, checkpoint: str, out: str) -> dict:
    """`hfsplit.from_pretrained` under a launch with no budget: the transformers surface of its model (device map,
    plan, configs, forward, generate, save_pretrained) and the errors of what cannot hold on a split."""
    from transformers import AutoModelForCausalLM

    import hfsplit
    from hfsplit.budget import local_share, parse_max_memory
    from hfsplit.errors import SplitAttributeError

    model = hfsplit.from_pretrained(checkpoint, pp=2)  # max_memory=None: each rank's share of what is free
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=model.plan.spec.dtype).eval()
    ids, mask = left_padded_prompts(model.config.vocab_size, pad=model.config.pad_token_id)
    greedy = dict(max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        logits_diff = (model(ids[:, -1:].repeat(1, 4), broadcast=True) - reference(ids[:, -1:].repeat(1, 4)).logits)
    model.save_pretrained(out)
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=model.plan.spec.dtype)
    errors = {}
    for name in ("get_input_embeddings", "gradient_checkpointing_enable", "no_such_attribute"):
        try:
            getattr(model, name)
        except AttributeError as exc:
            errors[name] = (isinstance(exc, SplitAttributeError), str(exc))
    share = parse_max_memory(local_share(2, ranks_here=2))
    return {"device_map": model.hf_device_map, "layers": [s.layers for s in model.hfsplit_plan.stages],
            "plan_is_plan": model.hfsplit_plan is model.plan, "method": model.hfsplit_plan.spec.method,
            "budgets": [s.budget for s in model.plan.stages], "share": min(share.values()),
            "model_type": model.config.model_type, "eos": model.generation_config.eos_token_id,
            "logits_diff": logits_diff.abs().max().item(),
            "generate_equal": torch.equal(model.generate(ids, mask, **greedy),
                                          reference.generate(ids, attention_mask=mask, **greedy)),
            "saved_equal": torch.equal(saved(ids).logits, reference(ids).logits),
            "has_lm_head": hasattr(model, "lm_head"), "errors": errors}
