"""Generation on the split stages: a batch of prompts cut into micro-batches that flow through the stages together.

Each stage keeps its layers' KV cache per micro-batch (a transformers `DynamicCache` each), so while the last stage
chooses one micro-batch's next tokens the first already runs the next micro-batch: every stage works at once, where
the relay that `device_map` does (one micro-batch through the stages in turn, `micro_batches=1` here) keeps one busy.

Every rank runs the same loop over (step, stage, micro-batch), in that order, over its own stages. Before a step's
first stage here it takes the tokens the last stage chose at the previous step (every rank appends them to its copy
of the micro-batch's rows, so each knows alike when a micro-batch has finished); each stage receives the hidden
states it needs, runs, and sends on without waiting (`isend`). A receive only ever waits for something earlier in
that order, so the loop cannot deadlock. Hidden states and tokens travel on two process groups over the same pipeline ranks: each pair of ranks
then sees either stream in the order it was sent (NCCL matches point-to-point messages in order, without tags).

The prompts' pass (prefill) is cut along the sequence too (`prefill_chunks`): chunk k+1 of a micro-batch runs on a
stage while chunk k runs on the next, the cache growing as it would a token at a time, so the stages already work
at once on the prompts, where a few micro-batches alone would leave a stage idle while the pipeline fills (with 2
micro-batches on 2 stages, a third of the prefill's time; docs/benchmarks/generate.md).

Tokens are chosen as transformers' `generate` chooses them: its own logits processors for the `GenerationConfig`
(`GenerationMixin._get_logits_processor`: temperature, top-k, top-p, repetition penalty...), then argmax or one
multinomial draw; rows that have finished continue with the pad token.
"""
from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from transformers import DynamicCache, GenerationConfig
from transformers.generation.utils import GenerationMixin

from hfsplit.checkpoint.resolve import resolve_file
from hfsplit.errors import CheckpointError
from hfsplit.parallel.mesh import ParallelContext


def generation_config_for(config, source: Optional[str] = None) -> GenerationConfig:
    """The checkpoint's `generation_config.json`, as transformers' `from_pretrained` reads it; else the one
    transformers derives from the model's config."""
    if source is not None:
        try:
            path = resolve_file(source, "generation_config.json")
        except CheckpointError:
            path = None
        if path is not None:
            return GenerationConfig.from_pretrained(str(path.parent))
    return GenerationConfig.from_model_config(config)


def merged_generation_config(base: GenerationConfig, **kwargs) -> GenerationConfig:
    """`base`, its unset fields at transformers' global defaults (top_k=50, max_length=20...), updated with
    `generate`'s keyword arguments (None: left as they are), as transformers' `_prepare_generation_config` merges
    them; an argument `GenerationConfig` does not know raises."""
    config = copy.deepcopy(base)
    config.update(**config._get_default_generation_params(), defaults_only=True)
    unused = config.update(**{k: v for k, v in kwargs.items() if v is not None})
    if unused:
        raise TypeError(f"generate() got arguments it does not take: {', '.join(sorted(unused))}")
    config.validate()
    return config


def special_tokens(config: GenerationConfig) -> tuple[torch.Tensor, int]:
    """(end-of-sequence ids, pad id): without a pad token, the first end-of-sequence one, as transformers picks."""
    eos = config.eos_token_id
    eos = torch.tensor([] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos], dtype=torch.long)
    pad = config.pad_token_id if config.pad_token_id is not None else int(eos[0]) if len(eos) else 0
    return eos, int(pad)


class ProcessorSource:
    """What transformers' `GenerationMixin._get_logits_processor` reads of the model it is a method of (the
    model's config, the list merger), so that the split model's scores go through transformers' own processors."""

    _get_logits_processor = GenerationMixin._get_logits_processor
    _merge_criteria_processor_list = GenerationMixin._merge_criteria_processor_list

    def __init__(self, config):
        self.config = config


def logits_processors(model_config, generation_config: GenerationConfig, *, prompt: torch.Tensor):
    """transformers' `LogitsProcessorList` for `generation_config` and a batch of `prompt` `(rows, length)`."""
    return ProcessorSource(model_config)._get_logits_processor(
        generation_config=generation_config, input_ids_seq_length=prompt.shape[1], encoder_input_ids=prompt,
        device=prompt.device)


def next_tokens(scores: torch.Tensor, *, sample: bool, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The next token of each row from processed `scores` `(rows, vocab)`: argmax, or one draw from their softmax."""
    if not sample:
        return scores.argmax(-1)
    return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1, generator=generator).squeeze(1)


@dataclass
class Rollout:
    """One micro-batch's generation, held alike on every rank: its rows so far, their padding mask, which rows are
    unfinished, and the KV caches of this rank's stages (by stage index)."""

    sequences: torch.Tensor
    mask: torch.Tensor
    unfinished: torch.Tensor
    caches: dict
    start: int = 0  # the positions the next pass feeds: start..end (a prompt's chunk, then the new token)
    end: int = 0
    steps: int = 0
    done: bool = False
    chosen: Optional[torch.Tensor] = None  # on the last stage's rank: the tokens it chose, until it takes them

    @property
    def new(self) -> int:
        return self.end - self.start

    def inputs(self) -> torch.Tensor:
        return self.sequences[:, self.start:self.end]

    def positions(self) -> torch.Tensor:
        """The fed tokens' position ids, as transformers derives them from the padding mask (pads at 0)."""
        positions = self.mask.long().cumsum(-1) - 1
        return positions.masked_fill(self.mask == 0, 0)[:, self.start:self.end]

    def seen_mask(self) -> torch.Tensor:
        """The padding mask of every position up to the fed ones: what the cache and the fed tokens attend over."""
        return self.mask[:, :self.end]

    def feed(self, end: int) -> None:
        """The next pass feeds the prompt's positions from where the last one stopped to `end`."""
        self.start, self.end = self.end, end

    def take(self, tokens: torch.Tensor, *, eos: torch.Tensor, limit: int) -> None:
        """Append the chosen `tokens`; done once every row has ended or `limit` tokens are generated."""
        self.sequences = torch.cat([self.sequences, tokens[:, None]], dim=1)
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), 1)], dim=1)
        self.unfinished &= ~torch.isin(tokens, eos)
        self.steps = self.steps + 1
        self.start, self.end = self.sequences.shape[1] - 1, self.sequences.shape[1]
        self.done = self.steps >= limit or not bool(self.unfinished.any())


def chunk_ends(length: int, chunks: int) -> list[int]:
    """Where each of `chunks` near-equal chunks of `length` positions ends (the first ones a position longer)."""
    size, extra = divmod(length, chunks)
    ends, end = [], 0
    for k in range(chunks):
        end += size + (k < extra)
        ends.append(end)
    return ends


def rollouts_of(input_ids: torch.Tensor, attention_mask: torch.Tensor, *, micro_batches: int, config,
                stage_indices) -> list[Rollout]:
    """The batch cut into `micro_batches` consecutive micro-batches (sizes differing by at most one row), each with
    an empty cache per stage of this rank."""
    return [Rollout(sequences=ids, mask=mask, unfinished=torch.ones(len(ids), dtype=torch.bool, device=ids.device),
                    caches={index: DynamicCache(config=config) for index in stage_indices})
            for ids, mask in zip(input_ids.tensor_split(micro_batches), attention_mask.tensor_split(micro_batches))]


def joined_sequences(rollouts: list[Rollout], *, pad: int) -> torch.Tensor:
    """The micro-batches' rows, in batch order, padded with `pad` to the longest (as transformers pads the rows
    that finished before the batch did)."""
    length = max(r.sequences.shape[1] for r in rollouts)
    return torch.cat([torch.nn.functional.pad(r.sequences, (0, length - r.sequences.shape[1]), value=pad)
                      for r in rollouts])


def token_group(ctx: ParallelContext):
    """A second group over this rank's pipeline ranks, for the chosen tokens (collective: every rank creates every
    pipeline's group, in the same order)."""
    plan, mine = ctx.plan, None
    for dp in range(plan.dp):
        for tp in range(plan.tp):
            group = dist.new_group([(dp * plan.pp + pp) * plan.tp + tp for pp in range(plan.pp)])
            if (ctx.coords.dp, ctx.coords.tp) == (dp, tp):
                mine = group
    return mine


@dataclass(frozen=True)
class Choice:
    """How the last stage chooses tokens: transformers' processors, sampling or not, the micro-batches'
    generators (None: torch's global one), and the end-of-sequence and pad ids."""

    processors: object
    sample: bool
    generators: list
    eos: torch.Tensor
    pad: int
    limit: int  # max_new_tokens


class PipelinedGeneration:
    """This rank's part of one pipelined `generate`: its stages (by index), who owns each stage, and the groups
    hidden states and tokens travel on.

    Args:
        stages: this rank's stage modules by stage index.
        owner: the pipeline rank of every stage index.
        ctx: this rank's parallel context.
        tokens: the second pipeline group (`token_group`).
        hidden_size, dtype: what the stages pass on.
        choice: how the last stage chooses tokens.
    """

    def __init__(self, *, stages: dict, owner: dict, ctx: ParallelContext, tokens, hidden_size: int,
                 dtype: torch.dtype, choice: Choice):
        self.stages, self.owner, self.ctx, self.tokens = stages, owner, ctx, tokens
        self.hidden_size, self.dtype, self.choice = hidden_size, dtype, choice
        self.me = ctx.coords.pp
        self.last = len(owner) - 1
        self.sends: deque = deque()
        self.carry: dict[int, torch.Tensor] = {}  # a micro-batch's hidden states between two stages of this rank
        self.outstanding = 0

    def run(self, rollouts: list[Rollout], *, prefill_chunks: int = 1) -> list[Rollout]:
        """Generate every micro-batch to its end: the prompts in `prefill_chunks` passes along the sequence, then a
        pass a new token. Each pass runs this rank's stages in order, each over every micro-batch: a rank holding
        two stages (the V shape) runs one over all micro-batches while the other rank runs its own, instead of
        waiting on each micro-batch's round trip."""
        # a (pass, micro-batch) sends at most one hidden state per stage here and the tokens to every other rank
        self.outstanding = 2 * (len(rollouts) + 1) * (len(self.stages) + len(self.owner))
        first = min(self.stages)
        length = rollouts[0].sequences.shape[1]
        for r in rollouts:
            r.done = self.choice.limit <= 0
        for end in chunk_ends(length, max(1, min(prefill_chunks, length))):
            for stage in sorted(self.stages):
                for index, r in enumerate(rollouts):
                    if stage == first:
                        r.feed(end)
                    if not r.done:
                        self.run_stage(stage, index, r, choose=end == length)
        for _ in range(self.choice.limit):
            for stage in sorted(self.stages):
                for index, r in enumerate(rollouts):
                    if stage == first and not r.done:
                        r.take(self.chosen(r), eos=self.choice.eos, limit=self.choice.limit)
                    if not r.done:
                        self.run_stage(stage, index, r)
        while self.sends:
            self.sends.popleft()[0].wait()
        return rollouts

    def run_stage(self, stage: int, index: int, r: Rollout, *, choose: bool = True) -> None:
        """One pass of micro-batch `index` through stage `stage` of this rank; the last stage chooses the next
        tokens unless the pass is a prompt's chunk before its last."""
        if stage == 0:
            x = r.inputs()
        elif self.owner[stage - 1] != self.me:
            x = self.receive_hidden(rows=len(r.sequences), new=r.new, pp=self.owner[stage - 1])
        else:
            x = self.carry.pop(index)
        x = self.stages[stage](x, cache=r.caches[stage], position_ids=r.positions(), attention_mask=r.seen_mask(),
                               logits_to_keep=1)
        if stage == self.last:
            if choose:
                self.choose(index, r, x)
        elif self.owner[stage + 1] != self.me:
            self.send(x.contiguous(), pp=self.owner[stage + 1], group=self.ctx.pp_group)
        else:
            self.carry[index] = x

    def choose(self, index: int, r: Rollout, logits: torch.Tensor) -> None:
        """The last stage: the next tokens of micro-batch `index`, sent to every other pipeline rank."""
        choice = self.choice
        scores = choice.processors(r.sequences, logits[:, -1].to(dtype=torch.float32, copy=True))
        tokens = next_tokens(scores, sample=choice.sample, generator=choice.generators[index])
        if len(choice.eos):
            tokens = torch.where(r.unfinished, tokens, torch.full_like(tokens, choice.pad))
        if choice.sample and self.ctx.plan.tp > 1:  # the stage's TP ranks go on with one draw: TP rank 0's
            src = self.ctx.global_rank(pp=self.me) - self.ctx.coords.tp
            dist.broadcast(tokens, src=src, group=self.ctx.tp_mesh.get_group())
        r.chosen = tokens
        for pp in sorted(set(self.owner.values()) - {self.me}):
            self.send(tokens, pp=pp, group=self.tokens)

    def chosen(self, r: Rollout) -> torch.Tensor:
        """The tokens the last stage chose for `r` at the previous step (received, unless this rank chose them)."""
        if self.owner[self.last] == self.me:
            return r.chosen
        tokens = torch.empty(len(r.sequences), dtype=torch.long, device=self.ctx.device)
        dist.recv(tokens, src=self.ctx.global_rank(pp=self.owner[self.last]), group=self.tokens)
        return tokens

    def receive_hidden(self, *, rows: int, new: int, pp: int) -> torch.Tensor:
        x = torch.empty((rows, new, self.hidden_size), dtype=self.dtype, device=self.ctx.device)
        dist.recv(x, src=self.ctx.global_rank(pp=pp), group=self.ctx.pp_group)
        return x

    def send(self, tensor: torch.Tensor, *, pp: int, group) -> None:
        """Send without waiting. The oldest sends are waited for once more than `outstanding` are: this rank is then
        more than a round of micro-batches past them, past where their receiver takes them, so no wait is circular."""
        self.sends.append((dist.isend(tensor, dst=self.ctx.global_rank(pp=pp), group=group), tensor))
        while len(self.sends) > self.outstanding:
            self.sends.popleft()[0].wait()
