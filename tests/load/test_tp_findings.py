"""The tp=2 sweep's findings as `hfsplit/models/tp_proven.json` keeps them (hfsplit/load/tp_proof.py): a sweep of a few
types replaces only theirs, and a type proven in float64 keeps where float32 differed. The sweep itself runs on two
ranks (tests/parallel/test_tp_sweep.py)."""
import json

import transformers

from hfsplit.load import tp_proof


def test_a_sweep_of_some_types_replaces_only_their_findings_and_keeps_where_float64_proved_them(tmp_path, monkeypatch):
    version = transformers.__version__
    committed = {version: {"proven": ["llama", "qwen3_next"], "refused": {"gemma3n_text": "its shards differ"},
                           "rounding": {"qwen3_next": "dt_bias's gradient off (relative) in float32, equal in float64"}},
                 "4.0.0": {"proven": ["llama"], "refused": {}}}
    path = tmp_path / "tp_proven.json"
    path.write_text(json.dumps(committed))
    monkeypatch.setattr(tp_proof, "TP_PROVEN", path)
    tp_proof.write_findings([
        {"model_type": "gemma3n_text", "proven": True, "reason": "",
         "rounding": "model.embed_tokens.weight's gradient 2.4e-05 off (relative) in float32, equal in float64"},
        {"model_type": "qwen3_next", "proven": False, "reason": "its shards differ from transformers: logits 0.5 off",
         "rounding": ""},
    ])
    found = json.loads(path.read_text())
    assert found["4.0.0"] == committed["4.0.0"]
    assert found[version] == {
        "proven": ["gemma3n_text", "llama"],
        "refused": {"qwen3_next": "its shards differ from transformers: logits off"},
        "rounding": {"gemma3n_text": "model.embed_tokens.weight's gradient off (relative) in float32, equal in float64"},
    }
