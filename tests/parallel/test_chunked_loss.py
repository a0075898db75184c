"""The chunked causal-LM loss equals transformers' own loss and gradients, and the last stage holds less with it;
DPO's chunked sequence log-probs equal those of the full logits, gradients included."""
import pytest
import torch


def one_layer_model(family: str):
    """A one-layer fp32 model of `family` with a 300-token vocabulary (gemma2: its logit soft-capping on)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                  num_key_value_heads=1, num_hidden_layers=1, vocab_size=300, head_dim=16,
                                  final_logit_softcapping=5.0 if family == "gemma2" else None)
    return AutoModelForCausalLM.from_config(config).float()


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: the logit soft-cap runs per chunk
def test_chunked_loss_equals_transformers_loss_and_gradients(family, monkeypatch):

    from hfsplit.models.families import family_of
    from hfsplit.models import loss as chunked_loss
    from hfsplit.models.loss import causal_lm_loss

    model = one_layer_model(family)
    config = model.config
    hidden = torch.randn(2, 37, 32, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 300, (2, 37), generator=torch.Generator().manual_seed(1))
    labels[0, :5] = -100  # padding / prompt tokens do not count

    def head(h):  # what the last stage runs after its norm: lm_head, then the family's scaling / soft-cap
        return family_of(config).output_side(config, model.lm_head(h))

    def loss_and_grads(fn):
        h = hidden.clone().requires_grad_()
        model.zero_grad()
        loss = fn(h)
        loss.backward()
        return loss.detach(), h.grad, model.lm_head.weight.grad.clone()

    monkeypatch.setattr(chunked_loss, "CHUNK_LOGIT_BYTES", 4 * 300 * 10)  # 10 tokens a chunk: 8 chunks, the last short
    assert chunked_loss.chunk_tokens(300, 74) == 10
    want = loss_and_grads(lambda h: causal_lm_loss(300)(head(h), labels))
    got = loss_and_grads(lambda h: chunked_loss.chunked_causal_lm_loss(h, labels, head=head, vocab_size=300))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_chunked_sequence_logps_equal_the_full_logits_and_their_gradients(family, monkeypatch):
    """DPO's per-row summed log-probs chunk by chunk (issue 23) against `sequence_logps` of the whole logits, fp32,
    within 1e-5: prompts and padding ignored, responses crossing chunk boundaries and rows (10 tokens a chunk over
    rows of 37), a row with a single label token; the gradients of a loss weighing each row differently (the
    pairs' DPO loss through `DpoLoss`, with its `logps`) into the hidden states and lm_head; the logits-in path
    (`head=None`) without gradients."""

    from hfsplit.models import loss as chunked_loss
    from hfsplit.models.families import family_of
    from hfsplit.models.loss import chunked_sequence_logps, sequence_logps
    from hfsplit.training.preference import DpoLoss, indexed_labels

    model = one_layer_model(family)
    config = model.config
    hidden = torch.randn(4, 37, 32, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 300, (4, 37), generator=torch.Generator().manual_seed(1))
    for row, (prompt, end) in enumerate([(5, 37), (8, 30), (15, 24), (35, 37)]):  # row 3: one label token
        labels[row, :prompt], labels[row, end:] = -100, -100
    monkeypatch.setattr(chunked_loss, "CHUNK_LOGIT_BYTES", 4 * 300 * 10)  # 10 tokens a chunk over 148 tokens
    assert chunked_loss.chunk_tokens(300, 4 * 37) == 10

    def head(h):
        return family_of(config).output_side(config, model.lm_head(h))

    def logps_and_grads(logps):
        h = hidden.clone().requires_grad_()
        model.zero_grad()
        loss_fn = DpoLoss(beta=0.3, loss_type="sigmoid")
        loss_fn.reference = torch.tensor([-50.0, -40.0, -45.0, -2.0])
        loss = loss_fn(h, indexed_labels(labels), logps=logps)
        loss.backward()
        return loss_fn.seen[0][0], loss.detach(), h.grad, model.lm_head.weight.grad.clone()

    want = logps_and_grads(lambda h, y: sequence_logps(head(h), y))
    got = logps_and_grads(lambda h, y: chunked_sequence_logps(h, y, head=head, vocab_size=300))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert want[2].abs().sum() > 0 and want[0].shape == (4,)
    with torch.no_grad():
        logits = head(hidden)
        torch.testing.assert_close(chunked_sequence_logps(logits, labels, vocab_size=300),
                                   sequence_logps(logits, labels), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_chunked_loss_run_keeps_its_plan_and_its_losses(launch, tiny_checkpoint):
    """pp=2, a vocabulary large enough that the logits weigh on the last stage: the chunked plan's figure matches
    the measured peak of each rank, its saving is measured, and the loss curve is the plain one."""
    checkpoint = str(tiny_checkpoint("llama", num_layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2,
                                     vocab=8192))
    results = launch("tests.parallel.chunked_loss_cases:chunked_vs_plain", world_size=2, timeout_s=400,
                     kwargs=dict(checkpoint=checkpoint, seq_len=256, micro_batch_size=2, micro_batches=2, steps=3))
    for rank, by_mode in enumerate(results):
        for chunked, r in by_mode.items():
            ratio = r["measured"] / r["planned"]
            print(f"rank {rank} chunked {chunked}: planned {r['planned']}, measured {r['measured']} ({ratio:.3f})")
            assert 0.85 <= ratio <= 1.15, f"rank {rank} chunked {chunked}: measured/planned = {ratio:.3f}"
            assert r["probe_shape"] == (1, 16, 8192)
        plain, chunked = by_mode[False], by_mode[True]
        if plain["has_head"]:
            planned_saving = plain["planned"] - chunked["planned"]
            assert planned_saving > 0.3 * plain["planned"], planned_saving  # the head's logits dominate here
            assert plain["measured"] - chunked["measured"] >= 0.7 * planned_saving
            assert chunked["losses"] == pytest.approx(plain["losses"], rel=1e-5)
            assert chunked["losses"][-1] < chunked["losses"][0]
            assert "chunked loss" in chunked["table"]
        else:
            assert chunked["planned"] == plain["planned"]
