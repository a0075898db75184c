"""Applying a Plan to stage modules: one module per step (`tp`, `checkpointing`, `load`, `quantize`, `lora`,
`autocast`) and `steps.apply_plan`, which runs `plan.steps()` in order through one table; beside `quantize`, an
MoE's fused experts in 4 bits (`quantized_experts`, its LoRA `quantized_experts_lora`, the shared primitive `nf4`).
Never imports planning/, parallel/, load/ or training/."""
