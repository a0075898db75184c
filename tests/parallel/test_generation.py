"""Generation on the split stages (issue 31): greedy output equals transformers' `generate` on the unsplit model for
left-padded prompts of different lengths, in every micro-batch cut; sampling runs transformers' own logits
processors."""
import pytest
import torch

SPLITS = {
    # name: (arch, tied, ranks, split, sampling checks too)
    "llama-pp2-1f1b": ("llama", False, 2, dict(tp=1, pp=2, layers=[(0, 2), (2, 4)], schedule="1F1B"), True),
    "qwen2-tied-pp2xtp2": ("qwen2", True, 4, dict(tp=2, pp=2, layers=[(0, 3), (3, 4)], schedule="1F1B"), True),
    # two stages a rank (the V shape: rank 0 holds the first and the last), sliding-window attention
    "mistral-pp2-zbv": ("mistral", False, 2,
                        dict(tp=1, pp=2, layers=[(0, 1), (1, 2), (2, 3), (3, 4)], schedule="ZBVZeroBubble"), False),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPLITS))
def test_split_generation_matches_transformers(name, launch, tiny_checkpoint):
    arch, tied, ranks, split, sampling = SPLITS[name]
    results = launch("tests.parallel.generation_cases:generation_matches_transformers", world_size=ranks,
                     kwargs=dict(checkpoint=str(tiny_checkpoint(arch, tied=tied)), sampling=sampling, **split),
                     timeout_s=300)
    for r in results:
        assert len(r["got"]) == 6
        for cut, got in r["got"].items():  # "1x1": the relay; "5x1": a row a micro-batch; "2x3": prompts in 3 passes
            assert got == r["expected"], (cut, got, r["expected"])
            assert r["got_eos"][cut] == r["expected_eos"], (cut, r["got_eos"][cut], r["expected_eos"])
        assert r["expected_eos"][0][-1] == 0 != r["expected"][0][-1]  # row 0 ended early: padded after its eos
        if sampling:
            assert r["same_seed_equal"] and r["other_seed_differs"]
            assert r["top1_is_greedy"] and r["in_top3"]
            assert r["pairs_shape"] == (10, 13) and r["pairs_prompts_equal"]


@pytest.mark.parametrize("options", [
    dict(do_sample=True, temperature=0.7, top_k=5, top_p=0.9),
    dict(do_sample=True, temperature=1.3, top_k=0, top_p=0.5),
    dict(do_sample=True),  # the config's defaults (transformers' top_k=50)
    dict(do_sample=False, repetition_penalty=1.3),
])
def test_processed_distributions_equal_transformers(options, tiny_checkpoint):
    """The scores the split model samples from are those transformers' `generate` samples from for the same logits:
    its own model's `_get_logits_processor`, and the warpers built by hand in transformers' order."""
    from transformers import (
        AutoModelForCausalLM, LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
        TopKLogitsWarper, TopPLogitsWarper,
    )

    from hfsplit.parallel.generation import generation_config_for, logits_processors, merged_generation_config

    checkpoint = str(tiny_checkpoint("llama"))
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    config = merged_generation_config(generation_config_for(reference.config, checkpoint), **options)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 256, (4, 6), generator=gen)
    logits = torch.randn(4, reference.config.vocab_size, generator=gen) * 3
    ours = logits_processors(reference.config, config, prompt=prompt)(prompt, logits.clone())
    theirs = reference._get_logits_processor(generation_config=config, input_ids_seq_length=6,
                                             encoder_input_ids=prompt, device=prompt.device)(prompt, logits.clone())
    by_hand = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(config.repetition_penalty)]
                                  if config.repetition_penalty != 1.0 else [])
    if config.do_sample:
        by_hand += [w for w in (TemperatureLogitsWarper(config.temperature) if config.temperature != 1.0 else None,
                                TopKLogitsWarper(config.top_k) if config.top_k else None,
                                TopPLogitsWarper(config.top_p) if config.top_p < 1.0 else None) if w is not None]
    expected = by_hand(prompt, logits.clone())
    assert torch.equal(ours, theirs)
    assert torch.allclose(torch.softmax(ours, -1), torch.softmax(expected, -1), atol=0, rtol=0)
    if options.get("top_k"):
        assert ((torch.softmax(ours, -1) > 0).sum(-1) <= options["top_k"]).all()


def test_generation_config_refuses_an_unknown_argument(tiny_checkpoint):
    from transformers import AutoConfig

    from hfsplit.parallel.generation import generation_config_for, merged_generation_config

    base = generation_config_for(AutoConfig.from_pretrained(str(tiny_checkpoint("llama"))))
    with pytest.raises(TypeError, match="top_q"):
        merged_generation_config(base, top_q=0.5)


@pytest.mark.slow
def test_distributed_from_pretrained_has_the_transformers_surface(launch, tiny_checkpoint, tmp_path):
    """Issue 33: under a launch, `hfsplit.from_pretrained` with no budget plans on each rank's share of what is
    free, and its model has the single-process surface; whole-model attributes raise an hfsplit error saying why."""
    checkpoint = str(tiny_checkpoint("llama"))
    results = launch("tests.parallel.generation_cases:distributed_surface", world_size=2,
                     kwargs=dict(checkpoint=checkpoint, out=str(tmp_path / "saved")), timeout_s=300)
    layers = results[0]["layers"]
    expected = {"model.embed_tokens": "0:cpu", "model.norm": "1:cpu", "lm_head": "1:cpu"}
    expected.update({f"model.layers.{i}": f"{rank}:cpu" for rank, span in enumerate(layers) for i in range(*span)})
    for r in results:
        assert r["device_map"] == expected
        assert r["plan_is_plan"] and r["method"] == "inference" and r["model_type"] == "llama" and r["eos"] == 2
        assert 0.8 * r["share"] <= min(r["budgets"]) <= 1.25 * r["share"], (r["budgets"], r["share"])
        assert r["logits_diff"] <= 1e-5 and r["generate_equal"] and r["saved_equal"]
        assert not r["has_lm_head"]
        assert r["errors"]["get_input_embeddings"][0] and "spread over the ranks" in r["errors"]["get_input_embeddings"][1]
        assert r["errors"]["gradient_checkpointing_enable"][0]
        assert "activation_checkpointing=" in r["errors"]["gradient_checkpointing_enable"][1]
        assert r["errors"]["no_such_attribute"][0] is False


@pytest.mark.slow
def test_the_generation_benchmark_runs_and_both_paths_agree():
    """scripts/bench_generate.py on a tiny model: the relay and the pipelined cuts generate the same tokens; it
    reports each rank's time blocked in receives and a decode forward's time at each micro-batch's rows."""
    import os
    import sys
    from pathlib import Path

    from tests.parallel.launcher import run_command

    root = Path(__file__).resolve().parents[2]
    out = run_command([sys.executable, "scripts/bench_generate.py", "--small", "--sequences", "4", "--new-tokens", "4",
                       "--micro-batches", "2", "2x2", "--repeats", "1", "--prompt-length", "8"], cwd=root,
                      env=dict(os.environ), timeout_s=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "same tokens in every cut: True" in out.stdout, out.stdout
    assert "(the relay)" in out.stdout and "waiting 0 / 1" in out.stdout
    assert "prompts of 4-8 tokens" in out.stdout
    assert "2 x 2  " in out.stdout and "2 x 1  " in out.stdout  # 8-position prompts: one chunk by default
    for rank in (0, 1):  # the relay's forwards on the 4 rows, the cut's on 2
        assert f"rank {rank}: a decode step's forward, median: 4 rows " in out.stdout and ", 2 rows " in out.stdout
