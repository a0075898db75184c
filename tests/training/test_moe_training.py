"""MoE training beyond one pipeline: data-parallel replicas, and resuming under another split."""
from pathlib import Path

import pytest
import torch

from hfsplit.training.options import tiny_demo_options
from tests.parallel.launcher import launch
from tests.training.test_trainer import reference_training, run_options, saved_model

ROUTED = dict(output_router_logits=True, router_aux_loss_coef=0.5)
# attention and the fused experts' 3-D parameters (peft target parameters, hfsplit/models/expert_lora.py)
EXPERT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]


@pytest.mark.slow
def test_moe_data_parallel_equals_transformers_and_resumes_under_another_split(tiny_checkpoint, tmp_path):
    """pp=2 × dp=2 on four ranks, Qwen3-MoE full and Mixtral LoRA (attention and experts) with the router
    auxiliary loss: every step equals
    transformers over the global batch, each micro-batch its own forward whose loss adds coef × its aux loss (the
    replicas' losses and gradients averaged as one process accumulating the global batch's micro-batches). The full
    run's checkpoint (pp=2, dp=2) then resumes on one rank (pp=1, the same global batch as 8 micro-batches) and
    continues the curve: the experts' weights and AdamW moments are resharded from the stage files."""
    full = dict(run_options(tiny_checkpoint("qwen3_moe", **ROUTED), tmp_path, "full", tp=1, pp=2, max_memory="4x1GiB"),
                max_steps=8, save_every=4, output_dir=str(tmp_path / "full"))
    lora = dict(run_options(tiny_checkpoint("mixtral", **ROUTED), tmp_path, "lora", tp=1, pp=2, max_memory="4x1GiB"),
                max_steps=6, output_dir=str(tmp_path / "lora"), lora_targets=EXPERT_TARGETS)
    # two dense layers, then two expert layers: LoRA's default targets (attention) on a stage of expert layers only
    mixed = dict(run_options(tiny_checkpoint("qwen3_moe", mlp_only_layers=[0, 1], **ROUTED), tmp_path, "lora", tp=1,
                             pp=2, max_memory="4x1GiB"), max_steps=4, output_dir=str(tmp_path / "mixed"))
    results = launch("tests.training.cases:finetune_losses", world_size=4, kwargs={"runs": [full, lora, mixed]},
                     timeout_s=400)
    assert all(r == results[0] for r in results)  # every rank reports the global loss
    trained = {}
    for run, split_losses in zip((full, lora, mixed), results[0]):
        expected, trained[run["output_dir"]] = reference_training(tiny_demo_options(**run), replicas=2)
        assert split_losses == pytest.approx(expected, rel=1e-5), run["model"]
    # LoRA on the fused experts: the adapter folder loads with plain peft, experts adapted, the trained logits
    loaded = saved_model(Path(lora["output_dir"]), tiny_demo_options(**lora))
    assert [n for n, _ in loaded.named_parameters() if "experts" in n and ".lora_B." in n]
    probe = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (loaded(input_ids=probe).logits - trained[lora["output_dir"]](input_ids=probe).logits).abs().max() < 1e-4
    moved = dict(full, pp=1, micro_batches=8, max_memory="1GiB", resume=str(tmp_path / "full" / "checkpoint-4"),
                 output_dir=str(tmp_path / "moved"))
    (resumed,) = launch("tests.training.cases:finetune_losses", world_size=1, kwargs={"runs": [moved]}, timeout_s=300)[0]
    assert resumed == pytest.approx(results[0][0][4:], rel=1e-5)


def qlora_moe_run(run: dict, probe: torch.Tensor) -> dict:
    """On every rank: the recipe's QLoRA run (`build_run` then `fit`), its losses, the trained split's logits on
    `probe`, and how this rank's stages hold their block weights (4-bit linears, 16-bit fused experts)."""
    import bitsandbytes as bnb

    from hfsplit.training.run import build_run
    from hfsplit.training.trainer import fit

    run = build_run(tiny_demo_options(**run), progress=False)
    losses = fit(run).losses
    modules = [m for stage in run.model.stages for m in stage.modules()]
    experts = {n: (type(p).__name__, str(p.dtype)) for stage in run.model.stages for n, p in stage.named_parameters()
               if p.dim() == 3}
    return {"losses": losses, "logits": run.model.forward(probe, broadcast=True), "experts": experts,
            "linear4bit": sum(isinstance(m, bnb.nn.Linear4bit) for m in modules),
            "linear": sum(type(m) is torch.nn.Linear for m in modules if not _adapter(m, modules))}


def _adapter(linear, modules) -> bool:
    """Whether `linear` is a peft adapter matrix (lora_A / lora_B) or the head, not a block's base weight."""
    return any(linear is getattr(m, "lm_head", None) for m in modules) or any(
        linear in list(d.values()) for m in modules for d in (getattr(m, "lora_A", {}), getattr(m, "lora_B", {})))


@pytest.mark.slow
def test_moe_qlora_split_equals_transformers_bnb_peft(tiny_checkpoint, tmp_path):
    """Mixtral QLoRA on pp=2 (router auxiliary loss on) equals one process of transformers + bitsandbytes + peft:
    transformers quantizes the nn.Linear layers (attention) and leaves the fused 3-D experts and the router in the
    compute dtype, and so does hfsplit; every step's loss, and the trained logits."""
    from tests.training.test_qlora import quantized_base

    run = dict(run_options(tiny_checkpoint("mixtral", **ROUTED), tmp_path, "qlora", tp=1, pp=2, max_memory="2x1GiB"),
               max_steps=8, output_dir=str(tmp_path / "qlora"))
    options = tiny_demo_options(**run)
    probe = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    results = launch("tests.training.test_moe_training:qlora_moe_run", world_size=2,
                     kwargs={"run": run, "probe": probe}, timeout_s=300)
    base = quantized_base(options)
    held = {n: (type(p).__name__, str(p.dtype)) for n, p in base.named_parameters() if p.dim() == 3}
    expected, trained = reference_training(options, base=base)
    assert results[0]["losses"] == pytest.approx(expected, rel=1e-5)
    assert all(r["losses"] == results[0]["losses"] for r in results)
    with torch.no_grad():
        assert (trained(input_ids=probe).logits - results[0]["logits"]).abs().max() < 1e-4
    assert set(held.values()) == {("Parameter", "torch.float32")}  # transformers: experts not quantized
    split = {n: v for r in results for n, v in r["experts"].items()}
    assert len(split) == len(held) and set(split.values()) == set(held.values())
    assert all(r["linear4bit"] == 2 * 4 and r["linear"] == 0 for r in results)  # q/k/v/o of each rank's 2 blocks
