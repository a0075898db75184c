"""QLoRA on split stages equals transformers + bitsandbytes + peft QLoRA in one process, step by step."""
from dataclasses import replace
from pathlib import Path
from typing import Optional

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

    model = AutoModelForCausalLM.from_pretrained(options.model, dtype=getattr(torch, options.dtype), device_map="cpu",
                                                 quantization_config=bnb_config(options))
    # Train mode, as a training run is: in eval mode bitsandbytes' CPU kernel repacks the weights for a bf16
    # AVX-512 path on the first forward, whose logits differ from the fp32 dequantize-and-matmul by ~4e-3.
    return model.train()


def train_and_probe(run: dict, probe: torch.Tensor, also: Optional[dict] = None):
    """On every rank: QLoRA-train `run` as the recipe does (`build_run` then `fit`); the losses and the trained
    split model's logits on `probe`, then (`also`) the losses of a second run in the same launch."""
    from hfsplit.training.trainer import build_run, fit

    run = build_run(FinetuneOptions(**run), progress=False)
    losses = fit(run).losses
    model = run.model
    logits = model.forward(probe, broadcast=True)
    if also is None:
        return losses, logits
    return losses, logits, fit(build_run(FinetuneOptions(**also), progress=False)).losses


@pytest.mark.slow
@pytest.mark.parametrize("world, split", [(2, dict(pp=2, max_memory="2x1GiB", chunked_loss=True)),  # the chunked loss
                                          (4, dict(pp=2, tp=1, max_memory="4x1GiB"))])  # pp=2 × dp=2
def test_split_qlora_losses_equal_transformers_bnb_peft_qlora(tiny_checkpoint, tmp_path, world, split):
    """20 QLoRA steps split over pp=2 (with the chunked loss) and pp=2 × dp=2 equal the one-process reference
    (transformers' plain loss); the adapter folder loads with plain PeftModel on a base quantized by
    transformers; --merge writes a plain 16-bit folder."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = run_options(tiny_checkpoint("llama"), tmp_path, "qlora", merge=world == 2, **split)
    options = FinetuneOptions(**run)
    probe = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    # pp=2 also runs bf16 QLoRA, its forwards under autocast (hfsplit.parallel.autocast): against the reference
    # under autocast too, as transformers' Trainer runs bf16
    bf16 = dict(run, dtype="bfloat16", merge=False, output_dir=run["output_dir"] + "-bf16") if world == 2 else None
    results = launch("tests.training.test_qlora:train_and_probe", world_size=world,
                     kwargs={"run": run, "probe": probe, "also": bf16}, timeout_s=300)
    if bf16 is not None:
        bf16_options = FinetuneOptions(**bf16)
        want, _ = reference_training(bf16_options, base=quantized_base(bf16_options), autocast=torch.bfloat16)
        got = results[0][2]
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
        print(f"bf16 QLoRA under autocast {split}: worst per-step loss rel diff {worst:.2e}")
        assert got == pytest.approx(want, rel=1e-3)
    expected, trained = reference_training(options, replicas=world // 2, base=quantized_base(options))
    losses, split_logits = results[0][:2]
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
    print(f"QLoRA {split}: worst per-step loss rel diff {worst:.2e}")
    assert losses == pytest.approx(expected, rel=1e-5)
    assert all(r[0] == losses for r in results)
    # (from_pretrained puts the model in eval mode: back to train mode for the same bitsandbytes kernel)
    loaded = PeftModel.from_pretrained(quantized_base(options), Path(run["output_dir"]) / "adapter").train()
    with torch.no_grad():
        want = split_logits  # the trained split model itself
        assert (loaded(input_ids=probe).logits - want).abs().max() < 1e-4
        assert (trained(input_ids=probe).logits - want).abs().max() < 1e-4
        assert (quantized_base(options)(input_ids=probe).logits - want).abs().max() > 1e-3  # adapters trained
        if run["merge"]:  # dequantized, merged in 16 bits: near the 4-bit model, not bit-equal to it
            merged = AutoModelForCausalLM.from_pretrained(Path(run["output_dir"]) / "merged", dtype=torch.float32)
            assert all(p.dtype == torch.float32 for p in merged.parameters())
            assert (merged(input_ids=probe).logits - want).abs().max() < 1e-3


@pytest.mark.parametrize("shape", [(64, 64), (1000, 384), (4096, 11008)])
@pytest.mark.parametrize("double_quant", [True, False])
def test_quantized_bytes_are_exactly_what_bitsandbytes_holds(shape, double_quant):
    from torch import nn

    from hfsplit.quantize import quantization_config, quantize_linear, quantized_linear_bytes

    layer = quantize_linear(nn.Linear(*shape, bias=False), quantization_config(double_quant=double_quant,
                                                                              compute_dtype="float32"),
                            device=torch.device("cpu"))
    state = layer.weight.quant_state
    tensors = [layer.weight.data, state.absmax, state.code, state.offset] + (
        [state.state2.absmax, state.state2.code] if state.state2 is not None else [])
    held = sum(t.numel() * t.element_size() for t in tensors if t is not None)
    assert held == quantized_linear_bytes(*shape, double_quant=double_quant)


def test_70b_qlora_plans_on_4x24gib_and_is_a_listed_fix_for_lora():
    from hfsplit.costs import TrainingSpec
    from hfsplit.errors import PlanError
    from hfsplit.planner import make_plan

    plan = make_plan("meta-llama/Llama-3.1-70B", "4x24GiB", spec=TrainingSpec(method="qlora", seq_len=2048))
    assert plan.tp == 1 and plan.pp == 4
    with pytest.raises(PlanError, match="Quantize the base to 4-bit"):
        make_plan("meta-llama/Llama-3.1-70B", "4x24GiB", spec=TrainingSpec(method="lora", seq_len=2048))
    with pytest.raises(PlanError, match="tp=2 with QLoRA"):
        make_plan("meta-llama/Llama-3.1-70B", "4x24GiB", spec=TrainingSpec(method="qlora"), tp=2)


def test_70b_qlora_plans_on_2x24gib_at_seq_2048_under_autocast_only():
    """Issue 11's target on plan: r=8, micro-batch 1, chunked loss fits 2×24GiB (no offload) because 16-bit QLoRA
    runs under autocast (0.72 GiB less workspace per stage); without it, or at r=16, it does not."""
    from hfsplit.costs import TrainingSpec
    from hfsplit.errors import PlanError
    from hfsplit.plan import rank_total
    from hfsplit.planner import make_plan

    spec = TrainingSpec(method="qlora", seq_len=2048, micro_batch_size=1, lora_r=8, chunked_loss=True)
    plan = make_plan("meta-llama/Llama-3.1-70B", "2x24GiB", spec=spec)
    assert (plan.pp, plan.tp) == (2, 1) and plan.spec.autocast_dtype == "bfloat16"
    assert all(rank_total([s.memory]) <= 24 << 30 for s in plan.stages)
    for other in (replace(spec, autocast=False), replace(spec, lora_r=16)):
        with pytest.raises(PlanError, match="no split fits"):
            make_plan("meta-llama/Llama-3.1-70B", "2x24GiB", spec=other)


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", [
    (["--method", "qlora", "--bnb-4bit-quant-type", "int3"], "bnb_4bit_quant_type='int3'"),
    (["--method", "qlora", "--tp", "2"], "--tp 2 with --method qlora"),
    (["--method", "full", "--load-in-8bit", "on"], "--load-in-8bit sets the quantized base"),
])
def test_qlora_bad_input_is_one_line_exit_2_nothing_written(tiny_checkpoint, tmp_path, flags, message):
    assert_recipe_refuses(tmp_path, ["--model", str(tiny_checkpoint("llama")), *flags], [message])


@pytest.mark.slow
def test_qlora_resume_under_another_split_continues_the_curve(tiny_checkpoint, tmp_path):
    """QLoRA on pp=2 (2 ranks), checkpoint at step 5, resumed on one rank: the same loss curve."""
    run = dict(run_options(tiny_checkpoint("llama"), tmp_path, "qlora", pp=2, max_memory="2x1GiB"), max_steps=10,
               save_every=5, output_dir=str(tmp_path / "run"))
    (whole,) = launch("tests.training.cases:finetune_losses", world_size=2, kwargs={"runs": [run]}, timeout_s=300)[0]
    moved = dict(run, pp=1, max_memory="1GiB", resume=str(tmp_path / "run" / "checkpoint-5"),
                 output_dir=str(tmp_path / "moved"))
    (resumed,) = launch("tests.training.cases:finetune_losses", world_size=1, kwargs={"runs": [moved]},
                        timeout_s=300)[0]
    assert resumed == pytest.approx(whole[5:], rel=1e-5)
    assert (tmp_path / "moved" / "adapter" / "adapter_model.safetensors").is_file()


def prequantized_split_logits(checkpoint: str, probe: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """On every rank: a pre-quantized folder split pp=2 under a QLoRA plan (its fresh adapters add zero; train-mode
    kernel); the logits, and whether every packed weight of this rank equals the stored bytes."""
    from safetensors import safe_open

    import torch.distributed as dist

    from hfsplit.costs import TrainingSpec
    from hfsplit.parallel.launch import split_from_pretrained

    model = split_from_pretrained(checkpoint, "2x1GiB", spec=TrainingSpec(method="qlora", seq_len=32, dtype="float32"),
                                  pp=2)
    with safe_open(f"{checkpoint}/model.safetensors", "pt") as stored:
        as_stored = [torch.equal(p.data, stored.get_tensor(n.replace(".base_layer", ""))) for s in model.stages for n, p in s.named_parameters()
                     if hasattr(p, "quant_state")]
    for stage in model.stages:
        stage.train()
    with torch.no_grad():
        logits = model.forward(probe, broadcast=True)
    dist.destroy_process_group()
    return logits, bool(as_stored) and all(as_stored)


@pytest.mark.slow
def test_prequantized_checkpoint_splits_and_a_mismatched_request_is_refused(tiny_checkpoint, tmp_path):
    """A pre-quantized bitsandbytes folder split over pp=2 reads its packed weights as stored and gives
    transformers' logits on that folder; the recipe asked for another format exits 2 in one line, writing nothing."""
    from transformers import AutoModelForCausalLM

    from tests.test_quantize import prequantized_checkpoint

    path = prequantized_checkpoint(tiny_checkpoint("llama"), tmp_path / "nf4")
    probe = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    results = launch("tests.training.test_qlora:prequantized_split_logits", world_size=2,
                     kwargs={"checkpoint": str(path), "probe": probe}, timeout_s=300)
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu").train()
    with torch.no_grad():
        want = theirs(input_ids=probe).logits
    assert all(same for _, same in results)
    assert all(torch.equal(logits, want) for logits, _ in results)
    assert_recipe_refuses(tmp_path, ["--model", str(path), "--method", "qlora", "--bnb-4bit-use-double-quant", "off"],
                          ["is pre-quantized with bnb_4bit_use_double_quant=True", "--bnb-4bit-use-double-quant on"])
    assert_recipe_refuses(tmp_path, ["--model", str(path), "--method", "lora"], ["is pre-quantized", "--method qlora"])


def vm_hwm() -> int:
    """This process's peak RSS in bytes (VmHWM: its own address space's; `ru_maxrss` would carry over the peak
    of the process that forked it, since Linux keeps it across execve: pytest after writing the checkpoint)."""
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024


def load_peak(checkpoint: str) -> dict:
    """On one rank: RSS peak of loading the whole model quantized, against imports, one block and the bytes held."""
    import torch.distributed as dist

    from hfsplit.costs import TrainingSpec
    from hfsplit.parallel.launch import split_from_pretrained
    from hfsplit.quantize import held_bytes, quantization_config

    import bitsandbytes  # noqa: F401  (imports belong to the baseline)
    import psutil

    from hfsplit.planner import make_plan
    from hfsplit.quantize import check_quantization

    dist.init_process_group("gloo")
    qconfig = quantization_config(compute_dtype="float32")
    check_quantization(qconfig, device=torch.device("cpu"))  # planning and the probe belong to the baseline
    plan = make_plan(checkpoint, "2GiB", spec=TrainingSpec(method="qlora", seq_len=8, dtype="float32"),
                     micro_batches=1, pp=1, world_size=1)
    base = psutil.Process().memory_info().rss  # now, not the import's transient peak
    model = split_from_pretrained(checkpoint, plan=plan, quantization_config=qconfig)
    peak = vm_hwm()
    block = model.stages[0].body.layers["0"]
    block_dense = sum(lin.in_features * lin.out_features * 4 for lin in block.modules() if isinstance(lin, torch.nn.Linear))
    dist.destroy_process_group()
    return dict(base=base, peak=peak, block=block_dense, held=held_bytes(model))


@pytest.mark.slow
def test_quantized_load_peak_host_ram_stays_within_one_block_plus_quantized_bytes(tmp_path):
    from hfsplit.checkpoint.synthetic import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "m", "llama", num_layers=8, hidden=1024, heads=8, kv_heads=4,
                                 intermediate=4096, vocab=1024)
    (r,) = launch("tests.training.test_qlora:load_peak", world_size=1, kwargs={"checkpoint": str(path)},
                  timeout_s=300)
    dense_all = 8 * r["block"]
    print({k: v >> 20 for k, v in r.items()}, "MiB; 16-bit model would be", dense_all >> 20, "MiB")
    assert r["peak"] > r["base"] + r["held"] / 2, r  # the peak really measures the load
    assert r["peak"] - r["base"] <= r["block"] + 1.1 * r["held"] + (16 << 20), r  # 16 MiB: allocator slack
    assert r["held"] < dense_all / 3
