"""Any model: every causal-LM type transformers registers, proven split or refused with its reason; the proof on a
user's config (load/proof.py), its cache, its refusal, `hfsplit check`, and the generated families page.

The sweep runs in one process, each type's default config shrunk (models/shrink.py) and compared whole against a
pp=2 split built as a run builds it (the declared families' StageModule, every other type's FollowedStage). The
multi-rank runs of one model per new layer kind are in tests/parallel/test_families_split.py.
"""
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from hfsplit.errors import UnsupportedModelError
from hfsplit.load import proof
from hfsplit.load.proof import Verdict, families_markdown, proven_split, verdict_of

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "families.md"
# The families people fine-tune most in 2026 (issue 29): each split equal to transformers at pp=2.
NAMED = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "gemma4_text", "gemma3n_text", "deepseek_v3", "deepseek_v32",
         "glm4_moe", "glm4_moe_lite", "olmo3", "smollm3", "ministral3", "starcoder2", "qwen2_moe", "olmoe",
         "llama4_text", "granitemoehybrid", "falcon_h1", "lfm2", "phi", "gpt_neox")
# Named families not split yet, and why (the proof refuses them by name; each is a tracked gap, not a silent one).
NOT_YET: dict[str, str] = {}
# Packing off: DeepSeek-V3.2's indexer takes the top-k of scores that tie (ReLU's zeros), and torch breaks the ties
# by the row's length, so in transformers itself a token's logits move when later tokens are appended (0.1-0.18 on
# the shrunk model). (Granite 4 builds its masks and calls its blocks without the position ids: the stage hands it
# masks built with them and `seq_idx`, hfsplit.models.packed_masks.)
NO_PACKING = ("deepseek_v32",)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict[str, Verdict]:
    """The sweep as `hfsplit check --all` makes it: in a process of its own, with a cache of its own, so nothing an
    earlier test left in this one (a default dtype, a switched path) changes a verdict."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("sweep") / "verdicts.json"
    code = ("import dataclasses, json, sys; from hfsplit.load.proof import all_verdicts; "
            "json.dump([dataclasses.asdict(v) for v in all_verdicts()], open(sys.argv[1], 'w'))")
    env = {**os.environ, "HFSPLIT_CACHE": str(tmp_path_factory.mktemp("sweep-cache"))}
    subprocess.run([sys.executable, "-c", code, str(out)], env=env, check=True, timeout=1200,
                   stdout=subprocess.DEVNULL)
    return {v["model_type"]: Verdict(**v) for v in json.loads(out.read_text())}


def test_every_registered_causal_lm_splits_equal_or_is_refused_with_its_reason(verdicts):
    from hfsplit.load.proof import registered_types

    assert sorted(verdicts) == registered_types() and len(verdicts) > 150
    for v in verdicts.values():
        assert v.split or v.reason, v
        if v.split:
            assert v.logits_diff <= proof.TOLERANCE and v.grad_diff <= proof.TOLERANCE, v
    assert sum(v.split for v in verdicts.values()) >= 115  # a floor: a regression in the mechanism shows here


def test_named_families_split_equal_to_transformers(verdicts):
    failing = {t: verdicts[t].reason for t in NAMED if not verdicts[t].split}
    assert set(failing) == set(NOT_YET), failing
    for t in NO_PACKING:
        assert verdicts[t].split and not verdicts[t].packing and "cannot restart" in verdicts[t].reason, verdicts[t]
    for t in set(NAMED) - set(NO_PACKING) - set(NOT_YET):
        assert verdicts[t].packing, verdicts[t]


def test_the_families_page_is_the_generated_table(verdicts):
    table = families_markdown([verdicts[t] for t in sorted(verdicts)])
    page = PAGE.read_text()
    stale = [row for row in table.splitlines() if row not in page.splitlines()]
    assert not stale, f"docs/guides/families.md is stale (run python scripts/families_table.py); rows now: {stale}"


def test_a_split_that_differs_is_refused_naming_the_block_and_the_cause():
    """Zaya hands its next block the previous router's hidden states beside the hidden state: the stage boundary
    drops it, and the proof names the first block whose output differs."""
    config = AutoConfig.for_model("zaya")
    with pytest.raises(UnsupportedModelError, match=r"model_type 'zaya': its split is refused: the split differs from "
                                                    r"transformers: block \d+'s output "
                                                    r"first .* likely cause: state one block hands a later block"):
        proven_split(config)


def test_the_verdict_is_cached_by_the_config_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSPLIT_CACHE", str(tmp_path))
    config = AutoConfig.for_model("olmo3")
    first = verdict_of(config)
    assert first.split and list(tmp_path.glob("proof-*.json"))
    # a cached record is what a second call returns: nothing measured again
    record = next(tmp_path.glob("proof-*.json"))
    record.write_text(record.read_text().replace('"logits_diff": 0.0', '"logits_diff": 1e-09'))
    assert verdict_of(config).logits_diff == 1e-09
    other = AutoConfig.for_model("olmo3", sliding_window=7)  # another config: another hash
    assert proof.config_key(other) != proof.config_key(config)


def test_hfsplit_check_prints_the_verdict_and_refuses_with_exit_2(tmp_path, capsys):
    from hfsplit.cli.plan import main

    for kind, code in (("olmo3", 0), ("qwen3_next", 0), ("zaya", 2)):
        folder = tmp_path / kind
        folder.mkdir()
        AutoConfig.for_model(kind).save_pretrained(folder)
        assert main(["check", str(folder)]) == code
    out = capsys.readouterr().out
    assert "olmo3: split equals transformers (pp=2" in out and "zaya: refused: the split differs" in out
    # tensor parallelism as the tp=2 sweep found it (hfsplit/models/tp_proven.json): one line each
    assert "\nolmo3: tp=2 shards it\n" in out  # its gathered q/k/v (colwise_gather_output) proven by the sweep
    # Gated DeltaNet's decay gradients amplify float32 rounding past the tolerance, in transformers' own model too: the
    # sweep proved its shards equal in float64 and says so
    assert "\nqwen3_next: tp=2 shards it (proven in float64: model.layers.2.linear_attn.dt_bias's gradient off " \
           "(relative) in float32, equal in float64)\n" in out


def test_a_followed_stage_keeps_checkpoint_names_and_holds_only_its_part():
    """The last stage of a Phi split (no standard pipeline plan) holds its blocks, the final norm and the head by
    their checkpoint keys, and nothing of the first stage; run alone, it equals the tail of the whole model."""
    from hfsplit.models.shrink import shrunk_config

    whole = proof.tiny_model(shrunk_config(AutoConfig.for_model("phi")))
    first, last = proof.split_stages(whole, pp=2)
    names = {n for n, _ in last.named_parameters()}
    assert "lm_head.weight" in names and "model.final_layernorm.weight" in names
    assert not any(n.startswith(("model.embed_tokens", "model.layers.0.", "model.layers.1.")) for n in names)
    assert names | {n for n, _ in first.named_parameters()} == {n for n, _ in whole.named_parameters()}
    ids = torch.randint(3, 200, (1, 8))
    with torch.no_grad():
        hidden = first(ids)
        torch.testing.assert_close(last(hidden), whole(input_ids=ids, use_cache=False).logits, rtol=0, atol=1e-5)


def test_per_layer_inputs_cross_the_stage_boundary_with_the_hidden_state():
    """Gemma 3n computes per-layer inputs from input_ids and its embeddings before the blocks and keeps four hidden
    streams (AltUp): the first stage sends both in one tensor, the second stage unpacks them and equals the whole
    model's tail; the modules that compute them, registered after the blocks, belong to the first stage."""
    from hfsplit.models.shrink import shrunk_config
    from hfsplit.models.boundary import boundary_width

    whole = proof.tiny_model(shrunk_config(AutoConfig.for_model("gemma3n_text")))
    first, last = proof.split_stages(whole, pp=2)
    names = {n for n, _ in first.named_parameters()}
    assert {"model.embed_tokens_per_layer.weight", "model.per_layer_model_projection.weight"} <= names
    assert not any(n.startswith("model.altup_unembed_projections") for n in names)
    ids = torch.randint(3, 200, (1, 8))
    with torch.no_grad():
        sent = first(ids)
        assert sent.shape == (1, 8, boundary_width(whole.config))
        assert boundary_width(whole.config) == 4 * whole.config.hidden_size + 12 * 16  # streams + per-layer inputs
        torch.testing.assert_close(last(sent), whole(input_ids=ids, use_cache=False).logits, rtol=0, atol=1e-5)


def test_a_stage_reusing_keys_another_stage_stores_is_refused():
    """Gemma 3n's last blocks reuse the keys and values of earlier blocks: a boundary between them is refused."""
    from hfsplit.models.shrink import shrunk_config
    from hfsplit.parallel.followed_stage import FollowedStage
    from hfsplit.plan import Stage, StageMemory

    config = shrunk_config(AutoConfig.for_model("gemma3n_text"))  # 12 blocks, 10 and 11 reuse 8's and 9's
    stage = Stage(index=1, pp_rank=1, devices=(("cpu",),), layers=(9, 12), has_embed=False, has_head=True,
                  memory=StageMemory(0, 0, 0, 0, 0), budget=0, time_s=0.0)
    with pytest.raises(UnsupportedModelError, match=r"block 10 reuses the keys and values that block 8 stores"):
        FollowedStage(config=config, stage=stage, tied=True)


def test_buffers_the_decoder_sets_on_its_blocks_are_initialised_on_each_stage():
    """Falcon-H1's decoder computes its Mamba mixers' mup_vector (a buffer no checkpoint holds): each stage's
    mixers get transformers' values."""
    from hfsplit.models.shrink import shrunk_config

    whole = proof.tiny_model(shrunk_config(AutoConfig.for_model("falcon_h1")))
    want = dict(whole.named_buffers())
    for stage in proof.split_stages(whole, pp=2):
        held = {n: b for n, b in stage.named_buffers() if n.endswith("mup_vector")}
        assert held and all(torch.equal(b, want[n]) for n, b in held.items())


def test_the_shrink_keeps_a_per_layer_override_in_its_ratio():
    """Gemma 4's full-attention layers override the head width (512 beside 256 in transformers' default): the shrunk
    model keeps them twice as wide as its sliding ones (32 beside 16), not the flagship's 512 in a 64-wide model."""
    from hfsplit.models.shrink import HEAD_DIM, shrunk_config

    config = shrunk_config(AutoConfig.for_model("gemma4_text"))
    whole = proof.tiny_model(config)
    widths = {kind: {layer.self_attn.q_norm.weight.numel() for layer, k in zip(whole.model.layers, config.layer_types)
                     if k == kind} for kind in ("sliding_attention", "full_attention")}
    assert widths == {"sliding_attention": {HEAD_DIM}, "full_attention": {2 * HEAD_DIM}}


@pytest.mark.parametrize("model_type", ["ernie4_5_moe", "kimi_linear"])
def test_a_field_under_its_own_name_is_shrunk_by_the_standard_rule(model_type):
    """Ernie 4.5 MoE names its experts per token `moe_k`, Kimi Linear `num_experts_per_token` (transformers'
    `attribute_map`): shrunk as `num_experts_per_tok`, never above the shrunk expert count, so the split is proven."""
    from hfsplit.models.shrink import shrunk_config

    config = AutoConfig.for_model(model_type)
    tiny = shrunk_config(config)
    own = config.attribute_map["num_experts_per_tok"]
    assert tiny.num_experts_per_tok <= min(2, tiny.num_experts), (tiny.num_experts_per_tok, tiny.num_experts)
    assert type(tiny) is type(config) and tiny.num_experts_per_tok == getattr(tiny, own) == tiny.to_dict()[own]
    if model_type == "ernie4_5_moe":  # one proof in full (Kimi Linear's reference kernels are slow on a CPU)
        verdict = proof.measured_verdict(config)
        assert verdict.split and max(verdict.logits_diff, verdict.grad_diff) <= proof.TOLERANCE, verdict


def test_a_field_with_a_rule_of_its_own_keeps_it_over_its_alias():
    """Inkling's `moe_intermediate_size` is aliased `intermediate_size`, XLM's `vocab_size` `n_words`: each is shrunk
    by the rule of its own name (an expert's width, the tiny vocabulary), not the alias's or left at flagship size."""
    from hfsplit.models.shrink import HIDDEN, VOCAB, shrunk_config

    assert shrunk_config(AutoConfig.for_model("inkling2_text")).moe_intermediate_size == HIDDEN // 2
    assert shrunk_config(AutoConfig.for_model("xlm")).vocab_size == VOCAB


def test_a_layer_count_under_its_own_name_is_shrunk_with_its_layer_pattern():
    """GPT-Neo names its layer count `num_layers` and gives its layers' kinds as `[[kinds, repeats]]`: both are cut
    together, every kind kept, and the shrunk model splits equal to transformers."""
    from hfsplit.models.shrink import MIN_LAYERS, shrunk_config

    config = AutoConfig.for_model("gpt_neo")
    tiny = shrunk_config(config)
    assert tiny.num_layers == MIN_LAYERS and tiny.attention_layers == config.attention_layers[:MIN_LAYERS]
    assert set(tiny.attention_layers) == set(config.attention_layers)
    assert proof.measured_verdict(config).split


def test_a_config_transformers_itself_cannot_use_is_refused_naming_transformers():
    """Ministral's default config leaves `head_dim` None, which its attention cannot build even unshrunk;
    DeepSeek-V2's leaves `num_experts_per_tok` None, which its router cannot run: the refusal says so, not blaming the
    shrink or the split."""
    built = proof.measured_verdict(AutoConfig.for_model("ministral"))
    assert not built.split and built.reason.startswith("transformers cannot build a model from this config, unshrunk "
                                                       "too (TypeError:"), built
    run = proof.measured_verdict(AutoConfig.for_model("deepseek_v2"))
    assert not run.split and run.reason.startswith("transformers' own forward fails on this config, unsplit too "
                                                   "(TypeError: topk()"), run


@pytest.mark.parametrize("model_type", ["hy_v4", "gemma3n_text"])
def test_the_hidden_streams_cross_the_boundary_in_the_loops_own_layout(model_type):
    """HY-V4's hyper-connections carry `(batch, seq, streams, hidden)` from block to block, Gemma 3n's AltUp
    `(streams, batch, seq, hidden)`: a stage sends either as one `(batch, seq, width)` tensor of the width the
    planner counts, and the next stage gets the loop's own layout back, each token's streams its own."""
    from hfsplit.models.boundary import boundary_width, hidden_shape
    from hfsplit.models.shrink import shrunk_config
    from hfsplit.parallel.followed_stage import packed_boundary, unpacked_boundary

    config = shrunk_config(AutoConfig.for_model(model_type))
    hidden = torch.randn(hidden_shape(config, 2, 5))
    sent = packed_boundary(hidden, None, config)
    per_layer = config.num_hidden_layers * (getattr(config, "hidden_size_per_layer_input", None) or 0)
    assert hidden.dim() == 4 and sent.shape == (2, 5, boundary_width(config) - per_layer) == (2, 5, 4 * 64)
    assert torch.equal(sent[1, 3], hidden[1, 3].flatten() if model_type == "hy_v4" else hidden[:, 1, 3].flatten())
    received, carried = unpacked_boundary(sent, config, carries=False)
    assert carried is None and torch.equal(received, hidden)
