"""The calibrated time model: one real block timed once per device kind, dtype and shape, then read back."""
import pytest
import torch
from transformers import LlamaConfig

from hfsplit import calibrate
from hfsplit.costs import TrainingSpec


def _config():
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=64)


def test_probe_written_once_reused_and_keyed_by_kind_and_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSPLIT_CACHE", str(tmp_path))
    calls = []
    real = calibrate._time_block
    monkeypatch.setattr(calibrate, "_time_block", lambda *a: calls.append(a) or real(*a))
    spec = TrainingSpec(method="full", seq_len=32, micro_batch_size=2, dtype="float32")
    cpu = torch.device("cpu")
    first = calibrate.block_flops_per_s(_config(), spec, cpu)
    assert first > 1e6 and len(calls) == 1 and len(list(tmp_path.glob("speed-*.json"))) == 1
    assert calibrate.block_flops_per_s(_config(), spec, cpu) == first and len(calls) == 1  # read back
    calibrate.block_flops_per_s(_config(), TrainingSpec(method="full", seq_len=32, micro_batch_size=2,
                                                        dtype="bfloat16"), cpu)
    assert len(calls) == 2  # another dtype is another measurement
    monkeypatch.setattr(calibrate, "device_kind", lambda device: "another-cpu")
    calibrate.block_flops_per_s(_config(), spec, cpu)
    assert len(calls) == 3 and len(list(tmp_path.glob("speed-*.json"))) == 3


def test_known_gpu_table_and_speeds_relative_to_the_planner_unit(tmp_path, monkeypatch):
    from hfsplit.planner import DEVICE_FLOPS

    assert calibrate.known_flops("NVIDIA H100 80GB HBM3") == pytest.approx(989e12 * calibrate.ACHIEVED)
    assert calibrate.known_flops("NVIDIA L40S") == pytest.approx(362e12 * calibrate.ACHIEVED)  # not "L4"
    assert calibrate.known_flops("Some NPU") is None
    monkeypatch.setenv("HFSPLIT_CACHE", str(tmp_path))
    spec = TrainingSpec(method="lora", seq_len=16, dtype="float32", lora_r=4)
    speeds = calibrate.calibrated_speeds(_config(), spec, {"0": 1, "1": 1}, torch.device("cpu"))
    flops = calibrate.block_flops_per_s(_config(), spec, torch.device("cpu"))
    assert speeds == {"0": flops / DEVICE_FLOPS, "1": flops / DEVICE_FLOPS}


def test_probe_times_a_gemma3_block_whose_rope_is_per_layer_type():
    """Gemma 3's rotary embedding takes the layer type; the probe hands block 0 its own table."""
    from hfsplit.checkpoint.synthetic import tiny_config

    spec = TrainingSpec(method="full", seq_len=16, micro_batch_size=1, dtype="float32")
    assert calibrate._time_block(tiny_config("gemma3_text"), spec, torch.device("cpu")) > 0
