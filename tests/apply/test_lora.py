"""LoRA adapters as hfsplit injects them on stage modules."""
import torch


def test_lora_adapters_on_a_16bit_base_are_fp32_as_peft_get_peft_model_keeps_them():
    """The cost model counts fp32 adapters and AdamW state (peft's autocast_adapter_dtype=True); the run holds
    them so on a bf16 base, while the frozen base stays bf16."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from hfsplit.checkpoint.synthetic import tiny_config
    from hfsplit.apply.lora import add_lora, lora_config

    config = tiny_config("llama")
    lora = lora_config(r=4, alpha=8, dropout=0.0, targets=None, model_config=config)
    ours = add_lora(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16), lora, seed=0)
    theirs = get_peft_model(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16),
                            lora_config(r=4, alpha=8, dropout=0.0, targets=None, model_config=config))
    dtypes = {n: p.dtype for n, p in ours.named_parameters() if "lora_" in n}
    expected = {n.removeprefix("base_model.model."): p.dtype for n, p in theirs.named_parameters() if "lora_" in n}
    assert dtypes == expected and set(dtypes.values()) == {torch.float32}
    assert {p.dtype for n, p in ours.named_parameters() if "lora_" not in n} == {torch.bfloat16}
