"""Offloaded activation checkpointing on one process: the same losses and gradients as checkpointing on the device,
each block's input in host memory between its forward and its recompute, and host buffers a device-side counter
can leave out. The split runs (pipeline, TP, QLoRA, against the plan) are in tests/parallel/test_apply.py."""
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MixtralConfig

from hfsplit.apply.checkpointing import apply_activation_checkpointing
from hfsplit.apply.offload import HostBytes, StageOffload
from tests.parallel.apply_cases import LiveStorages

CONFIG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)
BATCH, SEQ = 2, 16
HIDDEN_BYTES = BATCH * SEQ * CONFIG.hidden_size * 4  # one block input, fp32


def _step(state: dict, *, offload: StageOffload | None):
    """(loss, gradients, live device bytes once forward is done) of one training step of the 3-block model."""
    model = LlamaForCausalLM(CONFIG)
    model.load_state_dict(state)
    model.train()
    apply_activation_checkpointing(model.model.layers, offload=offload)
    ids = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with LiveStorages() as live:
        loss = model(input_ids=ids, labels=ids).loss
        after_forward = live.live
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, after_forward


@pytest.mark.parametrize("keep_first", [False, True])
def test_offload_gives_checkpointings_losses_and_gradients_and_holds_the_inputs_on_the_host(keep_first):
    torch.manual_seed(0)
    state = LlamaForCausalLM(CONFIG).state_dict()
    loss, grads, on_device = _step(state, offload=None)
    counter = HostBytes()
    offload = StageOffload(device=torch.device("cpu"), keep_first=keep_first, counter=counter)
    offloaded_loss, offloaded_grads, with_offload = _step(state, offload=offload)
    assert torch.equal(offloaded_loss, loss)  # the same recompute from the same (copied) inputs
    assert all(torch.equal(offloaded_grads[n], g) for n, g in grads.items())
    blocks = CONFIG.num_hidden_layers - keep_first  # a stage fed by another keeps its first block's input
    assert counter.peak == blocks * HIDDEN_BYTES  # every other block's input, one copy each
    assert counter.live == 0  # each went when its block's backward was done
    # the device-side counter leaves the host buffers out: forward leaves their inputs off the device
    assert on_device - with_offload == blocks * HIDDEN_BYTES


def test_a_block_run_without_gradients_is_not_offloaded():
    counter = HostBytes()
    offload = StageOffload(device=torch.device("cpu"), keep_first=False, counter=counter)
    model = LlamaForCausalLM(CONFIG)
    apply_activation_checkpointing(model.model.layers, offload=offload)
    with torch.no_grad():  # eval and generation run the blocks plainly, nothing saved
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    assert counter.peak == 0


MIXTRAL = MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=100, num_local_experts=4, num_experts_per_tok=2,
                        output_router_logits=True, router_aux_loss_coef=0.1)


@pytest.mark.parametrize("config, packed", [(CONFIG, True), (MIXTRAL, False), (MIXTRAL, True)],
                         ids=["llama-packed", "mixtral-router-loss", "mixtral-packed"])
def test_offload_keeps_checkpointings_losses_on_packed_rows_and_moe_router_loss(config, packed):
    """Packed rows (position ids restarting per example: transformers' block mask, built again in the recompute)
    and an MoE whose loss adds the router's load-balancing term: offloaded checkpointing gives checkpointing's
    loss and gradients exactly, and holds one block input per block on the host."""
    torch.manual_seed(0)
    model_class = type(AutoModelForCausalLM.from_config(config))
    state = model_class(config).state_dict()
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(5), torch.arange(7), torch.arange(SEQ - 12)]).repeat(BATCH, 1)

    def step(offload):
        model = model_class(config)
        model.load_state_dict(state)
        model.train()
        apply_activation_checkpointing(model.model.layers, offload=offload)
        out = model(input_ids=ids, labels=ids, position_ids=positions if packed else None)
        out.loss.backward()
        return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    (plain, grads), counter = step(None), HostBytes()
    offloaded, offloaded_grads = step(StageOffload(device=torch.device("cpu"), keep_first=False, counter=counter))
    assert torch.equal(offloaded.loss, plain.loss)
    if config is MIXTRAL:
        assert plain.aux_loss > 0 and torch.equal(offloaded.aux_loss, plain.aux_loss)
    assert offloaded_grads.keys() == grads.keys() and all(torch.equal(offloaded_grads[n], g) for n, g in grads.items())
    assert counter.peak == config.num_hidden_layers * BATCH * SEQ * config.hidden_size * 4 and counter.live == 0
