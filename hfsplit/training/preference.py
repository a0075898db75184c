"""Preference data and the DPO loss (issue 23), as TRL's `DPOTrainer` defines them.

Each example becomes two sequences, prompt+chosen then prompt+rejected: two padded rows kept next to each other
so that both sit in the same micro-batch (a micro-batch holds an even number of rows), or, packed
(`--packing on`), two isolated sequences of one row that holds several pairs. The labels are -100 on the prompt and
the padding, so a sequence's log-prob is the sum over its response tokens (and the closing EOS), as TRL sums them.
Sequence 2i is example i's chosen response, 2i+1 its rejected one; every position carries its sequence's key
(`indexed_labels`), by which the last stage sums the log-probs sequence by sequence and finds the reference's.
It turns the policy's log-probs and the reference's into per-pair log-ratios; the loss is the mean over the
global batch's pairs (each micro-batch's summed pair losses over `pairs_in_batch`).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from hfsplit.models.loss import sequence_logps, token_logps  # one definition, which the planner traces
from hfsplit.training.data import DatasetError, load_examples, pad_id, rendered_chat
from hfsplit.training.packing import IGNORE_INDEX, Example, TokenRows, packed_groups, padded_rows

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


def paired_rows(rows: Sequence[dict], tokenizer, *, seq_len: int, source: str, packing: bool = False,
                seed: int = 0) -> TokenRows:
    """The preference rows as token rows: padded, row 2i the chosen and 2i+1 the rejected response of example i;
    or with `packing` several pairs a row by best-fit decreasing on each pair's length (`packed_groups`, tie-breaks
    and row order drawn from `seed`), a pair's two sequences always in one row, each isolated, `sequences` 2i and
    2i+1. A pair longer than `seq_len` together is refused under packing (one line naming the file and row)."""
    examples = preference_examples(rows, tokenizer, seq_len=seq_len, source=source)
    if not packing:
        return padded_rows(examples, seq_len=seq_len, pad=pad_id(tokenizer))
    pairs = [examples[i:i + 2] for i in range(0, len(examples), 2)]
    for index, pair in enumerate(pairs):
        tokens = sum(len(ids) for ids, _ in pair)
        if tokens > seq_len:
            raise DatasetError(f"{source} row {index}: prompt+chosen and prompt+rejected are {tokens} tokens together, "
                               f"beyond --seq-len {seq_len}, and a packed pair sits in one row; raise --seq-len, "
                               "shorten the row, or pass --packing off")
    return packed_groups(pairs, seq_len=seq_len, pad=pad_id(tokenizer), seed=seed)


def row_keys(labels: torch.Tensor) -> torch.Tensor:
    """Sequence keys where each row is one sequence (padded pairs): row i's positions all i."""
    return torch.arange(labels.shape[0], device=labels.device)[:, None].expand(labels.shape)


def present_keys(keys: torch.Tensor) -> torch.Tensor:
    """The sequence keys that occur in `keys` (-1: no sequence), ascending."""
    return torch.unique(keys[keys >= 0])


def segment_sums(values: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`values` (rows, seq) summed by sequence key, one sum per key of `present_keys(keys)`, in its order. A
    sequence lies in one row: its sum is that row's masked to it, summed as a row (a padded row's sum is then
    exactly `sequence_logps`'s)."""
    present = present_keys(keys)
    where = keys >= 0
    rows = torch.arange(keys.shape[0], device=keys.device)[:, None].expand(keys.shape)[where]
    row_of = torch.zeros(len(present), dtype=torch.long, device=keys.device)
    row_of[torch.searchsorted(present, keys[where])] = rows  # each sequence's row
    return (values[row_of] * (keys[row_of] == present[:, None])).sum(-1)


def segment_logps(logits: torch.Tensor, labels: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Each sequence's summed response log-prob (sequences by their `keys`, as `segment_sums` orders them), fp32."""
    return segment_sums(token_logps(logits, labels), keys.to(logits.device))


def segment_tokens(labels: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Each sequence's response tokens (those after the shift that are not -100), as `segment_sums` orders them."""
    counted = (F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:] != IGNORE_INDEX).float()
    return segment_sums(counted, keys.to(counted.device))


def local_keys(sequences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sequences present, in the order the rows first meet them; `sequences` renumbered 0, 1, ... in that
    order, -1 kept): a batch's global sequence numbers as keys into its own reference log-probs. Padded pairs' keys
    are then their rows' positions; a pair's chosen sequence comes just before its rejected one (the next row, or
    next in its row), so chosen sits at an even key and rejected at the next."""
    flat = sequences.reshape(-1)
    where = flat >= 0
    unique, inverse = torch.unique(flat[where], return_inverse=True)
    first = torch.full((len(unique),), flat.numel(), dtype=torch.long, device=flat.device).scatter_reduce(
        0, inverse, torch.arange(len(inverse), device=flat.device), reduce="amin")
    order = first.argsort()
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=flat.device)
    keys = torch.full_like(flat, -1)
    keys[where] = rank[inverse]
    return unique[order], keys.view(sequences.shape)


def reference_reduce(packed: bool):
    """What the last stage makes of each micro-batch's logits in a forward-only pass (`SplitModel.forward(reduce=)`):
    each row's log-prob (`sequence_logps`: a padded row is one sequence), or for packed rows each position's
    (`token_logps`), summed by sequence after (`sequence_values`)."""
    return token_logps if packed else sequence_logps


def sequence_values(reduced: torch.Tensor, keys: torch.Tensor, *, packed: bool) -> torch.Tensor:
    """Each sequence's log-prob, in key order, from a `reference_reduce` pass over rows with these `keys`: packed
    rows' positions summed by sequence; padded rows' own, those of rows without a key (-1) left out."""
    if packed:
        return segment_sums(reduced, keys)
    return reduced[keys[:, 0] >= 0]


def batch_sequences(batch: dict) -> torch.Tensor:
    """Each position's global sequence number in a batch: its packed rows' `sequences`, else (padded pairs) its
    row's index."""
    if "sequences" in batch:
        return batch["sequences"]
    return batch["index"][:, None].expand(batch["labels"].shape)


def pairs_of(sequences: torch.Tensor) -> int:
    """The pairs a batch holds (half its sequences)."""
    return len(present_keys(sequences)) // 2


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


def ipo_normalised(logps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """IPO's log-probs: TRL averages each sequence's over its response `tokens` (`segment_tokens`)."""
    return logps / tokens.clamp(min=1).to(logps.device)


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
             loss_type: str = "sigmoid", pairs_in_batch: int | None = None,
             keys: torch.Tensor | None = None) -> torch.Tensor:
    """This micro-batch's share of the global batch's mean DPO loss: its summed pair losses over
    `pairs_in_batch` (the global batch's pairs; None: this micro-batch's own, a plain mean). `keys`: each
    position's sequence (packed pairs; `reference` one log-prob per key present, ascending); None: a row each."""
    keys = row_keys(labels) if keys is None else keys.to(labels.device)
    return policy_loss(segment_logps(logits, labels, keys), labels, reference, beta=beta, loss_type=loss_type,
                       pairs_in_batch=pairs_in_batch, keys=keys)


def policy_loss(policy: torch.Tensor, labels: torch.Tensor, reference: torch.Tensor, *, beta: float,
                loss_type: str = "sigmoid", pairs_in_batch: int | None = None,
                keys: torch.Tensor | None = None) -> torch.Tensor:
    """`dpo_loss` from the policy's sequence log-probs (one per key of `keys` present, ascending; None: a row each)."""
    keys = row_keys(labels) if keys is None else keys.to(labels.device)
    present = present_keys(keys)
    if len(present) % 2 or (present[0::2] % 2).any() or not torch.equal(present[0::2] + 1, present[1::2]):
        raise ValueError("a DPO micro-batch holds whole chosen/rejected pairs (sequences 2i and 2i+1)")
    if loss_type == "ipo":
        tokens = segment_tokens(labels, keys)
        policy, reference = ipo_normalised(policy, tokens), ipo_normalised(reference, tokens)
    losses = pair_losses(policy, reference.to(policy.device), beta=beta, loss_type=loss_type)
    return losses.sum() / (pairs_in_batch if pairs_in_batch is not None else losses.numel())


def load_paired_rows(source: str, tokenizer, *, seq_len: int, packing: bool = False, seed: int = 0) -> TokenRows:
    """The preference file or hub set `source` as paired rows (see `paired_rows`), packed with `packing`."""
    dataset = load_examples(source)
    missing = [c for c in PREFERENCE_COLUMNS if c not in dataset.column_names]
    if missing:
        raise DatasetError(f"{source}: --objective dpo needs columns prompt, chosen and rejected (TRL's preference "
                           f"format); missing {', '.join(missing)}")
    return paired_rows(list(dataset), tokenizer, seq_len=seq_len, source=source, packing=packing, seed=seed)


def indexed_labels(labels: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
    """`labels` (rows, seq) with each position's sequence key appended, (rows, 2 · seq): the loss sums each
    sequence's log-probs by it and finds its reference log-prob at that key, whichever micro-batch the schedule
    hands it. `keys` (`local_keys`; -1: padding); None: row i is sequence i."""
    keys = row_keys(labels) if keys is None else keys
    return torch.cat([labels, keys.to(labels.dtype)], dim=1)


def split_targets(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels, sequence keys) of an `indexed_labels` target."""
    half = target.shape[1] // 2
    return target[:, :half], target[:, half:]


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
                 logps=None) -> torch.Tensor:
        """`logits`: the micro-batch's logits, or what `logps` maps to each row's log-probs (the normed hidden
        states of a chunked last stage: one sequence a row, packing refused with it)."""
        labels, keys = (t.to(logits.device) for t in split_targets(target))
        reference = self.reference.to(logits.device)[present_keys(keys)]
        policy = segment_logps(logits, labels, keys) if logps is None else logps(logits, labels)[keys[:, 0] >= 0]
        self.seen.append((policy.detach(), reference))
        return policy_loss(policy, labels, reference, beta=self.beta, loss_type=self.loss_type,
                           pairs_in_batch=num_items_in_batch, keys=keys)

    def evaluate(self, policy: torch.Tensor, reference: torch.Tensor, tokens: torch.Tensor) -> dict[str, float]:
        """The mean pair loss ("loss") and TRL's metrics of held-out pairs from their sequences' log-probs and
        response `tokens`."""
        metrics = dpo_metrics(policy, reference, beta=self.beta)
        if self.loss_type == "ipo":
            policy, reference = ipo_normalised(policy, tokens), ipo_normalised(reference, tokens)
        losses = pair_losses(policy, reference.to(policy.device), beta=self.beta, loss_type=self.loss_type)
        return {"loss": losses.mean().item(), **metrics}

    def step_metrics(self, *, calls: int) -> dict[str, float]:
        """TRL's metrics over this step's pairs on this replica (empty off the last stage), and "pairs", how many,
        from the loss's last `calls` calls (the step's micro-batches: the first step's schedule also runs it once
        more, on its warm-up); resets them."""
        if not self.seen:
            return {}
        policy, reference = (torch.cat(t) for t in zip(*self.seen[-calls:]))
        self.seen = []
        return {**dpo_metrics(policy, reference, beta=self.beta), "pairs": len(policy) // 2}
