"""Running a given Plan: process layout (`mesh`), stage modules, pipeline schedules, the split model, generation on
the split stages, saving it as a Hugging Face folder, MoE router statistics, host memory. Never imports planning/,
load/ or training/."""
