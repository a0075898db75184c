"""Applying a Plan to stage modules: one module per step (`tp`, `checkpointing`, `load`, `quantize`, `lora`,
`autocast`) and `steps.apply_plan`, which runs `plan.steps()` in order through one table. Never imports
planning/, parallel/, load/ or training/."""
