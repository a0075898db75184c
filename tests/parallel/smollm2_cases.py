"""What each rank checks on the real pretrained SmolLM2-135M-Instruct (see tests/parallel/test_smollm2.py)."""
from __future__ import annotations

import torch

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def smollm2_pp2_generates_and_learns(*, checkpoint: str, out: str, steps: int) -> dict:
    """One launch, two checks: the pp=2 split's greedy answer to a chat prompt against transformers', then a
    LoRA fine-tune on the bundled chat data, with the held-out loss before and after."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfsplit.parallel.split_model import split_from_pretrained
    from hfsplit.training.data import bundled_dataset_path, load_token_rows
    from hfsplit.training.options import FinetuneOptions
    import torch.distributed as dist

    from hfsplit.training.trainer import causal_lm_loss, eval_loss, plan_of_run, split_eval_rows, train

    options = FinetuneOptions(model=checkpoint, dataset=str(bundled_dataset_path("tiny_chat.jsonl")),
                              dataset_format="chat", method="lora", seq_len=64, micro_batch_size=2, micro_batches=2,
                              pp=2, dtype="float32", learning_rate=3e-3, warmup_steps=0, max_steps=steps,
                              eval_every=steps, output_dir=out)
    dist.init_process_group("gloo")  # the plan is made on rank 0 and shared
    model = split_from_pretrained(checkpoint, plan=plan_of_run(options, model_path=checkpoint), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    got = model.generate(ids, max_new_tokens=12)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    want = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    del reference
    answer = tokenizer.decode(got[0, ids.shape[1]:], skip_special_tokens=True)

    rows = load_token_rows(options.dataset, tokenizer, seq_len=options.seq_len, format="chat")
    held_out = split_eval_rows(rows, options)[1]
    before = eval_loss(model, held_out, causal_lm_loss(model.config.vocab_size), micro_batch_size=2)
    result = train(options, model=model, rows=rows, progress=False)
    return {"generate_equal": torch.equal(got, want), "answer": answer, "layers": [s.layers for s in model.plan.stages],
            "eval_before": before, "eval_after": result.eval_losses[-1], "losses": result.losses}


def smollm2_step_memory_against_plan(*, checkpoint: str, out: str, method: str, seq_len: int, micro_batch_size: int,
                                     micro_batches: int) -> dict:
    """One rank, fp32: the bytes one real training step holds at its peak (weights, optimizer state, and the
    tensors alive during the step as counted by costs' dispatch-mode counter) against the plan's stage total."""
    import torch.distributed as dist

    from hfsplit.costs import _LiveBytes
    from hfsplit.training.data import TokenRows
    from hfsplit.training.options import FinetuneOptions
    from hfsplit.training.trainer import plan_of_run, train

    dist.init_process_group("gloo")
    options = FinetuneOptions(model=checkpoint, method=method, seq_len=seq_len, micro_batch_size=micro_batch_size,
                              micro_batches=micro_batches, max_steps=2, pp=1, tp=1, dtype="float32", warmup_steps=0,
                              output_dir=out)
    model = _split_model(checkpoint, plan_of_run(options, model_path=checkpoint))
    peaks, step = [], model.step

    def counted_step(*args, **kwargs):
        with _LiveBytes() as live:
            result = step(*args, **kwargs)
        peaks.append(live.peak)
        return result

    model.step = counted_step
    ids = torch.randint(3, model.config.vocab_size, (micro_batch_size * micro_batches * 2, seq_len),
                        generator=torch.Generator().manual_seed(0))
    train(options, model=model, rows=TokenRows(ids, ids.clone()), progress=False)
    params = sum(p.untyped_storage().nbytes() for p in {id(p): p for p in model.parameters()}.values())
    # The plan counts gradients inside its figure; here they are created during the step, so in the live peak.
    optimizer_bytes = sum(p.numel() * 8 for p in model.parameters() if p.requires_grad)  # AdamW's two fp32 moments
    return {"measured": params + optimizer_bytes + peaks[-1], "plan": model.plan.stages[0].memory.total,
            "step_peak": peaks[-1], "plan_activations": model.plan.stages[0].memory.activations}


def _split_model(checkpoint: str, plan):
    from hfsplit.parallel.split_model import split_from_pretrained

    return split_from_pretrained(checkpoint, plan=plan, dtype=torch.float32)
