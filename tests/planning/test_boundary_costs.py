"""What a stage sends its pipeline neighbour, as the planner counts it: Gemma 3n and Gemma 4 send their per-layer
inputs (and Gemma 3n its AltUp streams) with the hidden state (hfsplit.parallel.followed_stage.packed_boundary), so
their receive buffers, kept outputs and link time are wider than `hidden_size`; a Llama's are the hidden state."""
from dataclasses import replace

import pytest
from transformers import AutoConfig

from hfsplit.models.shrink import shrunk_config
from hfsplit.plan import TrainingSpec
from hfsplit.planning.buffers import pipeline_buffer_bytes
from hfsplit.planning.costs.model import model_costs
from hfsplit.planning.stage_costs import Slot, slot_time, stage_memory

SPEC = TrainingSpec(method="full", seq_len=16, micro_batch_size=2, dtype="float32")
TOKENS = SPEC.micro_batch_size * SPEC.seq_len


def sent_values(config) -> int:
    """Values per token on the wire, from the config's own fields: the hidden streams side by side, then each
    block's per-layer input."""
    streams = getattr(config, "altup_num_inputs", None) or 1
    per_layer = getattr(config, "hidden_size_per_layer_input", None) or 0
    return streams * config.hidden_size + config.num_hidden_layers * per_layer


@pytest.mark.parametrize("model_type, wider", [("gemma3n_text", True), ("gemma4_text", True), ("llama", False)])
def test_boundary_bytes_count_what_a_stage_sends(model_type, wider):
    config = shrunk_config(AutoConfig.for_model(model_type))
    costs = model_costs(config, SPEC)
    assert costs.boundary_bytes == TOKENS * sent_values(config) * 4
    assert (costs.boundary_bytes > TOKENS * config.hidden_size * 4) == wider
    assert costs.hidden_bytes == TOKENS * config.hidden_size * 4  # a TP all-reduce's message stays the hidden state


@pytest.mark.parametrize("model_type", ["gemma3n_text", "gemma4_text"])
def test_a_later_stage_holds_and_sends_the_wider_boundary(model_type):
    """A second pipeline stage of four micro-batches: its receive and gradient buffers, and its link time, grow
    by the per-layer inputs and streams beyond the hidden state."""
    config = shrunk_config(AutoConfig.for_model(model_type))
    costs = model_costs(config, SPEC)
    narrow = replace(costs, boundary_bytes=costs.hidden_bytes)
    slot = Slot(index=1, pp_rank=1, devices=(("cpu",),), budget=1 << 40, speed=1.0, in_flight=2, has_embed=False,
                has_head=True, sends=1, micro_batches=4)
    layers = config.num_hidden_layers // 2
    extra = costs.boundary_bytes - costs.hidden_bytes
    grown = stage_memory(costs, slot, layers).activations - stage_memory(narrow, slot, layers).activations
    assert grown == pipeline_buffer_bytes(extra, has_embed=False, has_head=True, in_flight=2, micro_batches=4,
                                          training=True) > 0
    sent = 2 * (slot.link.send_s(costs.boundary_bytes) - slot.link.send_s(costs.hidden_bytes))  # forward + gradient
    assert slot_time(costs, slot, layers) - slot_time(narrow, slot, layers) == pytest.approx(sent)
