"""What each rank checks on the real pretrained SmolLM2-135M-Instruct (see tests/parallel/test_smollm2.py)."""
from __future__ import annotations

import torch

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def smollm2_pp2_generates_and_learns(*, checkpoint: str, out: str, steps: int) -> dict:
    """One launch, two checks: the pp=2 split's greedy answer to a chat prompt against transformers', then a
    LoRA fine-tune on the bundled chat data, with the held-out loss before and after."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfsplit.training.data import bundled_dataset_path
    from hfsplit.training.options import tiny_demo_options
    from hfsplit.training.run import build_run
    from hfsplit.training.trainer import eval_loss, train_step

    options = tiny_demo_options(model=checkpoint, dataset=str(bundled_dataset_path("tiny_chat.jsonl")),
                              dataset_format="chat", method="lora", seq_len=64, micro_batch_size=2, micro_batches=2,
                              pp=2, dtype="float32", learning_rate=3e-3, warmup_steps=0, max_steps=steps,
                              eval_every=steps, output_dir=out)
    run = build_run(options, progress=False)  # LoRA's B starts at zero: the adapted model equals the base
    model = run.model
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    got = model.generate(ids, max_new_tokens=12)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    want = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    del reference
    answer = tokenizer.decode(got[0, ids.shape[1]:], skip_special_tokens=True)

    def held_out_loss() -> float:
        return eval_loss(model, run.held_out, run.loss_fn, micro_batch_size=options.micro_batch_size)

    before = held_out_loss()
    losses = [train_step(run, next(run.batches)).loss for _ in range(steps)]
    return {"generate_equal": torch.equal(got, want), "answer": answer, "layers": [s.layers for s in model.plan.stages],
            "eval_before": before, "eval_after": held_out_loss(), "losses": losses}


def smollm2_step_memory_against_plan(*, checkpoint: str, out: str, method: str, seq_len: int, micro_batch_size: int,
                                     micro_batches: int) -> dict:
    """One rank, fp32: the bytes one real training step holds at its peak (weights, optimizer state, and the
    tensors alive during the step as counted by costs' dispatch-mode counter) against the plan's stage total."""
    from hfsplit.planning.costs.trace import LiveBytes as _LiveBytes
    from hfsplit.training.data import bundled_dataset_path
    from hfsplit.training.options import tiny_demo_options
    from hfsplit.training.run import build_run
    from hfsplit.training.trainer import train_step

    options = tiny_demo_options(model=checkpoint, method=method, seq_len=seq_len, micro_batch_size=micro_batch_size,
                              micro_batches=micro_batches, max_steps=2, pp=1, tp=1, dtype="float32", warmup_steps=0,
                              dataset=str(bundled_dataset_path("tiny_text.txt")), dataset_format="text",
                              output_dir=out)
    run = build_run(options, progress=False)
    model = run.model
    peaks, step = [], model.step

    def counted_step(*args, **kwargs):
        with _LiveBytes() as live:
            result = step(*args, **kwargs)
        peaks.append(live.peak)
        return result

    model.step = counted_step
    for _ in range(2):  # the second step is measured: AdamW's moments exist, the schedule is built
        train_step(run, next(run.batches))
    params = sum(p.untyped_storage().nbytes() for p in {id(p): p for p in model.parameters()}.values())
    # The plan counts gradients inside its figure; here they are created during the step, so in the live peak.
    optimizer_bytes = sum(p.numel() * 8 for p in model.parameters() if p.requires_grad)  # AdamW's two fp32 moments
    return {"measured": params + optimizer_bytes + peaks[-1], "plan": model.plan.stages[0].memory.total,
            "step_peak": peaks[-1], "plan_activations": model.plan.stages[0].memory.activations}
