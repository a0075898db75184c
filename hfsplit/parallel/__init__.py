"""Running a given Plan: process layout (`mesh`), stage modules, pipeline schedules, the split model, MoE router
statistics, host memory. Never imports planning/ or training/."""
