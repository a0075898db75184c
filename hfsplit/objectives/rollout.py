"""Generation for objectives that learn from their own samples (GRPO's rollouts), with transformers' `generate`
arguments: left-padded prompts with their attention mask, `max_new_tokens`, `do_sample`, `temperature`, `top_k`,
`top_p`, `num_return_sequences`, `eos_token_id`, `pad_token_id`, and a seed.

This is the one place the objectives generate: `SplitModel.generate` (issue 31 item 2: pipelined, each stage
keeping its layers' KV cache per micro-batch, transformers' logits processors). `recompute_generate` below is the
stand-in the objectives used before it, kept as a second implementation for the models without `generate`: each
new token one forward of the whole sequences through the pipeline, no KV cache. Every rank draws the same tokens.
With data-parallel replicas each generates its share of the prompts and the replicas gather the whole batch.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from hfsplit.parallel.generation import merged_generation_config, special_tokens


def generate(model, input_ids: torch.Tensor, *, attention_mask: Optional[torch.Tensor] = None,
             max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0, top_k: Optional[int] = None,
             top_p: float = 1.0, num_return_sequences: int = 1,
             eos_token_id: Union[int, Sequence[int], None] = None, pad_token_id: Optional[int] = None,
             seed: int = 0) -> torch.Tensor:
    """Prompts and their continuations `(batch × num_return_sequences, prompt + new)`, as transformers' `generate`
    returns them, by the split model's own pipelined `generate` (`recompute_generate` where it has none)."""
    arguments = dict(attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=do_sample,
                     temperature=temperature, top_k=top_k or 0, top_p=top_p, num_return_sequences=num_return_sequences,
                     eos_token_id=eos_token_id, pad_token_id=pad_token_id, seed=seed)
    if not hasattr(model, "generate"):
        return recompute_generate(model, input_ids, **arguments)
    replicas = replica_count(model)
    if replicas == 1 or len(input_ids) < replicas:
        return model.generate(input_ids, **arguments).cpu()
    return replicas_generate(model, input_ids, replicas=replicas, **arguments)


def replica_count(model) -> int:
    """How many data-parallel replicas `model` has (1 outside a split model)."""
    ctx = getattr(model, "ctx", None)
    return ctx.plan.dp if ctx is not None else 1


def replicas_generate(model, input_ids: torch.Tensor, *, replicas: int, attention_mask: Optional[torch.Tensor],
                      seed: int, pad_token_id: Optional[int], eos_token_id, **arguments) -> torch.Tensor:
    """The whole batch's generations, each data-parallel replica generating one consecutive share of the prompts
    (a prompt's sequences stay together) and the replicas gathering them: each replica's pipeline does 1/dp of the
    work instead of all of it. Greedy rows equal the whole batch's (each row's tokens depend on that row alone); a
    seeded draw is the same on every rank and run to run, each replica drawing from its own seeds."""
    ctx = model.ctx
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    shares = [len(part) for part in torch.arange(len(input_ids)).tensor_split(replicas)]
    start = sum(shares[:ctx.coords.dp])
    mine = slice(start, start + shares[ctx.coords.dp])
    out = model.generate(input_ids[mine], attention_mask=mask[mine], seed=seed + ctx.coords.dp * len(input_ids),
                         pad_token_id=pad_token_id, eos_token_id=eos_token_id, **arguments)
    pad = model_pad(model, pad_token_id, eos_token_id)
    copies = out.shape[0] // shares[ctx.coords.dp]
    # the replicas' rows and lengths differ: gather them padded to the most of each, then cut each share to its rows
    width = torch.tensor([out.shape[1]], device=out.device)
    dist.all_reduce(width, op=dist.ReduceOp.MAX, group=ctx.dp_group)
    held = torch.full((max(shares) * copies, int(width)), pad, dtype=out.dtype, device=out.device)
    held[:out.shape[0], :out.shape[1]] = out
    gathered = [torch.empty_like(held) for _ in range(replicas)]
    dist.all_gather(gathered, held, group=ctx.dp_group)
    return torch.cat([rows[:share * copies] for rows, share in zip(gathered, shares)]).cpu()


def model_pad(model, pad_token_id: Optional[int], eos_token_id) -> int:
    """The pad id `model.generate` continues finished rows with (its generation config with these arguments)."""
    config = merged_generation_config(model.generation_config, pad_token_id=pad_token_id, eos_token_id=eos_token_id)
    return special_tokens(config)[1]


def recompute_generate(model, input_ids: torch.Tensor, *, attention_mask: Optional[torch.Tensor] = None,
                       max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
                       top_k: Optional[int] = None, top_p: float = 1.0, num_return_sequences: int = 1,
                       eos_token_id: Union[int, Sequence[int], None] = None, pad_token_id: Optional[int] = None,
                       seed: int = 0) -> torch.Tensor:
    """Prompts and their continuations `(batch × num_return_sequences, prompt + new)`, as transformers' `generate`
    returns them: each prompt's sequences next to each other, finished ones continued with `pad_token_id`, the loop
    over once every sequence has produced an end-of-sequence token. Sampling applies transformers' own logits
    warpers (`sampling_processors`). Collective: every rank of the model calls it with the same arguments.

    Args:
        model: a `SplitModel` (its `forward(ids, position_ids=, broadcast=True)`) or any callable of that shape.
        input_ids: `(batch, prompt)` prompts, left-padded.
        attention_mask: `(batch, prompt)`, 0 on the left padding; None: no padding.
    """
    ids = input_ids.repeat_interleave(num_return_sequences, dim=0)
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask.repeat_interleave(num_return_sequences, 0)
    eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or ()))
    pad = pad_token_id if pad_token_id is not None else (int(eos[0]) if len(eos) else 0)
    width, start = ids.shape[1] + max_new_tokens, ids.shape[1]
    rows = torch.full((ids.shape[0], width), pad, dtype=ids.dtype)
    rows[:, :start] = ids
    positions = padded_positions(mask.to(torch.int64), width)
    warp = sampling_processors(temperature=temperature, top_k=top_k, top_p=top_p) if do_sample else None
    generator = torch.Generator().manual_seed(seed)
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool)
    for step in range(max_new_tokens):
        logits = model.forward(rows, position_ids=positions, broadcast=True)[:, start + step - 1].float().cpu()
        token = next_tokens(logits, rows[:, :start + step], warp=warp, generator=generator)
        token = torch.where(unfinished, token, torch.full_like(token, pad))
        rows[:, start + step] = token
        unfinished &= ~torch.isin(token, eos)
        if not unfinished.any():
            return rows[:, :start + step + 1]
    return rows


def padded_positions(mask: torch.Tensor, width: int) -> torch.Tensor:
    """Each position's id for `width` columns whose first `mask.shape[1]` are left-padded prompts: the padding one
    sequence of its own (0, 1, ...), the prompt and what follows another from 0, so attention never crosses from
    one to the other (packed rows, `hfsplit.models.masks`). RoPE sees only relative positions: each prompt's logits
    are those of transformers with the attention mask."""
    pads = (mask == 0).sum(-1, keepdim=True)
    columns = torch.arange(width)[None].expand(mask.shape[0], width)
    return torch.where(columns < pads, columns, columns - pads)


def next_tokens(logits: torch.Tensor, seen: torch.Tensor, *, warp=None, generator=None) -> torch.Tensor:
    """Each row's next token from its last logits: the most likely (greedy), else a draw from the warped
    distribution with `generator`."""
    if warp is None:
        return logits.argmax(-1)
    probs = torch.softmax(warp(seen, logits), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def sampling_processors(*, temperature: float = 1.0, top_k: Optional[int] = None, top_p: float = 1.0):
    """transformers' logits warpers for sampling, as its `generate` builds them (temperature, then top-k, then
    top-p; each only where it changes something)."""
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    warpers = LogitsProcessorList()
    if temperature is not None and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return warpers
