"""Planning time: the shortcuts that keep a first plan fast give the figures the full traces give."""
import functools
from dataclasses import replace
import subprocess
import sys

import pytest

from hfsplit.planning.costs import model as costs_model, tp as trace_tp, trace as costs_trace
from hfsplit.checkpoint.synthetic import tiny_config
from hfsplit.plan import TrainingSpec
from hfsplit.planning.costs.layout import CONFIGS as _CONFIGS, config_key as _config_key

# heads 16 / kv 8 / MLP 256: tp 1, 2 and 4 are valid and leave each rank 2+ key-value heads, so tp=4 is
# derived from the traces at 1 and 2
DIMS = dict(hidden=128, heads=16, kv_heads=8, intermediate=256, num_layers=2)
SPECS = [TrainingSpec(method="lora", seq_len=48, micro_batch_size=2, dtype="bfloat16"),
         TrainingSpec(method="full", seq_len=32, dtype="float32"),
         TrainingSpec(method="inference", seq_len=40, dtype="bfloat16"),
         TrainingSpec(method="lora", seq_len=32, dtype="float32", lora_r=4, lora_targets=("q_proj", "down_proj"))]


def _key(arch: str) -> str:
    config = tiny_config(arch, **DIMS)
    key = _config_key(config)
    _CONFIGS.setdefault(key, config)
    return key


# Blocks that differ: biases (qwen2), q/k norms (qwen3), soft-capping and sliding windows (gemma2, gemma3),
# a parallel attention + MLP block (cohere), fused experts split per expert (mixtral, qwen3_moe), outputs gathered
# whole on every rank (phi3: attention and MLP, olmo2: attention); the other declared families share Llama's block.
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2", "gemma3_text", "cohere", "mixtral", "qwen3_moe",
                                  "phi3", "olmo2"])
def test_derived_tp_traces_equal_real_traces(arch):
    key = _key(arch)
    for spec in SPECS if arch == "llama" else SPECS[:1]:
        profile = trace_tp.block_profile(key, spec)
        assert profile is not None, (arch, spec.method)
        real = costs_trace.block_events.__wrapped__(key, spec, 4).trace()
        assert profile.at(4) == real, (arch, spec)
        assert real.activations > 0 or spec.method == "inference"


def test_profile_refuses_traces_that_do_not_follow_the_tp_law():
    key = _key("llama")
    spec = SPECS[1]
    one, two = costs_trace.block_events(key, spec, 1), costs_trace.block_events(key, spec, 2)
    assert trace_tp.fit_profile(one, one, 2) is not None  # nothing sharded: a valid (if odd) profile
    assert trace_tp.fit_profile(two, one, 2) is None  # bytes growing with the degree: no profile
    shorter = costs_trace.BlockEvents(two.inference, two.forward[:-1], two.backward, two.activations, two.grads,
                                 two.out_bytes)
    assert trace_tp.fit_profile(one, shorter, 2) is None  # another op sequence
    profile = trace_tp.fit_profile(one, two, 2)
    assert trace_tp.TpProfile.from_record(profile.to_record()) == profile


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gemma2"])
def test_trace_adapters_trace_as_peft_adapters(arch, monkeypatch):
    key = _key(arch)
    # autocast=True: a bf16 QLoRA run's traced spec (forwards under autocast, peft's input casts off)
    autocast = replace(SPECS[0], autocast=True)
    cases = [(SPECS[0], 1), (SPECS[0], 2), (SPECS[3], 2), (autocast, 1)] if arch == "llama" else [(SPECS[0], 1)]
    for spec, tp in cases:
        ours = costs_trace.block_events.__wrapped__(key, spec, tp)
        with monkeypatch.context() as m:
            m.setattr(costs_trace, "_add_lora", functools.partial(costs_trace._add_lora, use_peft=True))
            theirs = costs_trace.block_events.__wrapped__(key, spec, tp)
        assert ours == theirs, (arch, spec, tp)
    if arch == "llama":  # no fp32 copies of the adapters' inputs kept
        assert costs_trace.block_events(key, autocast, 1).activations < costs_trace.block_events(key, SPECS[0], 1).activations


PLAN_AND_LIST_IMPORTS = """
import sys
import hfsplit.cli
from hfsplit.planning.planner import make_plan
make_plan({model!r}, "4x24GiB")
heavy = ("peft", "bitsandbytes", "torch._inductor.compile_fx", "torch.distributed.pipelining", "datasets")
print(sorted(m for m in heavy if m in sys.modules))
"""


def test_planning_imports_none_of_the_training_stack(tmp_path):
    """A first plan (empty trace cache) of a LoRA run imports no peft, bitsandbytes or inductor compiler; a warm one
    no modeling code either."""
    folder = tmp_path / "tiny"
    from hfsplit.checkpoint.synthetic import write_tiny_checkpoint

    write_tiny_checkpoint(folder, "llama", num_layers=2)
    env = {"HFSPLIT_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    code = PLAN_AND_LIST_IMPORTS.format(model=str(folder))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
    # the same plan again in a new process, the trace cache warm: not even the model's modeling code is imported
    # nor its masking code (a meta model cost 1.6 s of a 70B warm plan, the masking import 1.8 s)
    warm = code.replace('"datasets")', '"datasets", "transformers.models.llama.modeling_llama", '
                                       '"transformers.masking_utils")')
    out = subprocess.run([sys.executable, "-c", warm], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


def test_no_fit_diagnosis_traces_two_degrees_and_no_fix_the_weights_rule_out(tmp_path, monkeypatch):
    """4 devices too small for the weights: the search traces tp 1 and 2 (tp=4 is derived), the shorter sequence
    and micro-batch fixes trace nothing, and more devices add only tp=8 (one key-value head each), each degree also at
    one row a micro-batch, which make_plan tries on those devices where no count fits (`knobs.turn_knobs`)."""
    from hfsplit.budget import parse_max_memory
    from hfsplit.planning import diagnosis, planner
    from hfsplit.planning.costs import traces as trace_cache
    from hfsplit.errors import PlanError

    monkeypatch.setenv("HFSPLIT_CACHE", str(tmp_path))
    monkeypatch.setattr(trace_cache, "_MEMO", {})
    config = tiny_config("llama", hidden=128, heads=16, kv_heads=8, intermediate=256, num_layers=8, vocab=512)
    spec = TrainingSpec(method="lora", seq_len=256, micro_batch_size=2, dtype="float32", reserve_bytes=0)
    weights = costs_model.weight_bytes(config, spec)
    traced, real = [], costs_trace.block_events
    monkeypatch.setattr(costs_trace, "block_events",
                        lambda key, s, tp: traced.append((tp, s.seq_len, s.micro_batch_size)) or real(key, s, tp))
    budget = f"4x{weights // 5}B"
    assert not diagnosis.could_fit(config, parse_max_memory(budget), spec)
    with pytest.raises(PlanError, match="devices"):
        planner.make_plan(config, budget, spec=spec)
    # more devices are planned as make_plan plans them: where no micro-batch count fits, one row a micro-batch too
    assert sorted(set(traced)) == [(t, 256, rows) for t in (1, 2, 8) for rows in (1, 2)]
    # the bound is the weights the plan counts: a one-device plan of the full model holds exactly them
    one = planner.make_plan(config, "64GiB", spec=TrainingSpec(method="inference", dtype="float32", reserve_bytes=0))
    assert one.stages[0].memory.weights == costs_model.weight_bytes(config, one.spec)
