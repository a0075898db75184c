"""Fine-tuning: options, data, building a run (`run`), the loop (`trainer`), checkpoints, metrics, save, resume,
elastic regrouping."""
