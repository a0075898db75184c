"""Preference data and the DPO loss (issue 23), as TRL's `DPOTrainer` defines them.

Each example becomes two rows, prompt+chosen then prompt+rejected, kept next to each other so that both sit in
the same micro-batch (a micro-batch holds an even number of rows); the labels are -100 on the prompt and the
padding, so a sequence's log-prob is the sum over its response tokens (and the closing EOS), as TRL sums them.
The last stage turns the policy's logits and the reference's into per-pair log-ratios; the loss is the mean
over the global batch's pairs (each micro-batch's summed pair losses over `pairs_in_batch`).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from hfsplit.models.loss import sequence_logps  # with the planner's trace of the DPO head (one definition)
from hfsplit.training.data import DatasetError, load_examples, pad_id, rendered_chat
from hfsplit.training.packing import IGNORE_INDEX, Example, TokenRows, padded_rows

PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")
LN2 = math.log(2.0)
DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")  # TRL's names


def preference_texts(row: dict, index: int, source: str, tokenizer) -> tuple[str, str, str]:
    """(prompt, prompt+chosen, prompt+rejected) text of one row, as TRL renders them: standard rows get EOS
    appended to each response; conversational ones (messages) go through the chat template. One `DatasetError`
    line naming the file and the row when a field is missing or a response is empty."""
    missing = [c for c in PREFERENCE_COLUMNS if row.get(c) is None]
    if missing:
        raise DatasetError(f"{source} row {index}: missing {', '.join(missing)}; every preference row needs "
                           "prompt, chosen and rejected")
    prompt, chosen, rejected = (row[c] for c in PREFERENCE_COLUMNS)
    for name, response in (("chosen", chosen), ("rejected", rejected)):
        if not _response_text(response).strip():
            raise DatasetError(f"{source} row {index}: the {name} response is empty; give it some text or drop "
                               "the row")
    if isinstance(prompt, list):  # conversational: the prompt's messages, the responses as assistant messages
        return (rendered_chat(tokenizer, prompt, add_generation_prompt=True),
                rendered_chat(tokenizer, [*prompt, *chosen]), rendered_chat(tokenizer, [*prompt, *rejected]))
    eos = tokenizer.eos_token
    return prompt, *(prompt + r + ("" if r.endswith(eos) else eos) for r in (chosen, rejected))


def _response_text(response: Any) -> str:
    """The text of a response: itself, or its messages' contents joined."""
    if isinstance(response, str):
        return response
    if isinstance(response, list):
        return "".join(str(m.get("content") or "") for m in response if isinstance(m, dict))
    return ""


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def preference_examples(rows: Sequence[dict], tokenizer, *, seq_len: int, source: str) -> list[Example]:
    """Two examples per row, chosen then rejected, tokenized as TRL's DPOTrainer does: prompt and
    prompt+response apart, the response starting where they diverge; the prompt's tokens masked.

    A prompt that leaves no room for a response in `seq_len` is refused (one line naming the file and row)."""
    conversational = bool(rows) and isinstance(rows[0].get("prompt"), list)
    examples: list[Example] = []
    for index, row in enumerate(rows):
        texts = preference_texts(row, index, source, tokenizer)
        prompt_ids, *full = (tokenizer(t, add_special_tokens=not conversational)["input_ids"] for t in texts)
        if len(prompt_ids) >= seq_len:
            raise DatasetError(f"{source} row {index}: the prompt is {len(prompt_ids)} tokens, beyond --seq-len "
                               f"{seq_len}; raise --seq-len or shorten the prompt")
        start = min(_common_prefix(prompt_ids, ids) for ids in full)
        examples.extend((ids, [IGNORE_INDEX] * start + list(ids[start:])) for ids in full)
    return examples


def paired_rows(rows: Sequence[dict], tokenizer, *, seq_len: int, source: str) -> TokenRows:
    """The preference rows as padded token rows, row 2i the chosen and 2i+1 the rejected response of example i."""
    examples = preference_examples(rows, tokenizer, seq_len=seq_len, source=source)
    return padded_rows(examples, seq_len=seq_len, pad=pad_id(tokenizer))


def pair_losses(policy: torch.Tensor, reference: torch.Tensor, *, beta: float, loss_type: str) -> torch.Tensor:
    """TRL's per-pair DPO losses from the rows' sequence log-probs (chosen at even rows, rejected at odd)."""
    logits = (policy[0::2] - policy[1::2]) - (reference[0::2] - reference[1::2])
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * logits)
    if loss_type == "ipo":  # TRL: (logits - 1/(2 beta))^2, with length-averaged log-probs done by the caller
        return (logits - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown DPO loss {loss_type!r}")


def dpo_metrics(policy: torch.Tensor, reference: torch.Tensor, *, beta: float) -> dict[str, float]:
    """TRL's reward metrics over these pairs (means): rewards/chosen, rejected, accuracies, margins, logps/*."""
    chosen = beta * (policy[0::2] - reference[0::2]).detach()
    rejected = beta * (policy[1::2] - reference[1::2]).detach()
    return {"rewards/chosen": chosen.mean().item(), "rewards/rejected": rejected.mean().item(),
            "rewards/accuracies": (chosen > rejected).float().mean().item(),
            "rewards/margins": (chosen - rejected).mean().item(),
            "logps/chosen": policy[0::2].detach().mean().item(), "logps/rejected": policy[1::2].detach().mean().item()}


def ipo_normalised(logps: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """IPO's log-probs: TRL averages each sequence's over its response tokens."""
    tokens = (F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:] != IGNORE_INDEX).sum(-1).clamp(min=1)
    return logps / tokens.to(logps.device)


@contextmanager
def adapters_disabled(models: Sequence[torch.nn.Module]):
    """Every peft LoRA layer in `models` off (the reference policy), restored on exit, however it exits."""
    from peft.tuners.lora import LoraLayer  # lazy: peft is only needed with adapters

    layers = [m for model in models for m in model.modules() if isinstance(m, LoraLayer)]
    before = [layer.disable_adapters for layer in layers]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer, was_disabled in zip(layers, before):
            layer.enable_adapters(not was_disabled)


def reference_logps(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, **forward) -> torch.Tensor:
    """The reference's sequence log-probs of these rows: a no-grad forward of `model` with its adapters off."""
    with torch.no_grad(), adapters_disabled([model]):
        out = model(input_ids=input_ids, **forward)
    return sequence_logps(out.logits if hasattr(out, "logits") else out, labels)


def dpo_loss(logits: torch.Tensor, labels: torch.Tensor, reference: torch.Tensor, *, beta: float,
             loss_type: str = "sigmoid", pairs_in_batch: int | None = None) -> torch.Tensor:
    """This micro-batch's share of the global batch's mean DPO loss: its summed pair losses over
    `pairs_in_batch` (the global batch's pairs; None: this micro-batch's own, a plain mean)."""
    return policy_loss(sequence_logps(logits, labels), labels, reference, beta=beta, loss_type=loss_type,
                       pairs_in_batch=pairs_in_batch)


def policy_loss(policy: torch.Tensor, labels: torch.Tensor, reference: torch.Tensor, *, beta: float,
                loss_type: str = "sigmoid", pairs_in_batch: int | None = None) -> torch.Tensor:
    """`dpo_loss` from the policy's sequence log-probs of these rows (chosen at even rows, rejected at odd)."""
    if labels.shape[0] % 2:
        raise ValueError("a DPO micro-batch holds chosen/rejected pairs: an even number of rows")
    if loss_type == "ipo":
        policy, reference = ipo_normalised(policy, labels), ipo_normalised(reference, labels)
    losses = pair_losses(policy, reference.to(policy.device), beta=beta, loss_type=loss_type)
    return losses.sum() / (pairs_in_batch if pairs_in_batch is not None else losses.numel())


def load_paired_rows(source: str, tokenizer, *, seq_len: int) -> TokenRows:
    """The preference file or hub set `source` as paired rows (see `paired_rows`)."""
    dataset = load_examples(source)
    missing = [c for c in PREFERENCE_COLUMNS if c not in dataset.column_names]
    if missing:
        raise DatasetError(f"{source}: --objective dpo needs columns prompt, chosen and rejected (TRL's preference "
                           f"format); missing {', '.join(missing)}")
    return paired_rows(list(dataset), tokenizer, seq_len=seq_len, source=source)


def indexed_labels(labels: torch.Tensor) -> torch.Tensor:
    """`labels` with each row's index appended as a last column: the loss finds the row's reference log-prob by
    it, whichever micro-batch the schedule hands it."""
    return torch.cat([labels, torch.arange(labels.shape[0], dtype=labels.dtype)[:, None]], dim=1)


class DpoLoss:
    """The pipeline's loss function for DPO on the last stage: `reference` holds this step's reference log-probs
    of this replica's rows; the targets are `indexed_labels`. Keeps the step's policy log-probs for the metrics.
    `precomputed`: with `--reference precomputed`, every training row's reference log-prob by its index
    (`hfsplit.training.reference`), where `reference` is read from."""

    def __init__(self, *, beta: float, loss_type: str):
        self.beta, self.loss_type = beta, loss_type
        self.reference: torch.Tensor | None = None
        self.precomputed: torch.Tensor | None = None
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (policy, reference) sequence log-probs

    takes_logps = True  # a chunked last stage passes `logps` (`hfsplit.models.loss.ChunkedHeadLoss`)

    def __call__(self, logits: torch.Tensor, target: torch.Tensor, num_items_in_batch=None, *,
                 logps=sequence_logps) -> torch.Tensor:
        """`logits`: the micro-batch's logits, or what `logps` maps to sequence log-probs (the normed hidden
        states of a chunked last stage)."""
        labels, index = target[:, :-1], target[:, -1]
        reference = self.reference.to(logits.device)[index.to(logits.device)]
        policy = logps(logits, labels)
        self.seen.append((policy.detach(), reference))
        return policy_loss(policy, labels, reference, beta=self.beta, loss_type=self.loss_type,
                           pairs_in_batch=num_items_in_batch)

    def evaluate(self, policy: torch.Tensor, reference: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """The mean pair loss ("loss") and TRL's metrics of held-out pairs from their rows' sequence log-probs."""
        metrics = dpo_metrics(policy, reference, beta=self.beta)
        if self.loss_type == "ipo":
            policy, reference = ipo_normalised(policy, labels), ipo_normalised(reference, labels)
        losses = pair_losses(policy, reference.to(policy.device), beta=self.beta, loss_type=self.loss_type)
        return {"loss": losses.mean().item(), **metrics}

    def step_metrics(self, *, calls: int) -> dict[str, float]:
        """TRL's metrics over this step's pairs on this replica (empty off the last stage), from the loss's last
        `calls` calls (the step's micro-batches: the first step's schedule also runs it once more, on its
        warm-up); resets them."""
        if not self.seen:
            return {}
        policy, reference = (torch.cat(t) for t in zip(*self.seen[-calls:]))
        self.seen = []
        return dpo_metrics(policy, reference, beta=self.beta)
