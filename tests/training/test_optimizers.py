"""8-bit optimizer states: bitsandbytes' AdamW8bit / PagedAdamW8bit by transformers' names, on CPU tensors."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hfsplit.plan import TrainingSpec
from hfsplit.planning.planner import make_plan
from hfsplit.training.optimizers import build_optimizer, load_moments, moments, raw_state, state_of

# hidden 64: the block's matrices (4096+ values) keep 8-bit moments, the norms (64) fp32 ones, as bitsandbytes does
CONFIG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=96, tie_word_embeddings=False)
STEPS = 20


def _losses(optim: str, *, steps: int = STEPS):
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG)
    optimizer = build_optimizer(list(model.parameters()), optim=optim, lr=3e-3, weight_decay=0.0)
    ids = torch.randint(0, CONFIG.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model, optimizer


@pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")
def test_8bit_adamw_tracks_adamw_for_20_steps_and_the_plan_counts_its_state_exactly():
    reference, _, _ = _losses("adamw_torch")
    spec = TrainingSpec(method="full", seq_len=32, micro_batch_size=4, dtype="float32", reserve_bytes=0)
    for optim in ("adamw_8bit", "paged_adamw_8bit"):  # paged: bitsandbytes falls back to non-paged on CPU
        losses, model, optimizer = _losses(optim)
        assert losses == pytest.approx(reference, rel=1e-2), optim
        assert losses[-1] < 0.5 * losses[0]  # it trains
        states = [state_of(optimizer, p) for p in model.parameters()]
        assert {s["state1"].dtype for s in states} == {torch.uint8, torch.float32}  # both kinds of tensor here
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()  # the code maps once: shared
                for s in states for k, t in s.items() if isinstance(t, torch.Tensor)}
        plan = make_plan(CONFIG, "1GiB", spec=spec, optim=optim, pp=1, tp=1, dp=1, activation_checkpointing=False)
        assert plan.stages[0].optim == optim and plan.spec.optim == optim
        assert plan.stages[0].memory.optimizer == sum(held.values())
    fp32 = make_plan(CONFIG, "1GiB", spec=spec, optim="adamw_torch", pp=1, tp=1, dp=1)
    assert fp32.stages[0].memory.optimizer == 8 * sum(p.numel() for p in model.parameters())


def test_8bit_moments_read_back_as_fp32_and_load_exactly_or_requantized():
    _, model, optimizer = _losses("adamw_8bit", steps=3)
    _, _, fresh = _losses("adamw_8bit", steps=0)
    big = next(p for p in model.parameters() if p.numel() >= 4096)
    exp_avg, exp_avg_sq, step = moments(optimizer, big)
    assert exp_avg.dtype == torch.float32 and exp_avg.shape == big.shape and step == 3
    target = next(p for p in fresh.param_groups[0]["params"] if p.shape == big.shape)
    load_moments(fresh, target, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, step=step, raw=raw_state(optimizer, big))
    assert all(torch.equal(state_of(fresh, target)[k], t) for k, t in raw_state(optimizer, big).items())  # exact
    load_moments(fresh, target, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, step=step)  # re-quantized from fp32
    again = moments(fresh, target)
    assert (again[0] - exp_avg).abs().max() <= 0.02 * exp_avg.abs().max()  # within 8-bit steps of each value
    assert (again[1] - exp_avg_sq).abs().max() <= 0.02 * exp_avg_sq.abs().max()
