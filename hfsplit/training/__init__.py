"""Training: data, loop, save/resume."""
