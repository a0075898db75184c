"""The transient a stage's peak adds to its kept activations (stage_costs.stage_transient), and the opt-in glibc fix."""
import subprocess
import sys
from pathlib import Path

import pytest

from hfsplit.plan import TrainingSpec
from hfsplit.planning.costs.model import ModelCosts, PartCost
from hfsplit.planning.stage_costs import Slot, stage_transient

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


def test_zero_bubble_stage_keeps_every_parts_deferred_gradients():
    """The split backward's input pass runs the whole stage before its weight pass: each part's deferred output
    gradients (per block, times the blocks) stay beside the largest workspace; other schedules never hold them."""
    from dataclasses import replace

    costs = _costs(head_acts=4 * MIB, block_ws=11 * MIB, head_ws=3 * MIB)
    costs = replace(costs, embed=replace(costs.embed, deferred_bytes=1 * MIB),
                    block=replace(costs.block, deferred_bytes=2 * MIB),
                    head=replace(costs.head, deferred_bytes=3 * MIB))
    assert stage_transient(costs, _slot(actions=3), 4) == (11 + 1 + 4 * 2 + 3) * MIB
    assert stage_transient(costs, _slot(actions=3, has_head=False), 4) == (11 + 1 + 4 * 2) * MIB
    assert stage_transient(costs, _slot(), 4) == 7 * MIB


def test_deferred_gradients_are_the_trainable_weights_outputs():
    """A Llama block (hidden 128, 4 heads of 32, 2 KV heads, MLP 256) at 1024 tokens in fp32: full training keeps the
    output gradient of q, k, v, o, gate, up, down and both norms; LoRA those of each adapter's B (the base layer's
    size) and A (the rank), in the adapters' fp32; tp=2 halves the colwise outputs."""
    from transformers import LlamaConfig

    from hfsplit.planning.costs.model import model_costs

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=256)
    row = 1024 * 4  # bytes of one feature over the micro-batch's tokens
    spec = dict(seq_len=512, micro_batch_size=2, dtype="float32")
    full = model_costs(config, TrainingSpec(method="full", **spec))
    assert full.block.deferred_bytes == (128 + 64 + 64 + 128 + 256 + 256 + 128 + 2 * 128) * row
    assert (full.embed.deferred_bytes, full.head.deferred_bytes) == (128 * row, (256 + 128) * row)
    lora = model_costs(config, TrainingSpec(method="lora", lora_r=8, **spec))
    assert lora.block.deferred_bytes == (128 + 64 + 64 + 128 + 256 + 256 + 128 + 7 * 8) * row
    assert (lora.embed.deferred_bytes, lora.head.deferred_bytes) == (0, 0)
    lora_tp2 = model_costs(config, TrainingSpec(method="lora", lora_r=8, **spec), tp=2)
    assert lora_tp2.block.deferred_bytes == (64 + 32 + 32 + 128 + 128 + 128 + 128 + 7 * 8) * row


def test_mmap_threshold_is_opt_in():
    """In a fresh process (mallopt would change this one's allocator): unset or 0 leaves glibc alone, a size sets it."""
    path = Path(__file__).resolve().parents[2] / "hfsplit" / "parallel" / "host_memory.py"
    code = ("import importlib.util, os; s = importlib.util.spec_from_file_location('h', %r); h = importlib.util."
            "module_from_spec(s); s.loader.exec_module(h); print(h.fix_mmap_threshold(), h.fix_mmap_threshold(0), "
            "h.fix_mmap_threshold(65536))" % str(path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PATH": ""})
    glibc = "glibc" in " ".join(__import__("platform").libc_ver())
    assert out.stdout.split() == ["False", "False", str(glibc)]
