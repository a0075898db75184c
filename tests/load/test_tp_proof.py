"""The tp=2 proof on the user's own config (load/tp_proof.py): its two child ranks (forked, or fresh interpreters inside
a launch), its cache by the config's hash, its refusals without a process, and `hfsplit check --tp 2`."""
import multiprocessing
import signal
import subprocess
import sys

import pytest
import torch.distributed as dist
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


def test_a_launched_rank_never_forks_the_proof(tmp_path):
    # a forked rank would inherit the launch's connections to its peers (the launched tp tests run the fresh path)
    assert tp_proof.fork_is_safe()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert not tp_proof.fork_is_safe()
    finally:
        dist.destroy_process_group()


def test_a_forked_rank_that_fails_is_named_from_its_own_log(monkeypatch):
    own = tp_proof.config_tp_verdict

    def rank_1_fails(config, mesh):
        if dist.get_rank() == 1:
            raise RuntimeError("rank 1 could not shard")
        return own(config, mesh)

    monkeypatch.setattr(tp_proof, "config_tp_verdict", rank_1_fails)  # the forked ranks inherit it
    verdict = tp_proof.ranks_verdict(LlamaConfig(), tp_proof.forked_ranks)
    assert not verdict.proven
    assert verdict.reason == "its tp=2 proof ranks failed (RuntimeError: rank 1 could not shard)"


def test_a_failed_rank_has_its_peer_killed_and_late_ranks_are_killed_at_the_timeout():
    def python(code):
        return subprocess.Popen([sys.executable, "-c", code])

    ranks = [python("import time; time.sleep(60)"), python("raise SystemExit(3)")]
    assert tp_proof.blamed_rank(ranks, timeout_s=120) == 1  # the peer does not sleep its 60 s out
    assert [rank.returncode for rank in ranks] == [-signal.SIGKILL, 3]
    ranks = [python("import time; time.sleep(60)") for _ in range(2)]
    assert tp_proof.blamed_rank(ranks, timeout_s=0.5) is None
    assert [rank.returncode for rank in ranks] == [-signal.SIGKILL] * 2


def test_a_prover_forked_before_a_launchs_group_proves_inside_it(tmp_path):
    # a launched rank 0 forks it before it joins its group, so that the proof's ranks still fork (no imports)
    config = LlamaConfig(num_key_value_heads=4, attention_bias=True)
    with tp_proof.forked_prover() as measure:
        assert measure is not tp_proof.ranks_verdict
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        try:
            verdict = measure(config)
        finally:
            dist.destroy_process_group()
    assert verdict.model_type == "llama" and verdict.proven and verdict.logits_diff <= 1e-5
    assert not multiprocessing.active_children()  # the prover ended with the block


def test_a_proof_that_crashed_or_hung_is_not_cached_and_runs_again():
    config = LlamaConfig(rms_norm_eps=1.234e-5)  # a config no other test proves
    calls = []

    def crashed(config):
        calls.append(1)
        return tp_proof.TpVerdict(config.model_type, False, f"{tp_proof.RANKS_FAILED} (Killed)")

    first = tp_proof.tp_verdict_of(config, measure=crashed)
    assert not first.proven and read_cache("tp_proof", config_key(config)) is None
    assert tp_proof.tp_verdict_of(config, measure=crashed) == first and len(calls) == 2
    refused = tp_proof.TpVerdict(config.model_type, False, tp_proof.DIFFER + "model.layers.0.mlp.up_proj.weight")
    tp_proof.tp_verdict_of(config, measure=lambda config: refused)
    assert read_cache("tp_proof", config_key(config))["reason"] == refused.reason  # the model's own verdict: kept


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
