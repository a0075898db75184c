"""The transient a stage's peak adds to its kept activations (planner.stage_transient), and the opt-in glibc fix."""
import subprocess
import sys
from pathlib import Path

import pytest

from hfsplit.costs import ModelCosts, PartCost, TrainingSpec
from hfsplit.planner import Slot, stage_transient

MIB = 1 << 20


def _costs(*, head_acts: int, block_ws: int, head_ws: int) -> ModelCosts:
    embed = PartCost(0, 0, 0, activation_bytes=0, workspace_bytes=1 * MIB, flops=0.0)
    block = PartCost(0, 0, 0, activation_bytes=1 * MIB, workspace_bytes=block_ws, flops=0.0)
    head = PartCost(0, 0, 0, activation_bytes=head_acts, workspace_bytes=head_ws, flops=0.0)
    return ModelCosts(4, 1, embed, block, head, tied=False, spec=TrainingSpec(method="full"))


def _slot(*, actions: int = 2, has_head: bool = True) -> Slot:
    return Slot(index=0, pp_rank=0, devices=(("cpu",),), budget=1 << 40, speed=1.0, in_flight=1, has_embed=True,
                has_head=has_head, actions=actions)


@pytest.mark.parametrize("head_acts, block_ws, head_ws, want", [
    (4, 11, 3, 7),  # checkpointed block: its recompute (11) comes after the head's 4 are freed
    (4, 3, 3, 3),  # the head's own workspace is the peak
    (0, 11, 3, 11),  # nothing behind the block
])
def test_a_parts_workspace_does_not_meet_the_activations_behind_it(head_acts, block_ws, head_ws, want):
    costs = _costs(head_acts=head_acts * MIB, block_ws=block_ws * MIB, head_ws=head_ws * MIB)
    assert stage_transient(costs, _slot(), 4) == want * MIB


def test_zero_bubble_and_headless_stages():
    costs = _costs(head_acts=4 * MIB, block_ws=11 * MIB, head_ws=3 * MIB)
    # zero bubble: the activations stay until the deferred weight gradients, so the largest workspace counts whole
    assert stage_transient(costs, _slot(actions=3), 4) == 11 * MIB
    assert stage_transient(costs, _slot(has_head=False), 4) == 11 * MIB


def test_mmap_threshold_is_opt_in():
    """In a fresh process (mallopt would change this one's allocator): unset or 0 leaves glibc alone, a size sets it."""
    path = Path(__file__).resolve().parents[1] / "hfsplit" / "host_memory.py"
    code = ("import importlib.util, os; s = importlib.util.spec_from_file_location('h', %r); h = importlib.util."
            "module_from_spec(s); s.loader.exec_module(h); print(h.fix_mmap_threshold(), h.fix_mmap_threshold(0), "
            "h.fix_mmap_threshold(65536))" % str(path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PATH": ""})
    glibc = "glibc" in " ".join(__import__("platform").libc_ver())
    assert out.stdout.split() == ["False", "False", str(glibc)]
