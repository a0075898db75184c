"""What the GRPO tests run on every rank (tests/parallel/launcher.py), and their reward functions."""
import torch


def length_reward(prompts, completions, **kwargs) -> list[float]:
    """The completion's length in characters over 10: varied on random completions."""
    return [len(c) / 10 for c in completions]


def vowel_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """The share of the completion's characters among "aeiou" plus the answer's digit (uses a column)."""
    return [sum(ch in "aeiou" + str(a) for ch in c) / max(len(c), 1) for c, a in zip(completions, answer)]


def fixed_completion_step(options: dict, completions: dict, steps: int = 1) -> dict:
    """On every rank: GRPO steps of `options` as its run trains them (`build_run`, `train_step`), the rollouts'
    completions the fixed `completions` (by prompt text, each prompt's in turn) instead of sampled ones; the last
    of `steps` without its optimizer step: its loss (every rank), this rank's trainable gradients by model name, its
    metrics, the first batch's prompts in order, and this rank's trainable weights before that step."""
    import hfsplit.objectives.grpo as grpo
    from hfsplit.training.options import tiny_demo_options
    from hfsplit.training.precision import compute_precision
    from hfsplit.training.run import build_run
    from hfsplit.training.trainer import train_step

    run = build_run(tiny_demo_options(**options), progress=False)
    first = next(run.batches)
    order = [run.batches.rows.records[i]["prompt"] for i in first["index"].tolist()]

    def fixed(run, prompts, *, seed):
        return [list(c) for prompt in order for c in completions[prompt]]

    sampled, grpo.sample_completions = grpo.sample_completions, fixed
    try:
        batch = first
        for _ in range(steps - 1):
            train_step(run, batch)
            batch = next(run.batches)
        weights = {n: p.detach().clone() for s in run.model.stages for n, p in s.named_parameters() if p.requires_grad}
        with compute_precision(run.model):
            rows = run.objective.step_rows(run, batch)
            loss = run.model.step(rows.input_ids, rows.targets, run.loss_fn, position_ids=rows.position_ids,
                                  num_items_in_batch=rows.divisor, **rows.forward)
    finally:
        grpo.sample_completions = sampled
    loss = run.model.reduce_loss(loss)
    grads = {n: p.grad.detach().clone() for s in run.model.stages for n, p in s.named_parameters()
             if p.grad is not None}
    metrics = run.objective.step_metrics(run)
    return dict(loss=loss, grads=grads, metrics=metrics, order=order, weights=weights)


def grpo_losses(options: dict) -> dict:
    """On every rank: the GRPO run `options` describe, trained; its losses and metrics.jsonl's rewards."""
    import json
    from pathlib import Path

    from hfsplit.training.options import tiny_demo_options
    from hfsplit.training.run import train

    options = tiny_demo_options(**options)
    result = train(options, progress=False)
    with open(Path(options.output_dir) / "metrics.jsonl") as f:
        records = [r for r in map(json.loads, f) if "reward" in r]
    return dict(losses=result.losses, records=records)


def rollout_generations(checkpoint: str, ids, mask, *, new: int, dp: int = 1) -> dict:
    """On every rank: the objectives' `generate` on `checkpoint` split over the ranks' pipeline stages (× `dp`
    replicas, each generating its share): greedy (and by the recomputing stand-in), and sampled twice with one seed
    (temperature, top-k, top-p, 3 sequences a prompt); with `dp` > 1 also how many rows this replica's pipeline
    generated (its `generate`'s batch)."""
    from hfsplit.load.launch import split_from_pretrained
    from hfsplit.objectives.rollout import generate, recompute_generate
    from hfsplit.plan import TrainingSpec

    model = split_from_pretrained(checkpoint, f"{2 * dp}x1GiB",
                                  spec=TrainingSpec(method="full", seq_len=32, dtype="float32"),
                                  micro_batches=2, pp=2, tp=1, dp=dp)
    batches, split_generate = [], model.generate

    def counted(input_ids, **kwargs):  # the prompts this replica's pipeline generates
        batches.append(len(input_ids))
        return split_generate(input_ids, **kwargs)

    model.generate = counted
    common = dict(attention_mask=mask, max_new_tokens=new, eos_token_id=3, pad_token_id=0)
    with torch.no_grad():
        greedy = generate(model, ids, **common)
        recomputed = recompute_generate(model, ids, **common)
        sampled = [generate(model, ids, do_sample=True, temperature=0.7, top_k=20, top_p=0.9, num_return_sequences=3,
                            seed=7, **common) for _ in range(2)]
    return dict(greedy=greedy, recomputed=recomputed, sampled=sampled, batches=batches)


def default_options_losses(options: dict) -> list[float]:
    """On every rank: a run of `FinetuneOptions(**options)`, every other option at its default (no tiny recipe)."""
    from hfsplit.training.options import FinetuneOptions
    from hfsplit.training.run import train

    options = FinetuneOptions(**options)
    options.validate()
    return train(options, progress=False).losses
