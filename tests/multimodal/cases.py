"""What each rank runs for the multimodal save test (started by tests/parallel/launcher.py)."""
from __future__ import annotations

from pathlib import Path

import torch


def lora_split_saved(*, checkpoint: str, out_dir: str, probe: list) -> dict:
    """The multimodal checkpoint's language model split over two ranks with LoRA: its logits before and after its
    adapters are moved (as training moves them), then saved as an adapter and as merged full weights."""
    from hfsplit.apply.lora import LoraSetup, lora_config
    from hfsplit.checkpoint import load_config
    from hfsplit.load.launch import split_from_pretrained
    from hfsplit.parallel.save import save_split_model
    from tests.parallel.cases import hand_plan

    config = load_config(checkpoint)
    plan = hand_plan(config, tp=1, pp=2, layers=[(0, 2), (2, 4)], schedule="1F1B", method="lora")
    lora = LoraSetup(lora_config(r=4, alpha=8, dropout=0.0, targets=None, model_config=config))
    model = split_from_pretrained(checkpoint, plan=plan, dtype=torch.float32, lora=lora)
    ids = torch.tensor(probe)
    with torch.no_grad():
        base = model(ids, broadcast=True)
        for index, module in zip(model.stage_indices, model.stages):  # B ≠ 0: a misplaced adapter would show
            gen = torch.Generator().manual_seed(10 + index)
            for name, p in module.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        tuned = model(ids, broadcast=True)
    out = Path(out_dir)
    adapter = save_split_model(model, out / "adapter", method="lora", lora_config=lora.config, base_model=checkpoint)
    merged = save_split_model(model, out / "merged", method="full", merge_lora=True, base_model=checkpoint)
    return {"base": base, "tuned": tuned, "adapter": str(adapter), "merged": str(merged)}
