"""The tp=2 proof on the user's own config (load/tp_proof.py): its two child ranks, its cache by the config's hash,
its refusals without a process, and `hfsplit check --tp 2`."""
import pytest
from transformers import AutoConfig, LlamaConfig

from hfsplit.errors import UnsupportedModelError
from hfsplit.load import tp_proof
from hfsplit.load.proof import config_key
from hfsplit.models.families import tp_degree_error, tp_plan_of
from hfsplit.planning.costs.cache import read_cache


def no_ranks(config):
    raise AssertionError("the verdict must come without spawning the proof's ranks")


@pytest.mark.slow
def test_the_tp_proof_runs_on_the_users_own_flags_and_a_second_call_reads_the_cache(monkeypatch):
    # not llama's default: biased projections, tied embeddings, grouped key-value heads
    config = LlamaConfig(attention_bias=True, mlp_bias=True, tie_word_embeddings=True, num_key_value_heads=8)
    assert config_key(config) != config_key(LlamaConfig())
    verdict = tp_proof.proven_tp(config)
    assert verdict.proven and verdict.logits_diff <= 1e-5 and verdict.grad_diff <= 1e-5
    assert read_cache("tp_proof", config_key(config))["proven"] is True  # cached under this config's hash
    monkeypatch.setattr(tp_proof, "ranks_verdict", no_ranks)
    assert tp_proof.proven_tp(config) == verdict
    assert "llama: tp=2 shards equal transformers on this config" in verdict.line()


def test_a_type_hfsplit_cannot_shard_is_refused_by_name_without_a_process(monkeypatch):
    monkeypatch.setattr(tp_proof, "ranks_verdict", no_ranks)
    with pytest.raises(UnsupportedModelError, match="declares no tensor-parallel plan"):
        tp_proof.proven_tp(AutoConfig.for_model("gpt2"))


def test_hfsplit_check_tp_2_refuses_a_type_the_sweep_refused_with_exit_2(tmp_path, capsys, monkeypatch):
    from hfsplit.cli.plan import main

    monkeypatch.setattr(tp_proof, "ranks_verdict", no_ranks)  # the type-level record refuses it first
    AutoConfig.for_model("doge").save_pretrained(tmp_path)
    assert main(["check", str(tmp_path), "--tp", "2"]) == 2
    captured = capsys.readouterr()
    assert "doge: split equals transformers (pp=2" in captured.out
    assert captured.err.startswith("hfsplit check: tp=2: doge's split follows the model's own forward")
    assert len(captured.err.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_flag_the_type_level_sweep_never_saw_is_proven_on_the_users_config():
    # GLM-4.5's q/k norms (use_qk_norm, off in glm4_moe's default config, which the sweep proves): the proof on this
    # config found each rank's replicated q_norm seeing only its heads, its gradient 0.99 off unsummed, until the
    # amendment summed it over the ranks (TP_PLAN_AMENDS)
    config = AutoConfig.for_model("glm4_moe", use_qk_norm=True)
    assert tp_degree_error(config, 2) is None  # the type-level record lets it through
    assert "q_norm" in "".join(tp_plan_of(config))
    verdict = tp_proof.proven_tp(config)
    assert verdict.proven and verdict.grad_diff <= 1e-5 and not verdict.rounding


def test_whatever_the_tp_proof_hits_on_rank_0_every_rank_raises(tmp_path):
    """Rank 0 runs the proof and broadcasts its outcome: an hfsplit error (a missing folder) is raised on both ranks
    with its type and message; an unexpected one (a config with zero attention heads: ZeroDivisionError) rank 0
    re-raises as it came and rank 1 as one line naming it. Only the refusal of the proof used to reach rank 1, which
    otherwise waited in the broadcast forever."""
    import json

    from hfsplit.checkpoint.synthetic import tiny_config
    from tests.parallel.launcher import launch

    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({**tiny_config("llama").to_dict(), "num_attention_heads": 0}))
    missing = str(tmp_path / "missing")
    ranks = launch("tests.parallel.cases:tp_proof_errors", world_size=2, timeout_s=120,
                   kwargs={"folders": [missing, str(odd)]})
    gone, bug = zip(*ranks)
    assert gone[0] == gone[1] and gone[0][0] == "CheckpointError" and missing in gone[0][1], gone
    assert bug[0] == ("ZeroDivisionError", "integer modulo by zero"), bug
    assert bug[1] == ("UnsupportedModelError", "the tensor-parallel proof failed on rank 0: ZeroDivisionError: "
                                                "integer modulo by zero"), bug
