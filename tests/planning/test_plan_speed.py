"""What keeps the no-fit diagnosis fast without changing what it says."""
import re

import pytest
from transformers import LlamaConfig

from hfsplit.planning import planner
from hfsplit.plan import TrainingSpec
from hfsplit.errors import PlanError


def _config():
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=64)


def _diagnose(budget: str, spec: TrainingSpec, monkeypatch) -> tuple[str, set]:
    tried, real = set(), planner.best_plan  # the diagnosis plans a change of size with make_plan's own search
    monkeypatch.setattr(planner, "best_plan",
                        lambda config, b, s, **kw: tried.add(s.seq_len) or real(config, b, s, **kw))
    with pytest.raises(PlanError) as err:
        # the knobs the planner turns itself held off: this asks what the diagnosis says, not whether they fit it
        planner.make_plan(_config(), budget, spec=spec, schedule="1F1B", chunked_loss=False, tiled_mlp="off",
                          micro_batches=1)
    return str(err.value), tried


def test_the_longest_shorter_sequence_is_searched_only_when_the_shortest_fits(monkeypatch):
    spec = TrainingSpec(method="full", seq_len=2048, micro_batch_size=2, dtype="float32", reserve_bytes=0)
    need = {seq: planner.make_plan(_config(), "64GiB", spec=TrainingSpec(**{**spec.__dict__, "seq_len": seq}),
                                   activation_checkpointing=True).stages[0].memory.total for seq in (512, 1024)}
    between = (need[512] + need[1024]) // 2  # seq 512 fits, 1024 does not
    message, tried = _diagnose(f"{between}B", spec, monkeypatch)
    # the longest that fits, by binary search in steps of 256 from 256 (seq 512 fits, 1024 does not)
    found = int(re.search(r"a shorter sequence \(--seq-len (\d+), the longest that fits", message).group(1))
    assert 512 <= found < 1024 and found % 256 == 0 and {256, found, found + 256} <= tried
    message, tried = _diagnose("1KiB", spec, monkeypatch)  # not even the weights fit
    assert "a shorter sequence (--seq-len" not in message and not tried & {1024, 512, 256}
