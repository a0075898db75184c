"""The tiled MLP (hfsplit/apply/tiled_mlp.py), which tiles the block's norms with it: the same losses and gradients as
the untiled run, in fp32, with LoRA and QLoRA adapters, on checkpointed blocks and plain ones; and the MLP's
intermediates and the norms' fp32 copies never exist for the whole sequence."""
import pytest
import torch

from hfsplit.models.tiled_mlp import chunk_sizes, tile_mlps

SEQ = 96


@pytest.mark.parametrize("length, chunks, sizes", [(10, 3, [4, 3, 3]), (4, 8, [1, 1, 1, 1]), (7, 1, [7]),
                                                   (16384, 14, [1171] * 4 + [1170] * 10)])
def test_chunk_sizes_cover_the_sequence_evenly(length, chunks, sizes):
    assert chunk_sizes(length, chunks) == sizes
    assert sum(chunk_sizes(length, chunks)) == length


def _model(tiny_checkpoint, method: str, arch: str = "llama"):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hfsplit.apply.quantize import quantization_config

    qconfig = quantization_config(compute_dtype="float32") if method == "qlora" else None
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(arch), dtype=torch.float32, device_map="cpu",
                                                 quantization_config=qconfig)
    torch.manual_seed(0)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
                      init_lora_weights=False)  # B ≠ 0: the adapters change the output, so their gradients are real
    return get_peft_model(model, lora)


def _loss_and_grads(model, ids, *, chunks: int, checkpointing: bool):
    blocks = model.base_model.model.model.layers
    if chunks:
        assert tile_mlps(blocks, chunks=chunks) == len(blocks)
    if checkpointing:
        model.base_model.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


# the norms the MLP's slices run, from each family's block source (`mlp_neighbours`): Llama's second norm before the
# MLP; Gemma 3's pre- and post-feedforward norms around it; OLMo 2's norm after it. The other norms tile alone.
IN_MLP_SLICES = {"llama": ["post_attention_layernorm"],
                 "gemma3_text": ["pre_feedforward_layernorm", "post_feedforward_layernorm"],
                 "olmo2": ["post_feedforward_layernorm"]}


@pytest.mark.parametrize("method, arch", [("lora", "llama"), ("qlora", "llama"), ("lora", "gemma3_text"),
                                          ("lora", "olmo2")])
@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "plain"])
def test_tiled_mlp_keeps_losses_and_gradients(method, arch, checkpointing, tiny_checkpoint):
    from hfsplit.models.tiled_mlp import block_norms, mlp_neighbours

    ids = torch.randint(3, 256, (2, SEQ), generator=torch.Generator().manual_seed(0))
    whole_model = _model(tiny_checkpoint, method, arch)
    fused = [[name for name, child in block.named_children() if child in mlp_neighbours(block)]
             for block in whole_model.base_model.model.model.layers]
    assert fused == [IN_MLP_SLICES[arch]] * len(fused)
    whole = _loss_and_grads(whole_model, ids, chunks=0, checkpointing=checkpointing)
    tiled_model = _model(tiny_checkpoint, method, arch)
    tiled = _loss_and_grads(tiled_model, ids, chunks=5, checkpointing=checkpointing)
    for block in tiled_model.base_model.model.model.layers:  # the MLP and every norm run in slices
        assert [n.tiled_mlp_chunks for n in [block.mlp, *block_norms(block)]] == [5] * (1 + len(block_norms(block)))
        assert sorted(name for name, child in block.named_children()
                      if getattr(child, "runs_in_mlp_slices", False)) == sorted(IN_MLP_SLICES[arch])
    assert torch.allclose(tiled[0], whole[0], rtol=1e-5, atol=0), (tiled[0], whole[0])
    assert whole[1].keys() == tiled[1].keys() and len(whole[1]) == 2 * 5 * len(tiled_model.base_model.model.model.layers)  # A, B of 5 targets
    # relative to each gradient's norm: a slice's sum over its tokens rounds otherwise than the whole sequence's
    errors = {name: ((tiled[1][name] - grad).norm() / grad.norm()).item() for name, grad in whole[1].items()}
    print(f"largest relative gradient error: {max(errors.values()):.2e}")
    assert all(grad.abs().max() > 0 for grad in whole[1].values())
    assert max(errors.values()) <= 1e-5, max(errors.items(), key=lambda kv: kv[1])
    # generation and evaluation (no gradients) run the slices plainly, with the same values
    with torch.no_grad():
        probe = ids[:, :17]
        assert torch.allclose(tiled_model(input_ids=probe).logits, tiled_model.base_model.model(input_ids=probe).logits)


def test_tiled_mlp_never_holds_the_whole_sequences_intermediate():
    """One Llama MLP at seq 4096: untiled, its backward's peak holds the gate, up, activation and product for the
    whole sequence; tiled in 8, one slice's at a time, so the peak drops by at least half of that."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from hfsplit.planning.costs.trace import LiveBytes

    config = LlamaConfig(hidden_size=64, intermediate_size=512, hidden_act="silu")

    def peak(chunks: int) -> int:
        torch.manual_seed(0)
        mlp = LlamaMLP(config)
        holder = torch.nn.Module()
        holder.mlp = mlp
        if chunks:
            tile_mlps([holder], chunks=chunks)
        x = torch.randn(1, 4096, 64, requires_grad=True)
        with LiveBytes() as live:
            mlp(x).sum().backward()
        return live.peak

    whole, tiled = peak(0), peak(8)
    intermediate = 4 * 4096 * 512 * 4  # gate, up, act(gate), product: fp32
    assert whole - tiled >= intermediate // 2, (whole, tiled)


def test_tiled_norms_never_hold_the_whole_sequences_fp32_copies():
    """Llama's RMSNorm on bf16 states at seq 4096: untiled, it keeps the fp32 upcast of the whole sequence for
    backward and its backward makes several more fp32 tensors of it (the peak the planner's trace found in a
    Llama-3.1-70B block); tiled in 8, one slice's at a time: the peak falls by at least three fp32 copies, and the
    output and input gradient are the untiled ones."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from hfsplit.models.tiled_mlp import block_norms
    from hfsplit.planning.costs.trace import LiveBytes

    x = torch.randn(1, 4096, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    grad = torch.randn(1, 4096, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)

    def run(chunks: int):
        holder = torch.nn.Module()
        holder.mlp, holder.input_layernorm = torch.nn.Identity(), LlamaRMSNorm(64).to(torch.bfloat16)
        if chunks:
            tile_mlps([holder], chunks=chunks)
            assert block_norms(holder) == [holder.input_layernorm]
        given = x.clone().requires_grad_()
        with LiveBytes() as live:
            out = holder.input_layernorm(given)
            out.backward(grad)
        return live.peak, out.detach(), given.grad

    (whole, out, dx), (tiled, tiled_out, tiled_dx) = run(0), run(8)
    assert torch.equal(tiled_out, out) and torch.equal(tiled_dx, dx)
    assert whole - tiled >= 3 * 4096 * 64 * 4, (whole, tiled)


def test_an_mlp_of_experts_is_refused():
    from hfsplit.errors import UnsupportedModelError

    block = torch.nn.Module()
    block.mlp = torch.nn.Module()
    block.mlp.experts = torch.nn.ModuleList()
    with pytest.raises(UnsupportedModelError, match="tiled_mlp off"):
        tile_mlps([block], chunks=4)


class _Block(torch.nn.Module):
    """A block whose norm feeds the MLP."""

    def __init__(self):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        super().__init__()
        self.post_attention_layernorm = LlamaRMSNorm(8)
        self.mlp = torch.nn.Linear(8, 8)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class _NormReadTwice(_Block):
    """The same, its norm's output the residual too."""

    def forward(self, hidden_states):
        residual = self.post_attention_layernorm(hidden_states)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


@pytest.mark.parametrize("twice", [False, True], ids=["norm-feeds-the-mlp", "norm-read-twice"])
def test_only_a_norm_the_block_calls_once_for_the_mlp_runs_in_its_slices(twice):
    """Read from the block's source: the norm goes inside the MLP's slices only where the MLP alone reads its output;
    a norm the block calls elsewhere too keeps its own forward (tiled alone). Either way the values are the block's."""
    from hfsplit.models.tiled_mlp import mlp_neighbours

    torch.manual_seed(0)
    block = _NormReadTwice() if twice else _Block()
    with torch.no_grad():
        block.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 40, 8, requires_grad=True)
    whole = block(x)
    (dx,) = torch.autograd.grad(whole.square().sum(), x)
    assert mlp_neighbours(block) == ((None if twice else block.post_attention_layernorm), None)
    tile_mlps([block], chunks=3)
    assert getattr(block.post_attention_layernorm, "runs_in_mlp_slices", False) == (not twice)
    tiled = block(x)
    (tiled_dx,) = torch.autograd.grad(tiled.square().sum(), x)
    assert torch.allclose(tiled, whole, rtol=1e-6, atol=1e-6) and torch.allclose(tiled_dx, dx, rtol=1e-5, atol=1e-6)
