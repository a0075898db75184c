"""4-bit fused experts (hfsplit.apply.quantized_experts) in one process: against transformers' own MoE forward on the same
NF4 bytes dequantized, LoRA on them against peft on that dequantized base, the routed-only dequantization counted,
and the bytes held against the plan's formula."""
import copy

import pytest
import torch

from hfsplit.apply.quantize import held_bytes, quantization_config, quantize_module
from hfsplit.apply.quantized_experts import ExpertsNF4, dequantized_experts, experts_modules, is_quantized_experts
from hfsplit.checkpoint.quantized import quantized_experts_bytes
from tests.planning.test_costs import tiny_config

EXPERT_TARGETS = ["q_proj", "gate_up_proj", "down_proj"]


def quantized_and_reference(family: str):
    """(a tiny `family` model whose blocks are quantized as hfsplit's loaders quantize them, linears and experts;
    transformers' model with the same bnb linears and its experts' 3-D parameters holding the NF4 bytes dequantized)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family == "gpt_oss":  # its router and expert biases start at zero: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.normal_(p, std=0.1)
    reference = copy.deepcopy(model)
    qconfig = quantization_config(compute_dtype="float32")
    for block, twin in zip(model.model.layers, reference.model.layers):
        quantize_module(block, qconfig, device=torch.device("cpu"))
        quantize_module(twin, qconfig, device=torch.device("cpu"), experts=False)  # the same linears, 16-bit experts
        for (_, experts), (_, theirs) in zip(experts_modules(block), experts_modules(twin)):
            for name, store in experts.nf4_experts.items():
                getattr(theirs, name).data.copy_(dequantized_experts(experts, name))
                store.dequantized.clear()
    return model.train(), reference.train()


def step(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n.replace(".base_layer", ""): p.grad for n, p in model.named_parameters()
                                 if p.grad is not None}


def worst_grad_rel_diff(grads, expected) -> float:
    assert sorted(grads) == sorted(expected) and grads
    return max(((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item() for n, g in expected.items())


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_4bit_experts_equal_transformers_on_their_dequantized_bytes_and_dequantize_only_routed_experts(family):
    """Logits and input gradients (the embeddings trained, all else frozen) through the 4-bit experts equal
    transformers' forward on the same NF4 bytes dequantized; forward dequantizes exactly the experts that received a
    token (each once), backward the same again; an expert that got no token is never dequantized."""
    model, reference = quantized_and_reference(family)
    for m in (model, reference):
        for name, p in m.named_parameters():
            p.requires_grad_(name == "model.embed_tokens.weight")
    routed = {}  # {layer: experts the router picked}, by transformers' own router on the quantized model
    for i, block in enumerate(model.model.layers):
        block.mlp.experts.register_forward_pre_hook(
            lambda _m, args, i=i: routed.__setitem__(i, set(args[1].flatten().tolist())))
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])  # 3 distinct tokens: at most 6 of 4 experts... often fewer
    logits, grads = step(model, ids)
    want, expected = step(reference, ids)
    assert (logits - want).abs().max() <= 1e-5
    assert worst_grad_rel_diff(grads, expected) <= 1e-5
    for i, block in enumerate(model.model.layers):
        for store in block.mlp.experts.nf4_experts.values():
            assert dict(store.dequantized) == {e: 2 for e in routed[i]}, (i, routed[i])  # forward + backward
    assert any(len(r) < 4 for r in routed.values())  # the counting covers an unrouted expert


@pytest.mark.parametrize("family, wrapper", [("mixtral", "hfsplit"), ("qwen3_moe", "hfsplit"), ("mixtral", "peft")])
def test_lora_on_4bit_experts_equals_peft_on_the_dequantized_base(family, wrapper):
    """peft's target parameters on 4-bit experts against plain peft on the dequantized base (its dense ΔW): logits and
    every adapter's gradient within 1e-5, from the same init. On the 4-bit experts, hfsplit's wrapper (lora_config's:
    peft's adapters, the ΔW applied split) and peft's own `ParamWrapper` (a user's LoraConfig: its factors read from
    the parametrization it registers) alike."""
    import dataclasses

    from peft import LoraConfig, get_peft_model

    from hfsplit.apply.lora import lora_config, seed_lora_weights

    config = tiny_config(family)
    model, reference = quantized_and_reference(family)
    ours = lora_config(r=4, alpha=8, dropout=0.0, targets=EXPERT_TARGETS, model_config=config)
    plain = LoraConfig(**{f.name: getattr(ours, f.name) for f in dataclasses.fields(LoraConfig) if f.init})
    wrapped = [get_peft_model(model, ours if wrapper == "hfsplit" else plain), get_peft_model(reference, plain)]
    for m in wrapped:
        seed_lora_weights(m, seed=3)
        for name, p in m.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(name)))
    assert {type(m).__module__ for n, m in wrapped[0].named_modules() if n.endswith("mlp.experts")} == {
        "hfsplit.apply.quantized_experts_lora" if wrapper == "hfsplit" else "peft.tuners.lora.layer"}
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    (logits, grads), (want, expected) = step(wrapped[0], ids), step(wrapped[1], ids)
    assert (logits - want).abs().max() <= 1e-5
    assert [n for n in grads if "experts" in n and "lora_A" in n]
    assert worst_grad_rel_diff(grads, expected) <= 1e-5


@pytest.mark.parametrize("shape", [(4, 256, 64), (3, 40, 24), (2, 1000, 384), (3, 512, 256)])  # the last: one call
@pytest.mark.parametrize("double_quant", [True, False])
def test_4bit_expert_bytes_are_exactly_what_the_plan_counts(shape, double_quant):
    """Each expert quantized alone, bit for bit as bitsandbytes quantizes that matrix as one weight; the bytes held
    (placeholder included) equal `quantized_experts_bytes`."""
    import bitsandbytes.functional as F
    from torch import nn

    from hfsplit.apply.quantized_experts import quantize_experts

    class Experts(nn.Module):  # the experts interface transformers' decorator declares
        has_gate, has_bias, is_transposed = True, False, False

        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(shape))

    module = Experts()
    weights = module.gate_up_proj.detach().clone()
    qconfig = quantization_config(double_quant=double_quant, compute_dtype="float32")
    quantize_experts(module, qconfig, device=torch.device("cpu"))
    store = module.nf4_experts["gate_up_proj"]
    assert isinstance(store, ExpertsNF4) and is_quantized_experts(module)
    together = [store.dequantize(range(shape[0])), store.dequantize([shape[0] - 1, 0])]  # a run, and a pick
    for e in range(shape[0]):
        packed, state = F.quantize_4bit(weights[e].contiguous(), blocksize=64, compress_statistics=double_quant,
                                        quant_type="nf4")
        assert torch.equal(store.packed[e], packed.view(-1))
        assert torch.equal(store.dequantize([e])[0], F.dequantize_4bit(packed, state))
        assert torch.equal(together[0][e], F.dequantize_4bit(packed, state))
    assert torch.equal(together[1][1], together[0][0]) and torch.equal(together[1][0], together[0][-1])
    assert held_bytes(module) - 4 == quantized_experts_bytes(*shape, double_quant=double_quant)  # + the placeholder


def test_experts_read_one_by_one_from_a_merged_and_a_fused_checkpoint(tmp_path, tiny_checkpoint):
    """`read_expert_into` gives `read(name)[e]`, from Mixtral's one-tensor-per-expert checkpoint (merged on load) and
    from a checkpoint storing the fused `[E, d1, d2]` tensor as transformers' model names it."""
    from safetensors.torch import save_file

    from hfsplit.checkpoint import load_config
    from hfsplit.checkpoint.reader import CheckpointReader
    from hfsplit.models.layout import meta_model

    merged = tiny_checkpoint("mixtral")
    fused = tmp_path / "fused"
    fused.mkdir()
    for source in (merged, fused):
        reader = CheckpointReader.open(merged, model=meta_model(load_config(merged)))
        name = "model.layers.1.mlp.experts.gate_up_proj"
        if source is fused:
            save_file({name: reader.read(name)}, str(fused / "model.safetensors"))
            reader = CheckpointReader.open(fused, needed=[name])
        whole = reader.read(name)
        for e in range(whole.shape[0]):
            one = reader.read_expert_into(name, e, torch.empty(whole.shape[1:], dtype=torch.bfloat16))
            assert torch.equal(one, whole[e].bfloat16())
