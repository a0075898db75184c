"""Single-process `hfsplit.from_pretrained`: the same model transformers loads, built block by block."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hfsplit.checkpoint.synthetic import ARCHITECTURES, FAMILY_OVERRIDES, shard_files, tiny_config, write_checkpoint, write_hub_cache
from hfsplit.errors import CheckpointError, UnsupportedModelError
from hfsplit.load.materialize import from_pretrained
from hfsplit.plan import Plan
from hfsplit.models import varlen

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_LAYERS = 4  # tiny_config's default


def cpu_device_map(num_layers: int = NUM_LAYERS) -> dict:
    return {"model.embed_tokens": "cpu", **{f"model.layers.{i}": "cpu" for i in range(num_layers)},
            "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}


def assert_same_model(ours, reference) -> None:
    ours_state, ref_state = ours.state_dict(), reference.state_dict()
    assert ours_state.keys() == ref_state.keys()
    for name, tensor in ref_state.items():
        assert ours_state[name].dtype == tensor.dtype, name
        assert torch.equal(ours_state[name], tensor), name
    for (name, buffer), (_, ref_buffer) in zip(ours.named_buffers(), reference.named_buffers()):
        assert torch.equal(buffer, ref_buffer), name


def assert_same_outputs(ours, reference, vocab: int = 256) -> None:
    ids = torch.randint(3, vocab, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, reference(ids).logits)
    greedy = dict(max_new_tokens=6, do_sample=False)
    assert torch.equal(ours.generate(ids, **greedy), reference.generate(ids, **greedy))


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("tied,sharded", [(False, True), (True, True), (False, False), (True, False)])
def test_same_weights_logits_and_generate_as_transformers(tiny_checkpoint, arch, tied, sharded):
    folder = tiny_checkpoint(arch, tied=tied, sharded=sharded)
    reference = AutoModelForCausalLM.from_pretrained(folder)
    ours = from_pretrained(folder, plan=cpu_device_map())
    assert_same_model(ours, reference)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    assert not ours.training
    assert_same_outputs(ours, reference)


@pytest.mark.parametrize("arch", [*ARCHITECTURES, *FAMILY_OVERRIDES])
def test_a_packed_row_gives_each_example_the_logits_it_gets_alone(tiny_checkpoint, arch):
    """Position ids restarting per example (sliding windows of 4 inside examples of 5-6 tokens) keep attention inside
    each example, called as a transformers model is called (no `use_cache=False` needed)."""
    from hfsplit.training.packing import pack_row

    ours = from_pretrained(tiny_checkpoint(arch), max_memory={"cpu": "8GiB"}, dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    examples = [torch.randint(3, 256, (n,), generator=gen) for n in (6, 5, 5)]
    ids, _, positions = (torch.tensor([x]) for x in pack_row([(e.tolist(), e.tolist()) for e in examples],
                                                             seq_len=16, pad=0))
    with torch.no_grad():
        alone = torch.cat([ours(e[None]).logits[0] for e in examples])
        before = varlen.calls()
        packed = ours(ids, position_ids=positions).logits[0]  # under sdpa example by example (models/varlen.py)
        assert (varlen.calls() > before) == (ours.config._attn_implementation == "sdpa")
        assert (packed - alone).abs().max() <= 1e-5
        with varlen.block_masks():  # transformers' block-diagonal mask
            assert (ours(ids, position_ids=positions).logits[0] - alone).abs().max() <= 1e-5
        assert (ours(ids).logits[0] - alone).abs().max() > 1e-3  # without them, one sequence: a test that can fail


def test_plans_with_the_planner_by_default(tiny_checkpoint):
    folder = tiny_checkpoint("llama")
    ours = from_pretrained(folder, max_memory={"cpu": "8GiB"})
    assert isinstance(ours.hfsplit_plan, Plan) and ours.hfsplit_plan.tp == 1
    assert ours.hf_device_map == ours.hfsplit_plan.device_map()
    assert set(ours.hf_device_map.values()) == {"cpu"}
    assert_same_outputs(ours, AutoModelForCausalLM.from_pretrained(folder))


def test_dtype_cast_matches_transformers(tiny_checkpoint):
    folder = tiny_checkpoint("qwen2")
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    ours = from_pretrained(folder, plan=cpu_device_map(), dtype="bfloat16")
    assert ours.dtype == torch.bfloat16
    assert ours.model.rotary_emb.inv_freq.dtype == reference.model.rotary_emb.inv_freq.dtype
    assert_same_model(ours, reference)
    assert_same_outputs(ours, reference)


def test_auto_dtype_follows_a_bf16_checkpoint(tmp_path):
    folder = write_checkpoint(tmp_path / "bf16", tiny_config("mistral"), dtype=torch.bfloat16, max_shard_size="60KB")
    reference = AutoModelForCausalLM.from_pretrained(folder)
    ours = from_pretrained(folder, plan=cpu_device_map())
    assert ours.dtype == reference.dtype == torch.bfloat16
    assert_same_model(ours, reference)


def test_peft_lora_trains_and_round_trips(tiny_checkpoint, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    folder = tiny_checkpoint("llama", tied=True)
    model = get_peft_model(from_pretrained(folder, plan=cpu_device_map(), training="lora"),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    ids = torch.randint(3, 256, (2, 8))
    loss = model(ids, labels=ids).loss
    loss.backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None for p in trainable)
    model.save_pretrained(tmp_path / "adapter")
    model.eval()
    with torch.no_grad():
        expected = model(ids).logits
    for base in (from_pretrained(folder, plan=cpu_device_map()), AutoModelForCausalLM.from_pretrained(folder)):
        loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        with torch.no_grad():
            assert torch.allclose(loaded(ids).logits, expected, atol=1e-6)


def test_encoder_decoder_is_refused_before_reading(tmp_path):
    from transformers import T5Config

    T5Config(num_layers=1, d_model=32, num_heads=2).save_pretrained(tmp_path)  # no weights at all
    with pytest.raises(UnsupportedModelError, match=r"model_type 't5'.*encoder-decoder models are not split"):
        from_pretrained(tmp_path, max_memory={"cpu": "2GiB"})


def test_shape_mismatch_is_found_before_loading(tiny_checkpoint, tmp_path):
    import shutil

    folder = Path(shutil.copytree(tiny_checkpoint("llama"), tmp_path / "ckpt"))
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = 300
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model-\d+-of-\d+\.safetensors: tensor '(lm_head|model\.embed_tokens)\.weight' has shape \[256, 64\].*\[300, 64\]"):
        from_pretrained(folder, plan=cpu_device_map())


def test_device_map_missing_a_block(tiny_checkpoint):
    device_map = cpu_device_map()
    del device_map["model.layers.2"]
    with pytest.raises(ValueError, match=r"model\.layers\.2\."):
        from_pretrained(tiny_checkpoint("llama"), plan=device_map)


def test_hub_name_loads_offline_from_the_cache(tiny_checkpoint, tmp_path):
    source = tiny_checkpoint("qwen2", tied=True)
    cache = tmp_path / "hub"
    write_hub_cache(cache, "org/tiny-qwen2", source)
    code = f"""
        import torch
        from hfsplit.load.materialize import from_pretrained
        from transformers import AutoModelForCausalLM
        device_map = {cpu_device_map()!r}
        ours = from_pretrained("org/tiny-qwen2", plan=device_map)
        reference = AutoModelForCausalLM.from_pretrained({str(source)!r})
        ids = torch.randint(3, 256, (1, 7))
        with torch.no_grad():
            assert torch.equal(ours(ids).logits, reference(ids).logits)
        print("ok")
    """
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "ok"
    assert len(shard_files(source)) > 1
