"""hfsplit.from_pretrained with transformers' BitsAndBytesConfig, in one process, against transformers' own 4-bit load."""
import shutil
from pathlib import Path

import pytest
import torch


def test_from_pretrained_quantizes_blocks_like_transformers(tiny_checkpoint):
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    import hfsplit
    from hfsplit.apply.quantize import quantization_config

    path = tiny_checkpoint("llama")
    qconfig = quantization_config(compute_dtype="float32")
    ours = hfsplit.from_pretrained(path, max_memory={"cpu": "2GiB"}, dtype=torch.float32, quantization_config=qconfig)
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu", quantization_config=qconfig)
    kinds = lambda m: sorted((n, type(x).__name__) for n, x in m.named_modules() if isinstance(x, torch.nn.Linear))
    assert kinds(ours) == kinds(theirs)
    assert sum(isinstance(x, bnb.nn.Linear4bit) for x in ours.modules()) == 7 * ours.config.num_hidden_layers
    assert ours.is_loaded_in_4bit and ours.hfsplit_plan.spec.method == "qlora"
    probe = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # both in eval mode: the same bitsandbytes CPU kernel
        assert torch.equal(ours(input_ids=probe).logits, theirs(input_ids=probe).logits)


def prequantized_checkpoint(source, dest, **knobs):
    """A pre-quantized bitsandbytes folder as users get one: transformers' own 4-bit load of `source`, then
    `save_pretrained` (config.json gains `quantization_config`; weights are packed uint8 + quant state)."""
    from transformers import AutoModelForCausalLM

    from hfsplit.apply.quantize import quantization_config

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, device_map="cpu",
                                                 quantization_config=quantization_config(compute_dtype="float32", **knobs))
    model.save_pretrained(dest)
    for extra in Path(source).iterdir():  # the tokenizer files travel with it, as on the hub
        if extra.is_file() and not (dest / extra.name).exists() and "safetensors" not in extra.name:
            shutil.copy(extra, dest / extra.name)
    return dest


def test_prequantized_checkpoint_loads_its_packed_weights_as_stored(tiny_checkpoint, tmp_path):
    """A pre-quantized folder loads in one process without re-quantizing: every packed weight and absmax is the
    stored bytes, and the logits equal transformers loading the same folder (train and eval kernels)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import hfsplit
    from hfsplit.errors import QuantizationError
    from hfsplit.apply.quantize import quantization_config, quantized_linear_count

    path = prequantized_checkpoint(tiny_checkpoint("llama"), tmp_path / "nf4")
    ours = hfsplit.from_pretrained(path, max_memory={"cpu": "2GiB"}, dtype=torch.float32)  # its config says how
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu")
    stored = load_file(path / "model.safetensors")
    packed = {n: p for n, p in ours.named_parameters() if n + ".absmax" in stored}
    assert len(packed) == quantized_linear_count(ours) == 7 * ours.config.num_hidden_layers
    for name, param in packed.items():
        assert torch.equal(param.data, stored[name]) and torch.equal(param.quant_state.absmax, stored[name + ".absmax"])
    assert ours.hfsplit_plan.spec.method == "qlora" and ours.is_loaded_in_4bit
    probe = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for mode in (True, False):
            assert torch.equal(ours.train(mode)(input_ids=probe).logits, theirs.train(mode)(input_ids=probe).logits)
    with pytest.raises(QuantizationError, match="bnb_4bit_use_double_quant=True but .*False was asked"):
        hfsplit.from_pretrained(path, max_memory={"cpu": "2GiB"}, dtype=torch.float32,
                                quantization_config=quantization_config(double_quant=False))


@pytest.mark.parametrize("shape", [(2048, 1024), (1000, 384), (37, 70)])  # several chunks; a partial block; < 1 chunk
@pytest.mark.parametrize("double_quant", [True, False])
def test_chunked_quantize_is_bitsandbytes_quantize_bit_for_bit(shape, double_quant):
    import bitsandbytes as bnb

    from hfsplit.apply.nf4 import CHUNK_VALUES
    from hfsplit.apply.quantize import quantization_config, quantize_4bit_in_chunks

    weight = torch.randn(*shape, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    packed, stats = quantize_4bit_in_chunks(weight, quantization_config(double_quant=double_quant))
    want, state = bnb.functional.quantize_4bit(weight, blocksize=64, compress_statistics=double_quant, quant_type="nf4")
    want_stats = state.as_dict(packed=True)
    assert torch.equal(packed, want) and stats.keys() == want_stats.keys()
    assert all(torch.equal(stats[k], want_stats[k]) for k in stats)
    assert shape != (2048, 1024) or weight.numel() > 4 * CHUNK_VALUES


def test_qlora_time_counts_a_dequantize_per_micro_batch():
    """bitsandbytes dequantizes every weight afresh per micro-batch (forward, recompute, backward): QLoRA's block
    FLOPs carry that fixed cost per micro-batch, so one micro-batch of 8 costs less than 8 of 1; LoRA's do not."""
    from tests.planning.test_costs import tiny_config

    from hfsplit.plan import TrainingSpec
    from hfsplit.planning.costs.model import model_costs
    from hfsplit.planning.costs.quantized import DEQUANTIZE_FLOPS_PER_VALUE

    config = tiny_config("llama")
    flops = {}
    for method in ("lora", "qlora"):
        for mb in (1, 8):
            spec = TrainingSpec(method=method, seq_len=64, micro_batch_size=mb, dtype="float32", lora_r=8,
                                activation_checkpointing=True)
            flops[method, mb] = model_costs(config, spec).block.flops
    per_layer = (config.hidden_size * (config.num_attention_heads + 2 * config.num_key_value_heads)
                 * config.hidden_size // config.num_attention_heads + config.hidden_size ** 2
                 + 3 * config.hidden_size * config.intermediate_size)
    dequantize = DEQUANTIZE_FLOPS_PER_VALUE * per_layer * 3  # forward, recompute, backward
    assert flops["lora", 8] == pytest.approx(8 * flops["lora", 1])
    assert flops["qlora", 1] == pytest.approx(flops["lora", 1] + dequantize)
    assert flops["qlora", 8] == pytest.approx(flops["lora", 8] + dequantize)
    assert 8 * flops["qlora", 1] > flops["qlora", 8] * 1.05


def test_8bit_base_and_8bit_prequantized_checkpoint_load_like_transformers(tiny_checkpoint, tmp_path):
    """load_in_8bit (bitsandbytes 0.50.2 runs Linear8bitLt forward and backward on CPU): quantized as read, the
    logits equal transformers' own 8-bit load; the bytes held are the cost model's; an 8-bit pre-quantized folder
    loads its int8 rows and scales as stored; a 4-bit request on it is refused in one line."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import hfsplit
    from hfsplit.errors import QuantizationError
    from hfsplit.apply.quantize import held_bytes, quantization_config
    from hfsplit.checkpoint.quantized import quantized_linear_bytes

    source = tiny_checkpoint("llama")
    eight = quantization_config(load_in_8bit=True, compute_dtype="float32")
    ours = hfsplit.from_pretrained(source, max_memory={"cpu": "2GiB"}, dtype=torch.float32, quantization_config=eight)
    theirs = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, device_map="cpu", quantization_config=eight)
    layer = ours.model.layers[0].mlp.up_proj
    assert type(layer).__name__ == "Linear8bitLt" and ours.is_loaded_in_8bit and not ours.is_loaded_in_4bit
    assert held_bytes(layer) == quantized_linear_bytes(layer.in_features, layer.out_features, load_in_8bit=True)
    probe = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours.train()(input_ids=probe).logits, theirs.train()(input_ids=probe).logits)
    path = prequantized_checkpoint(source, tmp_path / "int8", load_in_8bit=True)
    stored = load_file(path / "model.safetensors")
    loaded = hfsplit.from_pretrained(path, max_memory={"cpu": "2GiB"}, dtype=torch.float32)  # its config says 8-bit
    again = loaded.model.layers[0].mlp.up_proj
    assert torch.equal(again.weight.data, stored["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(again.weight.SCB, stored["model.layers.0.mlp.up_proj.SCB"])
    with torch.no_grad():
        reread = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu").train()
        assert torch.equal(loaded.train()(input_ids=probe).logits, reread(input_ids=probe).logits)
    with pytest.raises(QuantizationError, match="load_in_8bit=True but load_in_8bit=False was asked"):
        hfsplit.from_pretrained(path, max_memory={"cpu": "2GiB"}, dtype=torch.float32,
                                quantization_config=quantization_config(compute_dtype="float32"))


@pytest.mark.parametrize("knobs, fix", [(dict(load_in_8bit=True), "use 4-bit (drop --load-in-8bit)"),
                                        (dict(quant_type="fp4"), "use --bnb-4bit-quant-type nf4"),
                                        (dict(), "run QLoRA on a device bitsandbytes serves (cuda, cpu)")])
def test_a_device_bitsandbytes_refuses_is_one_line_naming_the_format_and_the_fix(knobs, fix):
    """bitsandbytes really refuses to build its layers on the meta device (no mock): one line naming the format, the
    device and the fix. (On CPU, bitsandbytes 0.50.2 serves NF4, FP4 and 8-bit, forward and backward.)"""
    from hfsplit.errors import QuantizationError
    from hfsplit.apply.quantize import check_quantization, quantization_config, quantization_config_of
    from hfsplit.plan import TrainingSpec

    with pytest.raises(QuantizationError) as refused:
        check_quantization(quantization_config(compute_dtype="float32", **knobs), device=torch.device("meta"))
    line = str(refused.value)
    assert "\n" not in line and " on meta: bitsandbytes refuses it (" in line and line.endswith(fix), line
    for config in (quantization_config(compute_dtype="float32", **knobs),
                   quantization_config_of(TrainingSpec(method="qlora", dtype="float32", **{
                       {"quant_type": "bnb_4bit_quant_type"}.get(k, k): v for k, v in knobs.items()}))):
        check_quantization(config, device=torch.device("cpu"))  # served on CPU
    spec_config = quantization_config_of(TrainingSpec(method="qlora", dtype="bfloat16", load_in_8bit=True,
                                                      bnb_4bit_use_double_quant=False))
    assert spec_config.load_in_8bit and not spec_config.bnb_4bit_use_double_quant
    assert spec_config.bnb_4bit_compute_dtype == torch.bfloat16


@pytest.mark.parametrize("seq_len", [64, 256])
def test_estimated_8bit_qlora_peak_matches_a_real_step(seq_len):
    """An 8-bit base (int8 rows + fp32 row scales), fp32 adapters and AdamW: the cost model within ±15% of a real
    CPU step under MemTracker (measured 0.98 / 1.00 for Llama)."""
    from tests.planning.test_costs import measured_peak, tiny_config

    from hfsplit.plan import TrainingSpec
    from hfsplit.planning.costs.model import estimate_peak_bytes, model_costs

    config = tiny_config("llama")
    spec = TrainingSpec(method="qlora", seq_len=seq_len, dtype="float32", lora_r=8, lora_targets=None, load_in_8bit=True)
    estimated = estimate_peak_bytes(model_costs(config, spec))
    measured = measured_peak(config, "qlora", seq_len, load_in_8bit=True)
    assert estimated == pytest.approx(measured, rel=0.15), f"estimated/measured = {estimated / measured:.3f}"
    four = estimate_peak_bytes(model_costs(config, TrainingSpec(method="qlora", seq_len=seq_len, dtype="float32",
                                                               lora_r=8, lora_targets=None)))
    assert estimated > four  # int8 weights weigh more than NF4: the spec's knob reaches the cost model
