"""Traced costs are written to disk once, reused by a later call, and keyed by what changes them."""
from dataclasses import replace

from transformers import LlamaConfig

from hfsplit.planning.costs import traces as trace_cache
from hfsplit.plan import TrainingSpec
from hfsplit.planning.costs.layout import CONFIGS as _CONFIGS, config_key as _config_key
from hfsplit.planning.costs.trace import trace_block as _trace_block


def _config():
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=64)


def _fresh_cache_key(tmp_path, monkeypatch) -> str:
    """A cache folder of its own, an empty in-process memo, and the registered key of the test config."""
    monkeypatch.setenv("HFSPLIT_CACHE", str(tmp_path))
    monkeypatch.setattr(trace_cache, "_MEMO", {})
    config = _config()
    key = _config_key(config)
    _CONFIGS.setdefault(key, config)
    return key


def test_trace_written_once_then_read(tmp_path, monkeypatch):
    key = _fresh_cache_key(tmp_path, monkeypatch)
    spec = TrainingSpec(method="lora", seq_len=32, dtype="float32")
    first = trace_cache.block_trace(key, spec, 2)
    assert first == _trace_block(key, trace_cache.trace_spec(spec), 2)
    def blocks():
        return sorted(p.name for p in tmp_path.glob("block-*.json"))

    assert len(blocks()) == 1
    # A fresh process (empty memo) reads the file; checkpointing and the reserve share it.
    monkeypatch.setattr(trace_cache, "_MEMO", {})
    again = trace_cache.block_trace(key, replace(spec, activation_checkpointing=True, reserve_bytes=7), 2)
    assert again == first and len(blocks()) == 1
    # Another sequence length, TP degree or method is another entry.
    trace_cache.block_trace(key, replace(spec, seq_len=64), 2)
    trace_cache.block_trace(key, spec, 1)
    trace_cache.block_trace(key, replace(spec, method="full"), 2)
    assert len(blocks()) == 4


def test_corrupt_cache_file_is_retraced(tmp_path, monkeypatch):
    key = _fresh_cache_key(tmp_path, monkeypatch)
    spec = TrainingSpec(method="full", seq_len=16, dtype="float32")
    first = trace_cache.block_trace(key, spec, 1)
    (path,) = tmp_path.glob("block-*.json")
    path.write_text("{not json")
    monkeypatch.setattr(trace_cache, "_MEMO", {})
    assert trace_cache.block_trace(key, spec, 1) == first
