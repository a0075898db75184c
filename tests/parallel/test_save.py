"""Saving a split model (hfsplit/parallel/save.py): what a merged folder folds in."""
import torch


def test_a_merge_folds_in_lora_on_fused_expert_parameters():
    """peft adapts Qwen3-Next's fused experts by the parameter (its MoE conversion of a `gate_proj` target): a split's
    merged save adds that delta as peft's merge_and_unload does (hfsplit.parallel.save)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from hfsplit.apply.lora import lora_config
    from hfsplit.checkpoint.synthetic import tiny_config
    from hfsplit.parallel.save import parameter_lora_delta

    config = tiny_config("qwen3_next")
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(config),
                           lora_config(r=8, alpha=16, dropout=0.0, targets=None, model_config=config))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    inner, name = model.base_model.model, "model.layers.0.mlp.experts.base_layer.gate_up_proj"
    delta = parameter_lora_delta(inner, name)
    ours = inner.get_parameter(name).detach() + delta
    assert delta.abs().max() > 0 and parameter_lora_delta(inner, "model.layers.0.mlp.experts.base_layer.down_proj") == 0
    merged = model.merge_and_unload().get_parameter("model.layers.0.mlp.experts.gate_up_proj")
    torch.testing.assert_close(ours, merged.detach(), rtol=0, atol=0)
