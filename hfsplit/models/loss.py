"""The causal-LM loss: transformers' own, and one on the last stage that never holds the whole micro-batch's logits.

The plain head makes `tokens × vocab` logits in the compute dtype, the loss upcasts them to fp32 and keeps
that copy for backward: for Llama-3.1-70B at seq 2048 that is 1.5 GiB per micro-batch on the last stage.
With `TrainingSpec.chunked_loss` the last stage stops after its final norm; the loss runs lm_head (and the
family's logit scaling / soft-cap) on `chunk_tokens(...)` tokens at a time, each chunk under activation
checkpointing, so only the normed hidden states stay for backward and one chunk's logits exist at a time
(backward recomputes them). The loss is transformers' `ForCausalLMLoss` (shift, ignore -100, the summed token
loss over `num_items_in_batch`, or over the tokens that count), summed chunk by chunk: the same loss and gradients
up to summation order (tested).

DPO's per-sequence log-probs go the same way (`chunked_sequence_logps`): each chunk's logits, their fp32
log-softmax and the label tokens' log-probs, under checkpointing, summed into each token's row; a row's response
may span chunks. A loss that takes its log-probs from a `logps` keyword (`takes_logps`, DPO's) gets that
function on a chunked last stage (`ChunkedHeadLoss`).
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
CHUNK_LOGIT_BYTES = 64 << 20  # fp32 logits of one chunk: small next to a block's workspace, large enough to stay fast
MIN_CHUNKS = 8  # and at least this many chunks, so a small model saves as a large one does


def causal_lm_loss(vocab_size: int):
    """transformers' own causal-LM loss: shift, ignore -100, the summed token loss over `num_items_in_batch` (the
    label tokens of the whole global batch, as its Trainer passes them), or the mean over these labels' tokens."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch)

    loss_fn.causal_lm = True  # a chunked_loss plan may compute it chunk by chunk (`chunked_causal_lm_loss`)
    return loss_fn


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-prob of its label tokens (labels unshifted, -100 ignored), in fp32: (rows,). DPO's
    per-sequence log-prob, as TRL sums it (`hfsplit.training.preference`; the planner traces the head with it)."""
    return token_logps(logits, labels).sum(-1)


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The log-prob of each position's next label token (labels unshifted), 0 where it is -100, in fp32:
    (rows, seq). Packed DPO rows sum it sequence by sequence."""
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].to(logits.device)
    mask = shifted != IGNORE_INDEX
    logps = torch.log_softmax(logits.float(), dim=-1)
    token = torch.gather(logps, -1, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return token * mask


def dpo_head_loss(logits: torch.Tensor, labels: torch.Tensor, *, logps=sequence_logps) -> torch.Tensor:
    """What the DPO loss does with a micro-batch's logits, for tracing its memory: the policy's log-probs with
    gradients (`logps`: of the logits, or chunk by chunk of the normed hidden states), the metrics keep them
    detached, into the sigmoid loss of each pair (chosen row, rejected row) against a constant reference
    (`hfsplit.training.preference.DpoLoss`)."""
    policy = logps(logits, labels)
    return -F.logsigmoid(policy[0::2] - policy[1::2]).sum()


def chunked_sequence_logps(hidden: torch.Tensor, labels: torch.Tensor, *,
                           head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                           vocab_size: int) -> torch.Tensor:
    """`sequence_logps(head(hidden), labels)`, computed `chunk_tokens` tokens at a time: one chunk's logits and
    their fp32 log-softmax exist at a time, under activation checkpointing (backward recomputes them), so only
    `hidden` stays for backward. Without gradients it is a plain chunked pass.

    Args:
        hidden: the final norm's output `(rows, seq, hidden)`; with `head=None`, the logits `(rows, seq, vocab)`.
        labels: `(rows, seq)`, unshifted; -100 is ignored.
        head: hidden states → logits (lm_head plus the family's output side), acting token by token; None: identity.
        vocab_size: the logits' last dimension.

    Returns: each row's summed log-prob of its label tokens, fp32 `(rows,)`.
    """
    rows, seq = labels.shape[0], labels.shape[-1]
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1).to(hidden.device)
    flat = hidden.reshape(rows * seq, hidden.shape[-1])
    step = chunk_tokens(vocab_size, flat.shape[0])
    head = head if head is not None else _identity
    tokens = [checkpoint(_token_logps, flat[first:first + step], shifted[first:first + step], head, vocab_size,
                         use_reentrant=False) for first in range(0, flat.shape[0], step)]
    return torch.cat(tokens).view(rows, seq).sum(-1)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _token_logps(hidden: torch.Tensor, labels: torch.Tensor, head, vocab_size: int) -> torch.Tensor:
    """Each token's fp32 log-prob of its label (0 where ignored): `(tokens,)`."""
    logps = torch.log_softmax(head(hidden).float().view(-1, vocab_size), dim=-1)
    token = torch.gather(logps, -1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return token * (labels != IGNORE_INDEX)


def chunk_tokens(vocab_size: int, tokens: int) -> int:
    """Tokens per chunk: at most CHUNK_LOGIT_BYTES of fp32 logits, and at most 1/MIN_CHUNKS of the tokens."""
    return max(1, min(CHUNK_LOGIT_BYTES // (4 * vocab_size), math.ceil(tokens / MIN_CHUNKS)))


def chunked_causal_lm_loss(hidden: torch.Tensor, labels: torch.Tensor, *, head: Callable[[torch.Tensor], torch.Tensor],
                           vocab_size: int, num_items_in_batch=None) -> torch.Tensor:
    """transformers' `ForCausalLMLoss(head(hidden), labels, vocab_size, num_items_in_batch)`, computed
    `chunk_tokens` tokens at a time.

    Args:
        hidden: the final norm's output, `(batch, seq, hidden)`.
        labels: `(batch, seq)`, unshifted (as the model's own loss takes them); -100 is ignored.
        head: hidden states → logits (lm_head plus the family's output side); must act token by token.
        num_items_in_batch: the summed loss is divided by it; None: by this micro-batch's label tokens.
    """
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    step = chunk_tokens(vocab_size, flat.shape[0])
    total = hidden.new_zeros((), dtype=torch.float32)
    for first in range(0, flat.shape[0], step):
        total = total + checkpoint(_summed_loss, flat[first:first + step], shifted[first:first + step], head,
                                   vocab_size, use_reentrant=False)
    items = num_items_in_batch if num_items_in_batch is not None else (shifted != IGNORE_INDEX).sum()
    return total / (items.to(total.device) if torch.is_tensor(items) else items)


def _summed_loss(hidden: torch.Tensor, labels: torch.Tensor, head, vocab_size: int) -> torch.Tensor:
    logits = head(hidden).float().view(-1, vocab_size)
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def takes_logps(loss_fn) -> bool:
    """Whether `loss_fn` reads its logits only through sequence log-probs and takes the function computing them
    as its `logps` keyword (DPO's loss): a chunked last stage then hands it `chunked_sequence_logps`."""
    return bool(getattr(loss_fn, "takes_logps", False))


class ChunkedHeadLoss:
    """The pipeline's loss function for a last stage that stops at its final norm (`StageModule.head_in_loss`):
    applies that stage's lm_head chunk by chunk inside the loss: the causal-LM loss (`loss_fn` None), or
    `loss_fn` (`takes_logps`) with its sequence log-probs from `chunked_sequence_logps`."""

    def __init__(self, stage, loss_fn=None):
        self.stage, self.loss_fn = stage, loss_fn

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.stage.logits_of(hidden)

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        vocab_size = self.stage.config.vocab_size
        if self.loss_fn is not None:
            logps = partial(chunked_sequence_logps, head=self.head, vocab_size=vocab_size)
            return self.loss_fn(hidden, labels, num_items_in_batch, logps=logps)
        return chunked_causal_lm_loss(hidden, labels, head=self.head, vocab_size=vocab_size,
                                      num_items_in_batch=num_items_in_batch)
