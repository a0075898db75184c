"""QLoRA on split stages equals transformers + bitsandbytes + peft QLoRA in one process, step by step."""
from pathlib import Path

import pytest
import torch

from hfsplit.training.options import FinetuneOptions
from tests.parallel.launcher import launch
from tests.training.test_trainer import STEPS, assert_recipe_refuses, reference_training, run_options


def bnb_config(options: FinetuneOptions):
    from hfsplit.quantize import quantization_config

    return quantization_config(quant_type=options.bnb_4bit_quant_type, double_quant=options.bnb_4bit_use_double_quant,
                               compute_dtype=options.dtype)


def quantized_base(options: FinetuneOptions):
    """The base as users load it: transformers' own bitsandbytes integration, the same BitsAndBytesConfig."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(options.model, dtype=torch.float32, device_map="cpu",
                                                quantization_config=bnb_config(options))


def train_and_probe(run: dict, probe: torch.Tensor) -> tuple[list[float], torch.Tensor]:
    """On every rank: QLoRA-train `run` on a split model; the losses and the trained split model's logits on `probe`."""
    from hfsplit.parallel.split_model import split_from_pretrained
    from hfsplit.training.trainer import plan_of_run, qlora_config_of_run, train, weights_dtype

    import torch.distributed as dist

    options = FinetuneOptions(**run)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    plan = plan_of_run(options, model_path=options.model)
    model = split_from_pretrained(options.model, plan=plan, dtype=weights_dtype("qlora", plan.spec.dtype),
                                  quantization_config=qlora_config_of_run(options, plan))
    losses = train(options, model=model, progress=False).losses
    return losses, model.forward(probe, broadcast=True)


@pytest.mark.slow
@pytest.mark.parametrize("world, split", [(2, dict(pp=2, max_memory="2x1GiB")),
                                          (4, dict(pp=2, tp=1, max_memory="4x1GiB"))])  # pp=2 × dp=2
def test_split_qlora_losses_equal_transformers_bnb_peft_qlora(tiny_checkpoint, tmp_path, world, split):
    """20 QLoRA steps split over pp=2 (and pp=2 × dp=2) equal the one-process reference; the adapter folder
    loads with plain PeftModel on a base quantized by transformers; --merge writes a plain 16-bit folder."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = run_options(tiny_checkpoint("llama"), tmp_path, "qlora", merge=world == 2, **split)
    options = FinetuneOptions(**run)
    probe = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    results = launch("tests.training.test_qlora:train_and_probe", world_size=world,
                     kwargs={"run": run, "probe": probe}, timeout_s=300)
    expected, trained = reference_training(options, replicas=world // 2, base=quantized_base(options))
    losses, split_logits = results[0]
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
    print(f"QLoRA {split}: worst per-step loss rel diff {worst:.2e}")
    assert losses == pytest.approx(expected, rel=1e-4)
    assert all(r[0] == losses for r in results)
    loaded = PeftModel.from_pretrained(quantized_base(options), Path(run["output_dir"]) / "adapter")
    with torch.no_grad():
        want = split_logits  # the trained split model itself
        assert (loaded(input_ids=probe).logits - want).abs().max() < 1e-4
        # the reference's adapters drift from ours by ~lr where AdamW normalises near-zero gradients
        assert (trained(input_ids=probe).logits - want).abs().max() < 2e-2
        assert (quantized_base(options)(input_ids=probe).logits - want).abs().max() > 1e-3  # adapters trained
        if run["merge"]:  # dequantized, merged in 16 bits: near the 4-bit model, not bit-equal to it
            merged = AutoModelForCausalLM.from_pretrained(Path(run["output_dir"]) / "merged", dtype=torch.float32)
            assert all(p.dtype == torch.float32 for p in merged.parameters())
            assert (merged(input_ids=probe).logits - want).abs().max() < 1e-3
