"""gpt-oss as a family: its MXFP4 checkpoint loaded in one process and as a stage against transformers, the bundled
configs, tp refused by name, and the QLoRA targets on the meta device. Its splits run in
tests/parallel/test_families_split.py, its training in tests/training/test_trainer.py and
tests/training/test_moe_training.py, its MXFP4 reading in tests/checkpoint/test_mxfp4.py."""
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hfsplit.checkpoint import load_config
from hfsplit.errors import PlanError
from hfsplit.load.materialize import from_pretrained
from hfsplit.plan import TrainingSpec
from hfsplit.planning.planner import make_plan
from tests.models.test_families import one_stage_and_reference

CONFIGS = Path(__file__).resolve().parents[2] / "hfsplit" / "configs"


def test_mxfp4_checkpoint_loads_single_process_and_as_a_stage_as_transformers(tiny_checkpoint):
    """Single-process `from_pretrained` (the model's own forward) and one stage holding every block, both on the
    reader's dequantized experts, give transformers' logits; greedy generation too."""
    folder = tiny_checkpoint("gpt_oss", mxfp4=True)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = from_pretrained(folder, max_memory={"cpu": "3GiB"}, dtype=torch.float32)
    module, _ = one_stage_and_reference(str(folder))
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(ids).logits
        torch.testing.assert_close(ours(ids).logits, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(module(ids), want, rtol=0, atol=1e-5)
    greedy = dict(max_new_tokens=5, do_sample=False)
    assert torch.equal(ours.generate(ids, **greedy), reference.generate(ids, **greedy))


@pytest.mark.parametrize("name, layers, experts", [("openai/gpt-oss-20b", 24, 32), ("openai/gpt-oss-120b", 36, 128)])
def test_bundled_gpt_oss_configs_are_the_published_ones(name, layers, experts):
    """hub config.json values (see docs/guides/families.md for the source): YaRN rope from the legacy
    `rope_scaling`, sliding and full layers alternating, MXFP4 experts read 16-bit (no quantization config left)."""
    config = load_config(name)
    assert (config.model_type, config.num_hidden_layers, config.num_local_experts) == ("gpt_oss", layers, experts)
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 32.0
    assert config.layer_types == ["sliding_attention", "full_attention"] * (layers // 2)
    assert config.sliding_window == 128 and config.num_experts_per_tok == 4 and config.swiglu_limit == 7.0
    assert not hasattr(config, "quantization_config")
    raw = json.loads((CONFIGS / f"{name.replace('/', '--')}.json").read_text())
    assert raw["quantization_config"]["quant_method"] == "mxfp4"  # the file is the hub's, unedited


def test_gpt_oss_splits_over_stages_and_shards_only_its_embeddings_under_tensor_parallel(tiny_checkpoint):
    """Its TP plan shards only the embeddings (`embedding_rowwise`), so the planner splits it over pipeline stages
    (tp=2 would hold every block whole on both ranks); tp=2 asked for plans, sharding the embedding alone (the tp=2
    sweep proves its logits and gradients, hfsplit/models/tp_proven.json)."""
    config = load_config(tiny_checkpoint("gpt_oss", mxfp4=True))
    spec = TrainingSpec(method="lora", seq_len=64, dtype="float32", reserve_bytes=0)
    plan = make_plan(config, "2x1GiB", spec=spec, pp=2)
    assert (plan.tp, plan.pp) == (1, 2)
    one, two = make_plan(config, "1GiB", spec=spec), make_plan(config, "2x1GiB", spec=spec, tp=2)
    assert two.tp == 2 and 0 < one.stages[0].memory.weights - two.stages[0].memory.weights


# Issue 22's gpt-oss targets: QLoRA r=16, seq 2048, micro-batch 1, bf16, planned on the meta device. They need the
# experts in 4 bits (NF4, the default): with 16-bit experts, as transformers + bitsandbytes keep them, 20b needs
# ~50 GiB at pp=1.
TARGET = dict(method="qlora", lora_r=16, seq_len=2048, micro_batch_size=1, dtype="bfloat16")


@pytest.mark.parametrize("name, budget", [("openai/gpt-oss-20b", "24GiB"), ("openai/gpt-oss-120b", "4x24GiB")])
def test_gpt_oss_qlora_targets_fit(name, budget):
    plan = make_plan(name, budget, spec=TrainingSpec(**TARGET))
    assert all(s.memory.total <= s.budget for s in plan.stages)
    with pytest.raises(PlanError):  # the 4-bit experts are what fits it
        make_plan(name, budget, spec=TrainingSpec(**TARGET, quantize_experts=False))
