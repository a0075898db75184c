"""GRPO (issue 31): TRL's GRPOTrainer is the oracle. For the same prompts, completions and rewards, one step's loss
and gradients through the split stages equal `GRPOTrainer._compute_loss`'s (fp32, within rel 1e-4), its advantages
and figures TRL's; on the bundled task the mean reward rises."""
import json
import math

import pytest
import torch

from hfsplit.objectives.rewards import group_advantages, load_reward_functions
from hfsplit.training.options import FinetuneOptions, tiny_demo_options

FUNCS = ["tests.objectives.grpo_cases:length_reward", "tests.objectives.grpo_cases:vowel_reward"]
PROMPTS = (("1+2=", "3"), ("2+2=", "4"))


def fixed_completions(seed: int = 0, *, generations: int = 4, limit: int = 8) -> dict:
    """Each prompt's completions: random tokens of varied lengths, odd ones ending in EOS (3), one at the limit."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for prompt, _ in PROMPTS:
        lengths = [3, 5, limit, 2, 6, 4, 7, 1][:generations]
        out[prompt] = [torch.randint(4, 256, (n - (n % 2),), generator=g).tolist() + ([3] if n % 2 else [])
                       for n in lengths]
    return out


def prompt_file(tmp_path) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in PROMPTS))
    return str(path)


def grpo_run(model: str, tmp_path, **overrides) -> dict:
    return {**dict(model=model, objective="grpo", method="lora", lora_dropout=0.0, seq_len=32, micro_batch_size=2,
                   micro_batches=4, num_generations=4, max_completion_length=8, pp=2, max_memory="2x1GiB",
                   dtype="float32", dataset=prompt_file(tmp_path), reward_funcs=FUNCS, reward_weights=[1.0, 0.5],
                   output_dir=str(tmp_path / "grpo"), max_steps=1, schedule="1F1B"), **overrides}


def trl_step(options: FinetuneOptions, order: list[str], completions: dict, weights: dict | None = None) -> dict:
    """TRL's GRPOTrainer on the same model (LoRA: hfsplit's seeded adapters), prompts and completions (its `rollout_func`
    hands them back instead of generating), in fp32: its loss and adapter gradients of `_compute_loss`, and its
    metrics. `weights`: the trainable weights (by model name) the loss is computed with, after the rollout was
    scored with the seeded ones (a later iteration of `num_iterations`); None: the seeded ones."""
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from hfsplit.apply.lora import lora_config, seed_lora_weights
    from hfsplit.training.run import tokenizer_for

    tokenizer = tokenizer_for(options, model_path=options.model)
    model = AutoModelForCausalLM.from_pretrained(options.model, dtype=torch.float32)
    if options.method != "full":
        model = get_peft_model(model, lora_config(r=options.lora_r, alpha=options.lora_alpha, dropout=0.0,
                                                  targets=options.lora_targets, model_config=model.config))
        seed_lora_weights(model, seed=options.seed)
    seeded = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    queue = [c for prompt in order for c in completions[prompt]]

    def rollout(prompts, trainer):
        return {"prompt_ids": [tokenizer(p)["input_ids"] for p in prompts], "completion_ids": queue, "logprobs": None}

    args = GRPOConfig(output_dir=options.output_dir + "-trl", use_cpu=True, bf16=False, gradient_checkpointing=False,
                      per_device_train_batch_size=len(queue), num_generations=options.num_generations,
                      max_completion_length=options.max_completion_length, beta=options.beta,
                      loss_type=options.loss_type, epsilon=options.epsilon, scale_rewards=options.scale_rewards,
                      reward_weights=options.reward_weights, temperature=options.temperature, report_to=[],
                      num_iterations=options.num_iterations, seed=options.seed, logging_steps=1)
    funcs = list(load_reward_functions(options.reward_funcs).functions)
    records = [{"prompt": p, "answer": a} for p, a in PROMPTS]
    trainer = GRPOTrainer(model=model, reward_funcs=funcs, args=args, train_dataset=Dataset.from_list(records),
                          processing_class=tokenizer, rollout_func=rollout)
    for name, param in trainer.model.named_parameters():
        if param.requires_grad:
            param.data = seeded[name]
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    answers = dict(PROMPTS)
    inputs = trainer._generate_and_score_completions(
        [{"prompt": p, "answer": answers[p]} for p in order for _ in range(options.num_generations)])
    if weights is not None:
        for name, param in trainer.model.named_parameters():
            if param.requires_grad:
                param.data = weights[name.removeprefix("base_model.model.")].clone()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n.removeprefix("base_model.model."): p.grad for n, p in trainer.model.named_parameters()
             if p.grad is not None}
    return dict(loss=float(loss), grads=grads, metrics={k: v[-1] for k, v in trainer._metrics["train"].items()})


def assert_step_equals_trl(run: dict, results: list[dict], completions: dict, *, steps: int = 1,
                           rtol: float = 1e-4) -> dict:
    """Every rank's loss equals TRL's; the ranks' gradients together are TRL's, each within `rtol` (relative to the
    largest of its tensor); the logged figures TRL's. The worst relative differences."""
    options = tiny_demo_options(**run)
    # after steps before it, TRL's loss with the weights they trained (the rollout scored with the starting ones:
    # the generating policy's log-probs of a later iteration)
    weights = {n: w for r in results for n, w in r["weights"].items()} if steps > 1 else None
    trl = trl_step(options, results[0]["order"], completions, weights)
    assert all(r["loss"] == results[0]["loss"] for r in results)
    # on a fresh rollout the ratios are 1 and each group's advantages sum to 0: the loss is 0 but for rounding
    # (and the KL term), its gradients are not
    worst = {"loss": abs(results[0]["loss"] - trl["loss"]) / max(abs(trl["loss"]), 1e-2)}
    assert worst["loss"] < rtol, (results[0]["loss"], trl["loss"])
    ours = {n: g for r in results for n, g in r["grads"].items()}
    assert set(ours) == set(trl["grads"]), sorted(set(ours) ^ set(trl["grads"]))[:4]
    worst["grads"] = max(float((ours[n] - g).abs().max() / g.abs().max().clamp(min=1e-30)) for n, g in trl["grads"].items())
    assert worst["grads"] < rtol
    metrics = results[0]["metrics"]
    for key, theirs in trl["metrics"].items():
        if key in metrics:
            assert metrics[key] == pytest.approx(theirs, rel=rtol, abs=1e-6), key
    assert {"reward", "reward_std", "completions/mean_length", "clip_ratio/region_mean",
            "rewards/length_reward/mean"} <= set(metrics)
    assert ("kl" in metrics) == bool(options.beta)
    print(run["output_dir"], "worst rel diff vs TRL:", {k: f"{v:.1e}" for k, v in worst.items()})
    return worst


# the second iteration on one rollout (num_iterations=2): the policy has moved from the one that generated (the old
# log-probs) and from the reference (beta > 0: the KL term and its gradient), and some ratios are clipped
ITERATED = dict(beta=0.04, num_iterations=2, learning_rate=0.05, warmup_steps=0, max_grad_norm=100.0)


@pytest.mark.slow
@pytest.mark.parametrize("overrides, steps, ranks", [
    (ITERATED, 2, 2), (dict(loss_type="grpo", scale_rewards="batch"), 1, 2),
    (dict(method="full", micro_batches=2, max_memory="4x1GiB", loss_type="dr_grpo", learning_rate=1e-3,
          warmup_steps=0), 2, 4)], ids=["lora-beta-dapo-iteration2", "lora-grpo-batch", "full-pp2xdp2-dr_grpo"])
def test_grpo_at_pp2_equals_trl_compute_loss(tiny_checkpoint, tmp_path, overrides, steps, ranks):
    """Two pipeline stages (× two data-parallel replicas for full fine-tuning), LoRA's reference the same stages with
    the adapters off (beta > 0): a step's loss and gradients equal TRL's `_compute_loss` on the same completions
    within rel 1e-4, its figures TRL's."""
    from tests.parallel.launcher import launch

    run = grpo_run(str(tiny_checkpoint("llama")), tmp_path, **overrides)
    completions = fixed_completions()
    results = launch("tests.objectives.grpo_cases:fixed_completion_step", world_size=ranks,
                     kwargs={"options": run, "completions": completions, "steps": steps}, timeout_s=900)
    assert_step_equals_trl(run, results, completions, steps=steps)
    if steps > 1 and run.get("beta"):  # the terms a first step leaves at zero are there
        metrics = results[0]["metrics"]
        assert metrics["kl"] > 1e-4 and metrics["clip_ratio/region_mean"] > 0, metrics


def test_advantages_are_trls_group_normalised_rewards():
    """(r − group mean) / (group std (n − 1) + 1e-4), weighted sums of the functions, NaN-aware; "batch" divides by
    the batch's std, "none" not at all."""
    table = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, float("nan")], [0.5, 0.5]])
    weights = torch.tensor([1.0, 0.5])
    rewards = torch.tensor([1.0, 0.5, 2.0, 0.75])
    groups = rewards.view(2, 2)
    expected = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)
    assert torch.allclose(group_advantages(table, weights, groups=2, scale="group"), expected.reshape(-1))
    assert torch.allclose(group_advantages(table, weights, groups=2, scale="batch"),
                          ((groups - groups.mean(1, keepdim=True)) / (rewards.std() + 1e-4)).reshape(-1))
    assert torch.allclose(group_advantages(table, weights, groups=2, scale="none"),
                          (groups - groups.mean(1, keepdim=True)).reshape(-1))


def test_grpo_options_take_trls_defaults_and_refuse_what_cannot_run():
    from hfsplit.errors import HfsplitError

    options = FinetuneOptions(model="m", objective="grpo")
    options.validate()
    assert (options.beta, options.loss_type, options.epsilon, options.num_generations, options.scale_rewards,
            options.num_iterations, options.micro_batch_size) == (0.0, "dapo", 0.2, 8, "group", 1, 1)
    # a step's rows are whole groups by default (a micro-batch count the user gives, or a global batch, stays theirs)
    assert options.micro_batches == 8 and FinetuneOptions(model="m", objective="grpo", num_generations=4).micro_batches == 4
    assert FinetuneOptions(model="m", objective="grpo", micro_batches=16).micro_batches == 16
    assert FinetuneOptions(model="m", objective="grpo", global_batch=16).micro_batches is None
    from trl import GRPOConfig

    assert options.max_completion_length == GRPOConfig.max_completion_length == 512  # TRL's, where seq 2048 has room
    assert FinetuneOptions(model="m", objective="grpo", seq_len=128).max_completion_length == 64
    for bad, match in ((dict(beta=0.1, method="full"), "--method full has none"),
                       (dict(num_generations=1), "--num-generations"), (dict(eval_every=5), "--eval-every"),
                       (dict(max_completion_length=4096), "--seq-len")):
        with pytest.raises(HfsplitError, match=match):
            FinetuneOptions(model="m", objective="grpo", **bad).validate()
    with pytest.raises(HfsplitError, match="no function nothing"):
        load_reward_functions(["hfsplit.objectives.rewards:nothing"])
    assert not math.isnan(load_reward_functions(FUNCS, [1, 2]).weights.sum())


@pytest.mark.slow
def test_the_tiny_grpo_recipe_raises_the_mean_reward_over_30_steps(tmp_path):
    """The recipe (recipes/tiny/grpo.yaml: the built-in tiny Llama, full fine-tuning at pp=2, the bundled "a+b="
    prompts and their verifiable rewards): the mean reward of the last 10 steps is well above that of the first 5
    (measured 0.033 → 0.37); TRL's figures are in metrics.jsonl and TensorBoard under TRL's names."""
    from pathlib import Path

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hfsplit.training.options import recipe_values
    from tests.parallel.launcher import launch

    recipe = recipe_values(Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "grpo.yaml")
    run = {**recipe, "output_dir": str(tmp_path / "grpo"), "max_memory": "2x2GiB"}
    results = launch("tests.objectives.grpo_cases:grpo_losses", world_size=2, kwargs={"options": run},
                     timeout_s=900)
    records = results[0]["records"]
    assert len(records) == 30
    rewards = [r["reward"] for r in records]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    assert last > 3 * first and last - first > 0.1, rewards
    names = ("reward", "reward_std", "rewards/answer_correct/mean", "rewards/digits_only/mean",
             "completions/mean_length", "clip_ratio/region_mean", "entropy")
    events = [EventAccumulator(str(p.parent)).Reload() for p in (tmp_path / "grpo" / "tensorboard").rglob(
        "events.out.tfevents.*")]
    for key in names:
        scalars = sorted((s.step, s.value) for e in events if key in e.Tags()["scalars"] for s in e.Scalars(key))
        assert [v for _, v in scalars] == pytest.approx([r[key] for r in records], rel=1e-6, abs=1e-7), key


@pytest.mark.slow
@pytest.mark.parametrize("dp", [1, 2])
def test_rollouts_on_two_stages_equal_transformers_generate_with_left_padding(tiny_checkpoint, dp):
    """The objectives' generation (`hfsplit.objectives.rollout.generate`: `SplitModel.generate`, and the recomputing
    stand-in) on two pipeline stages: greedy output of left-padded prompts of different lengths equals transformers'
    `generate` with the attention mask on the whole model; a seeded draw is the same on every rank and run to run, each
    prompt's sequences next to each other. With two data-parallel replicas each generates its share of the prompts
    (2 and 1 of the 3) and every rank returns the whole batch."""
    from transformers import AutoModelForCausalLM

    from tests.parallel.launcher import launch

    checkpoint = str(tiny_checkpoint("llama"))
    prompts = [[5, 9, 17, 33, 60], [12, 7], [90, 91, 92]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    results = launch("tests.objectives.grpo_cases:rollout_generations", world_size=2 * dp,
                     kwargs={"checkpoint": checkpoint, "ids": ids, "mask": mask, "new": 8, "dp": dp}, timeout_s=600)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=3,
                              pad_token_id=0)
    for result in results:
        assert torch.equal(result["greedy"], expected) and torch.equal(result["recomputed"], expected)
        first, second = result["sampled"]
        assert torch.equal(first, second) and torch.equal(first, results[0]["sampled"][0])
        assert first.shape[0] == 9 and torch.equal(first[:, :width], ids.repeat_interleave(3, dim=0))
    # each replica's pipeline generated its prompts only (greedy, then two draws): replica 0 prompts 0-1, 1 prompt 2
    assert [r["batches"] for r in results] == ([[3] * 3] * 2 if dp == 1 else [[2] * 3] * 2 + [[1] * 3] * 2)


def test_prompts_are_read_as_trl_reads_them_standard_or_conversational(tmp_path):
    """A "prompt" column of text (tokenized with the tokenizer's special tokens) or of messages (the chat template
    with the generation prompt); the other columns travel with each row for the reward functions; a prompt leaving no
    room for the completion is refused by row."""
    from hfsplit.checkpoint.synthetic import tiny_tokenizer
    from hfsplit.objectives.grpo import load_prompt_rows
    from hfsplit.training.data import DatasetError

    tokenizer = tiny_tokenizer()
    standard, chat = tmp_path / "standard.jsonl", tmp_path / "chat.jsonl"
    standard.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in PROMPTS))
    chat.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": p}], "answer": a}) + "\n"
                            for p, a in PROMPTS))
    rows = load_prompt_rows(str(standard), tokenizer, seq_len=32, room=8)
    assert list(rows.prompt_ids[0]) == tokenizer("1+2=")["input_ids"] and rows.records[1]["answer"] == "4"
    assert not rows.conversational and (rows.labels == -100).all()
    talk = load_prompt_rows(str(chat), tokenizer, seq_len=64, room=8)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False,
                                             add_generation_prompt=True)
    assert talk.conversational and list(talk.prompt_ids[0]) == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    with pytest.raises(DatasetError, match="row 0"):
        load_prompt_rows(str(chat), tokenizer, seq_len=16, room=8)


def test_grpo_runs_on_its_defaults_as_one_process(tmp_path):
    """`python -m hfsplit.finetune --objective grpo` with nothing else (the built-in tiny model, seq 128, one rank):
    the objective's defaults hold together (a step's rows whole groups, a completion that leaves the prompt room)."""
    import subprocess
    import sys

    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "hfsplit.finetune", "--objective", "grpo", "--max-steps", "1",
                           "--output-dir", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1] and "reward" in records[1]
