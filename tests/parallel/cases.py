"""Checks that run inside each rank (started by tests/parallel/launcher.py).

Each returns plain data (numbers, names) for the parent test to assert on, so one
launch can run several checks.
"""
from __future__ import annotations

import torch

from hfsplit.plan import TrainingSpec
from hfsplit.parallel.mesh import schedule_pp_rank
from hfsplit.plan import Plan, Stage, StageMemory


def hand_plan(config, *, tp: int, pp: int, layers: list[tuple[int, int]], schedule: str,
              micro_batches: int = 2, dp: int = 1, method: str = "full", seq_len: int = 8) -> Plan:
    """A Plan built by hand: `layers[i]` is stage i's block range (pipeline order), fp32."""
    zero = StageMemory(weights=0, gradients=0, optimizer=0, activations=0, reserve=0)
    stages = tuple(
        Stage(index=i, pp_rank=schedule_pp_rank(schedule=schedule, pp=pp, index=i), devices=tuple(tuple("cpu" for _ in range(tp)) for _ in range(dp)), layers=span,
              has_embed=i == 0, has_head=i == len(layers) - 1, memory=zero, budget=1, time_s=0.0)
        for i, span in enumerate(layers)
    )
    return Plan(model="tiny", model_type=config.model_type, num_layers=config.num_hidden_layers, tp=tp, pp=pp,
                dp=dp, virtual_stages=len(layers) // pp, schedule=schedule, micro_batches=micro_batches,
                spec=TrainingSpec(method=method, seq_len=seq_len, dtype="float32"), stages=stages, step_time_s=0.0,
                bubble_fraction=0.0, tied_embeddings=bool(config.tie_word_embeddings))


def reference_name(name: str, *, tied: bool) -> str:
    """The unsplit model's name of a stage parameter (a tied lm_head is the embedding)."""
    return "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (labels are the input ids; the shift happens here)."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))


def split_matches_transformers(*, checkpoint: str, tp: int, pp: int, layers: list, schedule: str,
                               micro_batches: int = 2, new_tokens: int = 8) -> dict:
    """Logits, one step's gradients and greedy generation of the split model against transformers."""
    from transformers import AutoModelForCausalLM

    from hfsplit.checkpoint import load_config
    from hfsplit.parallel.mesh import init_parallel
    from hfsplit.parallel.split_model import build_split_model
    from hfsplit.apply.tp import full_tensor

    config = load_config(checkpoint)
    plan = hand_plan(config, tp=tp, pp=pp, layers=layers, schedule=schedule, micro_batches=micro_batches)
    ctx = init_parallel(plan)
    model = build_split_model(plan, checkpoint, ctx=ctx, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    torch.manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (4, 8))

    logits = model(ids, broadcast=True)
    ref_logits = reference(ids).logits
    out = {"logits_diff": (logits - ref_logits).abs().max().item()}

    loss = model.step(ids, ids, causal_lm_loss)
    ref_loss = causal_lm_loss(reference(ids).logits, ids)
    ref_loss.backward()
    if loss is not None:
        out["loss_diff"] = (loss - ref_loss).abs().item()
    grads, numels = {}, {}
    for stage in model.stages:
        for name, p in stage.named_parameters():
            ref = reference.get_parameter(reference_name(name, tied=plan.tied_embeddings))
            g = full_tensor(p.grad)
            grads[name] = ((g - ref.grad).abs().max() / ref.grad.abs().max().clamp_min(1e-12)).item()
            numels[name] = (p.to_local().numel() if hasattr(p, "to_local") else p.numel(), ref.numel())
    out["grad_rel_diff"] = grads
    out["numels"] = numels
    out["coords"] = (ctx.coords.pp, ctx.coords.tp)

    if new_tokens:
        got = model.generate(ids[:2, :5], max_new_tokens=new_tokens)
        want = reference.generate(ids[:2, :5], max_new_tokens=new_tokens, do_sample=False,
                                  attention_mask=torch.ones_like(ids[:2, :5]))
        out["generate_equal"] = torch.equal(got, want)
        out["generated"] = (got.tolist(), want.tolist())
    return out


def bad_plan_error(*, checkpoint: str, pp: int, layers: list, schedule: str = "1F1B") -> str:
    """The PlanError message a rank raises for a plan that does not fit the launch ('' if none)."""
    from hfsplit.checkpoint import load_config
    from hfsplit.errors import PlanError
    from hfsplit.parallel.mesh import init_parallel

    plan = hand_plan(load_config(checkpoint), tp=1, pp=pp, layers=layers, schedule=schedule)
    try:
        init_parallel(plan)
    except PlanError as exc:
        return str(exc)
    return ""


def planned_split_runs(*, checkpoint: str, max_memory: str, pp: int, tp: int, schedule: str) -> dict:
    """`hfsplit.from_pretrained` under a launch (it dispatches to the split model) through the real
    planner: the plan it ran and the logits error."""
    from transformers import AutoModelForCausalLM

    import hfsplit

    model = hfsplit.from_pretrained(checkpoint, max_memory, spec=TrainingSpec(method="full", seq_len=8, dtype="float32"),
                                  micro_batches=2, schedule=schedule, pp=pp, tp=tp, dp=1)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    logits = model(ids, broadcast=True)
    return {"layers": [s.layers for s in model.plan.stages], "stage_indices": model.stage_indices,
            "logits_diff": (logits - reference(ids).logits).abs().max().item(),
            "weight_bytes": model.weight_bytes(),
            "planned_weight_bytes": sum(model.plan.stages[i].memory.weights for i in model.stage_indices)}
