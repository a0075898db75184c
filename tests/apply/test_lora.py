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


def test_lora_adapting_fused_experts_at_tp2_is_refused_on_the_meta_stages():
    """Before any weight is read, the run probes its own LoRA on copies of its meta stages with peft: Qwen3-Next's
    default targets make peft adapt the experts' `gate_up_proj` too (its MoE target conversion of the shared expert's
    `gate_proj` and `up_proj`), refused at tp=2 in one line naming them and the fix; accepted at tp=1, and at tp=2
    where no target reaches the experts (Qwen3-MoE's default: attention)."""
    import pytest

    from hfsplit.apply.lora import check_expert_lora
    from hfsplit.checkpoint.synthetic import tiny_config
    from hfsplit.errors import PlanError
    from hfsplit.parallel.stage import build_stage_module
    from tests.parallel.cases import hand_plan

    def check(arch: str, tp: int) -> None:
        config = tiny_config(arch)
        plan = hand_plan(config, tp=tp, pp=1, layers=[(0, config.num_hidden_layers)], schedule="GPipe", method="lora")
        modules = [build_stage_module(config=config, stage=plan.stages[0], tied=plan.tied_embeddings)]
        check_expert_lora(modules, None, plan=plan)
        assert not any("lora_" in n for n, _ in modules[0].named_parameters())  # probed on copies

    with pytest.raises(PlanError) as refused:
        check("qwen3_next", 2)
    line = str(refused.value)
    assert line.startswith("LoRA's default targets include gate_proj,up_proj at tp=2: LoRA on the fused experts' "
                           "parameters mlp.experts.gate_up_proj (peft's MoE target conversion") and "\n" not in line
    assert "use --tp 1" in line and "pass --lora-targets without gate_proj,up_proj" in line, line
    check("qwen3_next", 1)
    check("qwen3_moe", 2)
