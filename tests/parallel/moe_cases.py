"""MoE checks that run inside each rank: the split against transformers, router auxiliary loss included."""
from __future__ import annotations

import torch

from tests.parallel.cases import hand_plan, reference_name, split_matches_transformers


# Mixtral's and Qwen3-MoE's router (`mlp.gate`), gpt-oss's (`mlp.router`, with a bias)
ROUTER_WEIGHTS = ("mlp.gate.weight", "mlp.router.weight")


def moe_splits_match_transformers(*, cases: dict) -> dict:
    """`moe_split_matches_transformers` of each case {name: its keyword arguments}, in one launch of ranks."""
    return {name: moe_split_matches_transformers(**kwargs) for name, kwargs in cases.items()}


def moe_split_matches_transformers(*, checkpoint: str, router_checkpoint: str, tp: int, pp: int, layers: list,
                                   schedule: str, micro_batches: int = 2) -> dict:
    """`split_matches_transformers` on `checkpoint` (logits, gradients, greedy generation), then one step
    on `router_checkpoint` (`output_router_logits` set) of packed rows: the loss and gradients against transformers'
    own loss, which adds `router_aux_loss_coef` × aux over all layers of each micro-batch's forward."""
    split = dict(tp=tp, pp=pp, layers=layers, schedule=schedule, micro_batches=micro_batches)
    out = split_matches_transformers(checkpoint=checkpoint, **split)
    out["router"] = router_loss_matches(checkpoint=router_checkpoint, **split)
    return out


def router_loss_matches(*, checkpoint: str, tp: int, pp: int, layers: list, schedule: str, micro_batches: int) -> dict:
    from transformers import AutoModelForCausalLM

    from hfsplit.checkpoint import load_config
    from hfsplit.parallel.mesh import init_parallel
    from hfsplit.parallel.split_model import build_split_model
    from hfsplit.apply.tp import full_tensor
    from hfsplit.models.loss import causal_lm_loss

    config = load_config(checkpoint)
    plan = hand_plan(config, tp=tp, pp=pp, layers=layers, schedule=schedule, micro_batches=micro_batches)
    model = build_split_model(plan, checkpoint, ctx=init_parallel(plan), dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    ids = torch.randint(3, config.vocab_size, (4, 8), generator=torch.Generator().manual_seed(3))
    # packed rows of two examples (3 and 5 tokens): the router statistics span every token, as transformers' do
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 4)
    loss = model.step(ids, ids, causal_lm_loss(config.vocab_size), position_ids=positions)
    ref_losses, aux = [], []
    given_packed_masks(reference)
    # the schedule's micro-batches, each its own transformers forward (equal token counts: the token mean is the
    # mean of theirs), the router term the mean of theirs
    for chunk, pos in zip(ids.chunk(micro_batches), positions.chunk(micro_batches)):
        ref = reference(input_ids=chunk, labels=chunk, position_ids=pos, use_cache=False)
        (ref.loss / micro_batches).backward()
        ref_losses.append(ref.loss.detach())
        aux.append(float(ref.aux_loss))
    out = {"aux": aux, "grad_rel_diff": {}}
    if loss is not None:
        out["loss_diff"] = (loss - torch.stack(ref_losses).mean()).abs().item()
    for stage in model.stages:
        for name, p in stage.named_parameters():
            ref = reference.get_parameter(reference_name(name, tied=plan.tied_embeddings))
            out["grad_rel_diff"][name] = ((full_tensor(p.grad) - ref.grad).abs().max()
                                          / ref.grad.abs().max().clamp_min(1e-12)).item()
    # the router loss reaches every router: its gradient differs from the cross-entropy-only one
    out["router_grads"] = [name for name in out["grad_rel_diff"] if name.endswith(ROUTER_WEIGHTS)]
    return out



def given_packed_masks(reference) -> None:
    """Hand transformers' own packed masks to a family whose forward builds its masks without the position ids
    (gpt-oss in transformers 5 attends across a packed row's examples); on the decoder, whose caller's router
    loss reads the 2-D mask. Nothing for the other families."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    def masks(module, args, kwargs):
        inputs = dict(config=reference.config, inputs_embeds=torch.empty(*kwargs["position_ids"].shape, 1),
                      attention_mask=None, cache=None, position_ids=kwargs["position_ids"])
        kwargs["attention_mask"] = {"full_attention": create_causal_mask(**inputs),
                                    "sliding_attention": create_sliding_window_causal_mask(**inputs)}
        return args, kwargs

    if reference.config.model_type == "gpt_oss":
        reference.get_decoder().register_forward_pre_hook(masks, with_kwargs=True)
