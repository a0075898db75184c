"""Checks that run inside each rank (started by tests/parallel/launcher.py).

Each returns plain data (numbers, names) for the parent test to assert on, so one
launch can run several checks.
"""
from __future__ import annotations

import torch

from hfsplit.models import varlen
from hfsplit.models.expert_lora import expert_parameters
from hfsplit.plan import TrainingSpec
from hfsplit.parallel.mesh import schedule_pp_rank
from hfsplit.plan import Plan, Stage, StageMemory


def hand_plan(config, *, tp: int, pp: int, layers: list[tuple[int, int]], schedule: str,
              micro_batches: int = 2, dp: int = 1, method: str = "full", seq_len: int = 8,
              host_embedding: bool = False) -> Plan:
    """A Plan built by hand: `layers[i]` is stage i's block range (pipeline order), fp32; `host_embedding`: the first
    stage's embedding table in host RAM."""
    zero = StageMemory(weights=0, gradients=0, optimizer=0, activations=0, reserve=0)
    stages = tuple(
        Stage(index=i, pp_rank=schedule_pp_rank(schedule=schedule, pp=pp, index=i), devices=tuple(tuple("cpu" for _ in range(tp)) for _ in range(dp)), layers=span,
              has_embed=i == 0, has_head=i == len(layers) - 1, memory=zero, budget=1, time_s=0.0,
              host_embedding=host_embedding and i == 0)
        for i, span in enumerate(layers)
    )
    return Plan(model="tiny", model_type=config.model_type, num_layers=config.num_hidden_layers, tp=tp, pp=pp,
                dp=dp, virtual_stages=len(layers) // pp, schedule=schedule, micro_batches=micro_batches,
                spec=TrainingSpec(method=method, seq_len=seq_len, dtype="float32"), stages=stages, step_time_s=0.0,
                bubble_fraction=0.0, tied_embeddings=bool(config.tie_word_embeddings),
                fused_experts=bool(expert_parameters(config)))


def reference_name(name: str, *, tied: bool) -> str:
    """The unsplit model's name of a stage parameter (a tied lm_head is the embedding)."""
    return "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """Next-token cross-entropy (labels are the input ids; the shift happens here), summed over `num_items_in_batch`
    (a split step's micro-batch: the step's tokens), or the mean of these."""
    total = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), reduction="sum")
    return total / (num_items_in_batch if num_items_in_batch is not None else labels[:, 1:].numel())


def split_matches_transformers(*, checkpoint: str, tp: int, pp: int, layers: list, schedule: str,
                               micro_batches: int = 2, new_tokens: int = 8, dtype: torch.dtype = torch.float32,
                               host_embedding: bool = False) -> dict:
    """Logits, one step's gradients and greedy generation of the split model against transformers, both in
    `dtype`; with `host_embedding`, the first stage's embedding table in host RAM (its gradient through the rows'
    copy to the device: full fine-tuning, which the planner never runs so, is the stricter check) and where it lives."""
    from transformers import AutoModelForCausalLM

    from hfsplit.checkpoint import load_config
    from hfsplit.parallel.mesh import init_parallel
    from hfsplit.parallel.split_model import build_split_model
    from hfsplit.apply.tp import full_tensor

    config = load_config(checkpoint)
    plan = hand_plan(config, tp=tp, pp=pp, layers=layers, schedule=schedule, micro_batches=micro_batches,
                     host_embedding=host_embedding)
    ctx = init_parallel(plan)
    model = build_split_model(plan, checkpoint, ctx=ctx, dtype=dtype)
    embeddings = [s.body.embed_tokens for s in model.stages if s.body.embed_tokens is not None]
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
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
    out["embedding_at"] = [(str(e.weight.device), str(getattr(e, "hfsplit_device", ctx.device))) for e in embeddings]
    out["host"], out["applied"] = str(ctx.host), [step.kind for step in model.plan.applied]
    out.update(packed_matches_transformers(model, reference, config, tied=plan.tied_embeddings))

    if new_tokens:
        got = model.generate(ids[:2, :5], max_new_tokens=new_tokens)
        want = reference.generate(ids[:2, :5], max_new_tokens=new_tokens, do_sample=False,
                                  attention_mask=torch.ones_like(ids[:2, :5]))
        out["generate_equal"] = torch.equal(got, want)
        out["generated"] = (got.tolist(), want.tolist())
    return out


# Two packed rows of 16: [A B C] and [D E] (longest first, as the packer lays them out). Examples longer than the
# tiny models' sliding windows (4 in hfsplit.checkpoint.synthetic), so a window crossing examples would show.
PACKED_LENGTHS = ([6, 5, 5], [9, 7])


def packed_batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[torch.Tensor]]]:
    """(ids, labels, position ids) of two packed rows, and each row's examples alone (as the packer builds them)."""
    from hfsplit.training.packing import pack_row

    gen = torch.Generator().manual_seed(5)
    examples = [[torch.randint(3, vocab_size, (n,), generator=gen) for n in row] for row in PACKED_LENGTHS]
    rows = [pack_row([(e.tolist(), e.tolist()) for e in row], seq_len=16, pad=0) for row in examples]
    ids, labels, positions = (torch.tensor([r[i] for r in rows]) for i in range(3))
    return ids, labels, positions, examples


def padded_batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, labels, position ids) of four rows of 16 padded after examples of 5, 12, 3 and 16 tokens: the two
    micro-batches hold 15 and 17 label tokens, so a mean of per-micro-batch means is not the token mean."""
    from hfsplit.training.packing import padded_rows

    gen = torch.Generator().manual_seed(6)
    examples = [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in (5, 12, 3, 16)]
    rows = padded_rows([(e, e) for e in examples], seq_len=16, pad=0)
    return rows.input_ids, rows.labels, rows.positions()


def packed_matches_transformers(model, reference, config, *, tied: bool) -> dict:
    """A packed row's logits against each of its examples run alone through transformers; and for packed rows and
    for padded rows of varying lengths, a step's token-mean loss and gradients against transformers' on the same
    rows (`position_ids`, `num_items_in_batch`)."""
    ids, labels, positions, examples = packed_batch(config.vocab_size)
    before = varlen.calls()
    logits = model(ids, position_ids=positions, broadcast=True)  # under sdpa example by example (models/varlen.py)
    varlen_ran = varlen.calls() > before
    with varlen.block_masks():  # transformers' block-diagonal mask
        block_logits = model(ids, position_ids=positions, broadcast=True)
    with torch.no_grad():
        alone = torch.stack([torch.cat([reference(input_ids=e[None]).logits[0] for e in row]) for row in examples])
    out = {"packed_logits_diff": (logits - alone).abs().max().item(), "varlen_ran": varlen_ran,
           "attention": model.stages[0].config._attn_implementation,
           "block_mask_logits_diff": (block_logits - alone).abs().max().item()}
    for name, batch, alone_rows in (("packed", (ids, labels, positions), examples),
                                    ("padded", padded_batch(config.vocab_size), None)):
        out.update({f"{name}_{key}": value for key, value in step_matches_transformers(
            model, reference, config, *batch, tied=tied, examples=alone_rows).items()})
    out["packed_grad_spread"] = float64_spread(reference, config, labels, examples)
    # as under flash attention: each micro-batch runs as one row of its rows joined (run here under sdpa); rows whose
    # first label is not -100 (plain rows, labels = ids) must not let a row's last token learn the next one's first
    model.join_rows = True
    try:
        out["joined_logits_diff"] = (model(ids, position_ids=positions, broadcast=True) - alone).abs().max().item()
        plain = torch.randint(3, config.vocab_size, (4, 8), generator=torch.Generator().manual_seed(7))
        steps = step_matches_transformers(model, reference, config, plain, plain, None, tied=tied)
    finally:
        model.join_rows = False
    out.update({f"joined_{key}": value for key, value in steps.items()})
    out["joined_grad_spread"] = float64_spread(reference, config, plain, [[row] for row in plain])
    return out


def float64_spread(reference, config, labels, examples) -> dict:
    """Each parameter's relative gradient difference between transformers' fp32 model and a float64 copy of it, the
    packed rows' examples each run alone: how far fp32 rounding moves transformers itself from (nearly) the exact
    answer, which a recurrence amplifies in its decay parameters (Qwen3-Next: about 1e-3 on them)."""
    import copy

    from hfsplit.models.loss import causal_lm_loss
    from hfsplit.models.packed_recurrence import recurrent_mixer
    from hfsplit.training.packing import label_tokens

    def gradients(model, dtype) -> dict:
        for p in model.parameters():
            p.grad = None
        logits = torch.stack([torch.cat([model(input_ids=e[None], use_cache=False).logits[0] for e in row])
                              for row in examples])
        causal_lm_loss(config.vocab_size)(logits.to(dtype), labels, num_items_in_batch=label_tokens(labels)).backward()
        return {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}

    if not any(recurrent_mixer(block) is not None for block in reference.modules()):
        return {}  # nothing amplifies: held to 1e-5
    fp32 = gradients(reference, torch.float32)
    double = copy.deepcopy(reference).double()
    double.config._experts_implementation = "eager"  # grouped_mm has no float64
    exact = gradients(double, torch.float64)
    for p in reference.parameters():
        p.grad = None
    return {n: ((fp32[n] - exact[n]).abs().max() / exact[n].abs().max().clamp_min(1e-12)).item() for n in fp32}


def step_matches_transformers(model, reference, config, ids, labels, positions, *, tied: bool,
                              examples=None) -> dict:
    """One split step on the rows against transformers (+ its token-mean loss): the loss on the last stage and
    each parameter's relative gradient difference. With `examples` (each packed row's examples, filling it),
    transformers runs each example alone, its logits laid out as the packed rows: transformers' own forward of a
    packed row isolates attention by the position ids but lets a recurrent layer's state cross examples."""
    from hfsplit.apply.tp import full_tensor
    from hfsplit.training.packing import label_tokens
    from hfsplit.models.loss import causal_lm_loss

    for p in list(model.parameters()) + list(reference.parameters()):
        p.grad = None
    loss_fn = causal_lm_loss(config.vocab_size)
    loss = model.step(ids, labels, loss_fn, position_ids=positions)  # the step counts the items itself
    if examples is None:
        ref_logits = reference(input_ids=ids, position_ids=positions, use_cache=False).logits
    else:
        assert all(sum(len(e) for e in row) == ids.shape[1] for row in examples)
        ref_logits = torch.stack([torch.cat([reference(input_ids=e[None], use_cache=False).logits[0] for e in row])
                                  for row in examples])
    ref_loss = loss_fn(ref_logits, labels, num_items_in_batch=label_tokens(labels))
    ref_loss.backward()
    out = {"loss_diff": (loss - ref_loss).abs().item()} if loss is not None else {}
    out["grad_rel_diff"] = {
        name: ((full_tensor(p.grad) - ref.grad).abs().max() / ref.grad.abs().max().clamp_min(1e-12)).item()
        for stage in model.stages for name, p in stage.named_parameters()
        for ref in [reference.get_parameter(reference_name(name, tied=tied))]}
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


def tp_proof_errors(*, folders: list[str]) -> list[tuple[str, str]]:
    """(error type, message) each rank raises from `shared_tp_proof` on each folder under a tp=2 plan (("", "") when
    none): rank 0 alone reads the folder and runs the proof; a wait on a peer gives up after 60 s."""
    from hfsplit.checkpoint.synthetic import tiny_config
    from hfsplit.load.launch import shared_tp_proof
    from hfsplit.parallel.mesh import init_distributed

    init_distributed(timeout_s=60)
    plan = hand_plan(tiny_config("llama"), tp=2, pp=1, layers=[(0, 2)], schedule="GPipe")
    out = []
    for folder in folders:
        try:
            shared_tp_proof(folder, plan)
            out.append(("", ""))
        except Exception as exc:
            out.append((type(exc).__name__, str(exc)))
    return out


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


def default_intent_runs(*, checkpoint: str, max_memory: str) -> dict:
    """`hfsplit.from_pretrained(checkpoint, max_memory)` under a launch, no intent given: what it planned, what the
    training plans of the same budget raised, and its greedy continuation against transformers'."""
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    import hfsplit
    from hfsplit.errors import PlanError
    from hfsplit.load.launch import spec_of_intent
    from hfsplit.planning.planner import make_plan

    refused = {}
    for training in ("lora", "full"):
        try:
            make_plan(checkpoint, max_memory, spec=replace(spec_of_intent(training, dtype="float32"), reserve_bytes=0),
                      world_size=2)
            refused[training] = ""
        except PlanError as exc:
            refused[training] = str(exc)
    model = hfsplit.from_pretrained(checkpoint, max_memory)
    prompt = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))
    ours = model.generate(prompt, max_new_tokens=5)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    theirs = reference.generate(prompt, max_new_tokens=5, do_sample=False, eos_token_id=None,
                                min_new_tokens=5, pad_token_id=0)
    return {"method": model.plan.spec.method, "refused": refused, "generated": ours.tolist(),
            "expected": theirs.tolist(), "kv_bytes": [s.memory.activations for s in model.plan.stages]}


def steps_by_method(*, checkpoint: str, single: bool = False) -> dict:
    """For each method, `hfsplit.from_pretrained` under a training plan with checkpointing (QLoRA: with a
    BitsAndBytesConfig): the steps its plan lists and those the load applied, on one process or on a rank."""
    import hfsplit
    from hfsplit.apply.quantize import quantization_config

    out = {}
    for method in ("lora", "qlora", "full"):
        spec = TrainingSpec(method=method, seq_len=16, dtype="float32", activation_checkpointing=True, reserve_bytes=0)
        qconfig = quantization_config(compute_dtype="float32") if method == "qlora" else None
        split = {} if single else dict(micro_batches=2, pp=2, tp=1, dp=1)
        model = hfsplit.from_pretrained(checkpoint, {"cpu": "8GiB"} if single else "2x4GiB", training=method,
                                        spec=spec, quantization_config=qconfig, activation_checkpointing=True, **split)
        plan = model.hfsplit_plan if single else model.plan
        out[method] = {"steps": plan.steps(), "applied": plan.applied}
    return out
