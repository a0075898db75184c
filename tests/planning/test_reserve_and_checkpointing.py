"""The per-device reserve (measured, 0 on the CPU) and activation checkpointing on the single-process path."""
import torch
from transformers import AutoModelForCausalLM

from hfsplit.cli.plan import main
from hfsplit.plan import TrainingSpec
from hfsplit.load.materialize import from_pretrained
from hfsplit.planning.planner import make_plan
from hfsplit.plan import Plan
from hfsplit.plan.steps import checkpointing_step as activation_checkpointing_label
from hfsplit.planning.reserve import (
    CUDA_CONTEXT_BYTES, FRAGMENTATION_BYTES, NCCL_BUFFER_BYTES, device_reserve_bytes, reserve_for,
)


def test_a_cpu_budget_has_no_reserve_so_a_tiny_model_loads_in_1gib(tiny_checkpoint):
    folder = tiny_checkpoint("llama", num_layers=4, hidden=64)
    model = from_pretrained(folder, max_memory={"cpu": "1GiB"})  # was "needs 1.02 GiB of 1.00 GiB"
    assert [s.memory.reserve for s in model.hfsplit_plan.stages] == [0]
    ids = torch.randint(3, 256, (1, 8))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, AutoModelForCausalLM.from_pretrained(folder)(ids).logits)


def test_gpu_reserve_is_context_fragmentation_and_nccl():
    gpu = device_reserve_bytes("0")
    if not torch.cuda.is_available():  # measured where a GPU is visible, the documented constant otherwise
        assert gpu == CUDA_CONTEXT_BYTES + NCCL_BUFFER_BYTES + FRAGMENTATION_BYTES
    assert device_reserve_bytes("0", distributed=False) == gpu - NCCL_BUFFER_BYTES
    assert device_reserve_bytes("cpu") == 0
    assert reserve_for({"cpu": 1 << 30}) == 0
    assert reserve_for({"0": 1 << 30, "1": 2 << 30}) == max(device_reserve_bytes("0"), device_reserve_bytes("1"))


def test_planner_charges_the_measured_reserve_and_honours_an_override(tiny_checkpoint):
    folder = tiny_checkpoint("llama")
    measured = make_plan(folder, "2x8GiB", spec=TrainingSpec(method="lora", seq_len=16))
    assert {s.memory.reserve for s in measured.stages} == {reserve_for({"0": 8 << 30, "1": 8 << 30})}
    given = make_plan(folder, "2x8GiB", spec=TrainingSpec(method="lora", seq_len=16, reserve_bytes=123))
    assert {s.memory.reserve for s in given.stages} == {123}


def test_cli_reserve_override_and_what_runs(tiny_checkpoint, capsys):
    folder = str(tiny_checkpoint("llama"))
    assert main(["plan", folder, "--max-memory", "2x8GiB", "--seq-len", "16", "--reserve", "100MiB", "--pp", "2",
                 "--activation-checkpointing", "on", "--lora-r", "4", "--json"]) == 0
    plan = Plan.from_json(capsys.readouterr().out)
    assert {s.memory.reserve for s in plan.stages} == {100 << 20}
    assert main(["plan", folder, "--max-memory", "2x8GiB", "--seq-len", "16", "--pp", "2",
                 "--activation-checkpointing", "on", "--lora-r", "4"]) == 0
    out = capsys.readouterr().out
    assert f"applies per stage: {activation_checkpointing_label()} → LoRA r=4" in out
    assert "activation checkpointing on" in out


def test_single_process_training_plan_turns_on_gradient_checkpointing(tiny_checkpoint):
    folder = tiny_checkpoint("llama")
    spec = dict(method="full", seq_len=32, dtype="float32", reserve_bytes=0)
    grads = {}
    for ac in (False, True):
        model = from_pretrained(folder, max_memory={"cpu": "8GiB"}, training="full", activation_checkpointing=ac,
                                spec=TrainingSpec(**spec, activation_checkpointing=ac))
        assert model.is_activation_checkpointing == ac
        # loading is a step of every plan, recorded on this path too (the steps: tests/parallel/test_split_model.py)
        assert [s for s in model.hfsplit_plan.applied if s.kind != "load"] == ([activation_checkpointing_label()] if ac else [])
        model.train()
        ids = torch.randint(3, 256, (2, 32), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        grads[ac] = {n: p.grad.clone() for n, p in model.named_parameters()}
        # Generation with a KV cache runs without gradients: blocks run plainly, the cache is kept.
        with torch.no_grad():
            out = model.generate(ids[:1, :4], max_new_tokens=4, do_sample=False)
        assert out.shape == (1, 8)
    for name, g in grads[False].items():
        assert torch.allclose(grads[True][name], g, rtol=1e-5, atol=1e-7), name
