"""SplitModel: this rank's part of a pipeline × tensor-parallel split model.

Every rank runs the same program (SPMD) and passes the same batch to `forward`,
`generate` and `step`; the pipeline decides who uses it (the first stage reads the
ids, the last stage the labels, every stage the position ids).

Position ids reach every stage as a keyword argument of the schedule's `step`, which torch.distributed.pipelining
splits into micro-batches and hands to each stage on its own rank ("kwargs can be passed to all stages"), rather
than as a tensor sent along with the hidden states: every rank already holds the batch, so nothing more crosses
the links, the p2p buffers keep one shape, and backward sends no gradient for them (torch keeps kwargs local).

The training loss is the token mean of the global batch, as transformers' Trainer computes it with
`num_items_in_batch`: each micro-batch's loss is its summed token loss divided by the label tokens of the whole
step (every micro-batch of every data-parallel replica), the schedule adds them up unscaled, and data-parallel
gradients are summed.
"""
from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedModel

from hfsplit.apply.load import load_stages
from hfsplit.apply.lora import LoraSetup
from hfsplit.apply.steps import apply_plan
from hfsplit.apply.tp import grad_summed_over_tp, local_tensor, shard_layout, tp_shard_dim
from hfsplit.checkpoint.resolve import load_config
from hfsplit.errors import PlanError, SplitAttributeError
from hfsplit.models.loss import IGNORE_INDEX
from hfsplit.models.families import tp_degree_error
from hfsplit.models.boundary import boundary_width
from hfsplit.models.packed_recurrence import has_recurrent_mixer
from hfsplit.parallel.generation import (
    Choice, PipelinedGeneration, generation_config_for, joined_sequences, logits_processors, merged_generation_config,
    rollouts_of, special_tokens, token_group,
)
from hfsplit.parallel.mesh import ParallelContext, stage_indices_of_pp_rank, stage_to_pp_rank
from hfsplit.planning.rollout import prefill_chunks_for
from hfsplit.parallel.pipeline import (
    SCHEDULE_TAKES_LOSS_KWARGS, ReducedOutput, StageTimer, build_schedule, chunked_or, head_in_loss, pipeline_stages,
    releasing_graph, with_step_kwargs,
)
from hfsplit.parallel.router import carrying, with_router_loss
from hfsplit.parallel.save import save_split_model
from hfsplit.parallel.stage import StageModule, build_stage_module
from hfsplit.plan import Plan


class SplitModel(nn.Module):
    """This rank's stages of a split causal LM, run as a pipeline.

    Args:
        plan: the plan being run.
        config: the model's transformers config.
        ctx: this rank's parallel context (coordinates, device, mesh).
        stages: this rank's stage modules, in pipeline order.
        stage_indices: their indices in the pipeline.
    """

    def __init__(self, *, plan: Plan, config, ctx: ParallelContext, stages: list[StageModule],
                 stage_indices: tuple[int, ...]):
        super().__init__()
        self.plan = plan
        self.config = config
        self.ctx = ctx
        self.stages = nn.ModuleList(stages)
        self.stage_indices = stage_indices
        self._schedules: dict[tuple, object] = {}
        self._step_loss_kwargs: dict = {}  # the step's loss keywords, under a torch whose schedules take none
        self._recurrent: Optional[bool] = None  # any stage holds a recurrent mixer (`_recurrent_stages`)
        self._timer = StageTimer()
        self._tokens = None  # generation's second pipeline group (`_token_group`)
        self.generation_config = generation_config_for(config)  # build_split_model: the checkpoint's own
        self.source: Optional[str] = None  # the checkpoint it was read from (build_split_model)
        self.hf_device_map: dict[str, str] = {}  # every stage's modules → "rank:device" (build_split_model)
        # flash attention finds packed examples from the position ids of a one-row batch only (transformers'
        # `_is_packed_sequence`), so each micro-batch then runs as one row of its rows joined (exact: every row
        # starts a sequence at position 0, and the join never lets a row's last token learn the next row's first)
        self.join_rows = "flash" in str(getattr(config, "_attn_implementation", None) or "")

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def hfsplit_plan(self) -> Plan:
        """The Plan this split runs, as the single-process model's `hfsplit_plan`."""
        return self.plan

    @property
    def num_stages(self) -> int:
        return len(self.plan.stages)

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    @property
    def last_pp_rank(self) -> int:
        return stage_to_pp_rank(self.plan)[self.num_stages - 1]

    def weight_bytes(self) -> int:
        """Bytes of parameters this rank holds (its TP shards only), to compare with the plan's estimate."""
        return sum(local_tensor(p.data).nbytes for p in self.parameters())

    # --- inference -------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, *, position_ids: Optional[torch.Tensor] = None,
                broadcast: bool = False, reduce: Optional[Callable] = None,
                targets: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Logits `(batch, seq, vocab)` on the last stage's ranks (every rank with `broadcast=True`), else None.

        `position_ids` `(batch, seq)`: each token's position within its example (a packed row restarts at 0 for
        each, and attention stays inside each example); None: every row is one sequence.
        `reduce(logits, targets)`: the last stage reduces each micro-batch's logits `(rows, seq, vocab)` with its
        rows of `targets` `(batch, seq)` as they leave it, and lets them go; the results joined along rows come
        back instead of the logits (`sequence_logps`: `(batch,)`), so the pass holds one micro-batch's logits at a
        time (a rank of several stages relays the whole batch at once and reduces its logits)."""
        if reduce is not None and broadcast:
            raise ValueError("forward(reduce=...) returns the reduction on the last stage only: drop broadcast")
        input_ids = input_ids.to(self.device)
        shape = tuple(input_ids.shape)
        positions = positions_of(input_ids, position_ids)
        groups = micro_batches_for(batch=shape[0], planned=self.plan.micro_batches) if len(self.stages) == 1 else 1
        targets = targets.to(self.device) if reduce is not None and self.has_last else None
        if self.join_rows:
            input_ids, positions = joined_rows(input_ids, groups), joined_rows(positions, groups)
            targets = joined_rows(targets, groups) if targets is not None and len(self.stages) == 1 else targets
        if len(self.stages) == 1:
            schedule = self._schedule(tuple(input_ids.shape), loss_fn=None, name="GPipe",
                                      reduce=(reduce, shape[1]) if reduce is not None else None)
            extra = {"targets": targets} if targets is not None else {}
            logits = schedule.step(*((input_ids,) if self.has_first else ()), position_ids=positions, **extra)
            if reduce is not None:
                return logits if self.has_last else None  # the micro-batches' reductions, joined
        else:
            logits = self._relay_forward(input_ids, position_ids=positions)
        if logits is not None and self.join_rows:
            logits = logits.reshape(*shape, -1)
        if reduce is not None:
            return reduce(logits, targets) if self.has_last else None
        if not broadcast:
            return logits if self.has_last else None
        return self._broadcast_logits(logits, shape=(*shape, self.config.vocab_size))

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
                 max_new_tokens: Optional[int] = None, do_sample: Optional[bool] = None,
                 temperature: Optional[float] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
                 num_return_sequences: Optional[int] = None, eos_token_id=None, pad_token_id: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, seed: Optional[int] = None,
                 micro_batches: Optional[int] = None, prefill_chunks: Optional[int] = None,
                 **generation_kwargs) -> torch.Tensor:
        """Continue a batch of prompts as transformers' `generate` does, pipelined over the stages; on every rank.

        The batch is cut into micro-batches that flow through the stages together, each stage keeping its layers'
        KV cache per micro-batch (`hfsplit.parallel.generation`). Tokens are chosen by transformers' own logits
        processors for the model's `generation_config` updated with these arguments.

        Args:
            input_ids: `(batch, length)` prompts, left-padded to one length.
            attention_mask: `(batch, length)`, 0 on the padding; None: no padding.
            max_new_tokens, do_sample, temperature, top_k, top_p, num_return_sequences, eos_token_id, pad_token_id:
                as transformers' `generate` takes them (None: the `generation_config`'s).
            generator: the `torch.Generator` sampling draws from; seed: draw micro-batch i's tokens from a
                generator seeded `seed + i`; neither: torch's global generator, as transformers.
            micro_batches: how many micro-batches the batch is cut into (at most one a row); default: one a
                pipeline rank, the fewest that keep every stage working (each more re-reads a stage's weights every
                step: docs/benchmarks/generate.md); 1 relays the whole batch through the stages in turn, as
                `device_map` does.
            prefill_chunks: how many passes along the sequence the prompts go through the stages in, so that the
                stages work at once on them too; default: enough that micro-batches × chunks is four times the
                pipeline ranks, none under 64 positions (`hfsplit.planning.rollout.prefill_chunks_for`); 1 runs
                each micro-batch's prompts in one pass, as transformers does, and so does a model with recurrent
                layers (Gated DeltaNet, Mamba2), which refuses more.
            generation_kwargs: further `GenerationConfig` fields (repetition_penalty, min_new_tokens, ...).

        Returns:
            `(batch × num_return_sequences, length + generated)`: the prompts and their continuations; rows that
            ended before the longest continue with the pad token.
        """
        config = merged_generation_config(
            self.generation_config, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
            top_k=top_k, top_p=top_p, num_return_sequences=num_return_sequences, eos_token_id=eos_token_id,
            pad_token_id=pad_token_id, **generation_kwargs)
        input_ids = input_ids.to(self.device)
        mask = attention_mask.to(self.device) if attention_mask is not None else torch.ones_like(input_ids)
        copies = config.num_return_sequences or 1
        input_ids, mask = input_ids.repeat_interleave(copies, dim=0), mask.repeat_interleave(copies, dim=0)
        groups = min(len(input_ids), micro_batches or self.plan.pp)
        rollouts = rollouts_of(input_ids, mask, micro_batches=groups, config=self.config,
                               stage_indices=self.stage_indices)
        eos, pad = special_tokens(config)
        if generator is None and seed is not None:
            generators = [torch.Generator(self.device).manual_seed(seed + i) for i in range(groups)]
        else:
            generators = [generator] * groups
        limit = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - input_ids.shape[1]
        choice = Choice(processors=logits_processors(self.config, config, prompt=input_ids),
                        sample=bool(config.do_sample), generators=generators, eos=eos.to(self.device), pad=pad,
                        limit=limit)
        run = PipelinedGeneration(stages=dict(zip(self.stage_indices, self.stages)), owner=stage_to_pp_rank(self.plan),
                                  ctx=self.ctx, tokens=self._token_group(), hidden_size=boundary_width(self.config),
                                  dtype=self._dtype(), choice=choice)
        chunks = self._prefill_chunks(prefill_chunks, prompt_length=input_ids.shape[1], micro_batches=groups)
        return joined_sequences(run.run(rollouts, prefill_chunks=chunks), pad=pad)

    def _prefill_chunks(self, asked: Optional[int], *, prompt_length: int, micro_batches: int) -> int:
        """The passes `generate` runs the prompts in: `asked`, else `prefill_chunks_for`'s default; one where a
        stage holds a recurrent mixer, whose state's continuation over a later chunk the proof has not covered."""
        if not self._recurrent_stages():
            return asked or prefill_chunks_for(prompt_length=prompt_length, micro_batches=micro_batches,
                                               pp=self.plan.pp)
        if asked not in (None, 1):
            raise ValueError(f"generate(prefill_chunks={asked}): {self.config.model_type}'s recurrent layers run "
                             "the prompts in one pass here; pass prefill_chunks=1 or leave it unset")
        return 1

    def _recurrent_stages(self) -> bool:
        """Whether any stage of the model holds a recurrent mixer (Gated DeltaNet, Mamba2): every rank's answer
        alike (collective, once)."""
        if self._recurrent is None:
            flag = torch.tensor([int(any(has_recurrent_mixer(s) for s in self.stages))], device=self.device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            self._recurrent = bool(flag.item())
        return self._recurrent

    def save_pretrained(self, save_directory, *, tokenizer=None) -> Path:
        """Write the whole model as a Hugging Face folder (sharded safetensors, index, config, generation config;
        LoRA adapters, if any, folded in), as transformers' `save_pretrained` does on one process. Collective: every
        rank calls it; each stage's rank writes its own shard (`hfsplit.parallel.save`)."""
        return save_split_model(self, save_directory, method="full", tokenizer=tokenizer, base_model=self.source,
                                merge_lora=True)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            raise missing_on_split(self, name) from None

    # --- training ----------------------------------------------------------------------------

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, loss_fn: Callable, *,
             position_ids: Optional[torch.Tensor] = None, num_items_in_batch: Optional[int] = None,
             sync: bool = True, router_mask: Optional[torch.Tensor] = None,
             record: Optional[list] = None) -> Optional[torch.Tensor]:
        """One schedule step (forward + backward over all micro-batches) of this replica's rows.

        Args:
            input_ids, labels: `(batch, seq)`; labels unshifted, -100 where the loss does not count.
            loss_fn: `loss_fn(output, labels, num_items_in_batch=N)`: a micro-batch's summed loss over N, as
                transformers' loss functions take it (`hfsplit.models.loss.causal_lm_loss`).
            position_ids: `(batch, seq)` positions within each example (packed rows); None: one sequence a row.
            num_items_in_batch: N, what the loss is a mean over in the whole step (every micro-batch of every
                data-parallel replica); None: the label tokens of every replica's `labels` (a collective over
                the data-parallel group).
            sync: reduce tied-embedding and data-parallel gradients afterwards; pass False when accumulating
                several steps and call `sync_grads()` once.
            router_mask: `(batch, seq)` bool, the tokens an MoE's router auxiliary loss counts (transformers'
                attention mask; DPO's padded pairs); None: every position.
            record: a list this rank's compute actions of the step are appended to, `(stage, kind, micro_batch,
                start, end)` in perf_counter seconds (`StageTimer`), for a measured timeline; None: none kept.

        Returns:
            On the last stage, this replica's part of the step's loss (the sum of its micro-batch losses: summed
            over replicas by `reduce_loss`, the mean over the N items), else None. Gradients accumulate into
            `.grad` unscaled: they are those of that mean.
        """
        input_ids = input_ids.to(self.device)
        items = num_items_in_batch if num_items_in_batch is not None else self.label_tokens(labels)
        positions = positions_of(input_ids, position_ids)
        if self.join_rows:
            groups = micro_batches_for(batch=input_ids.shape[0], planned=self.plan.micro_batches)
            labels = labels.clone()
            labels[:, 0] = IGNORE_INDEX  # never a target (the shift), nor once joined: the previous row's last token's
            input_ids, labels, positions = (joined_rows(t, groups) for t in (input_ids, labels, positions))
            router_mask = joined_rows(router_mask, groups) if router_mask is not None else None
        schedule = self._schedule(tuple(input_ids.shape), loss_fn=chunked_or(loss_fn, self.stages, plan=self.plan))
        masked = {"router_mask": router_mask.to(self.device)} if router_mask is not None else {}
        losses: list[torch.Tensor] = []
        args = (input_ids,) if self.has_first else ()
        target = labels.to(self.device) if self.has_last else None
        # return_outputs=False: otherwise the last stage keeps every micro-batch's logits until the step ends
        # and concatenates them (vocab-sized, the largest tensors of the step; measured +0.46 GiB on SmolLM2).
        # MoE: the router sums travel with the hidden states (parallel/router.py)
        with head_in_loss(self.stages, enabled=self.plan.spec.chunked_loss), carrying(self.stages), \
                self._timer.recording(record):
            if SCHEDULE_TAKES_LOSS_KWARGS:
                masked["loss_kwargs"] = {"num_items_in_batch": items}
            else:
                self._step_loss_kwargs["num_items_in_batch"] = items
            schedule.step(*args, target=target, losses=losses, return_outputs=False, position_ids=positions,
                          **masked)
        if sync:
            self.sync_grads()
        return torch.stack([loss.detach() for loss in losses]).sum() if self.has_last else None

    def label_tokens(self, labels: torch.Tensor) -> int:
        """The tokens the causal-LM loss counts in `labels` (after the shift), summed over the data-parallel
        replicas (collective): the step's `num_items_in_batch`."""
        count = (labels[..., 1:] != IGNORE_INDEX).sum().to(device=self.device, dtype=torch.int64)
        if self.plan.dp > 1:
            dist.all_reduce(count, group=self.ctx.dp_group)
        return int(count)

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Sum tied-embedding gradients between the first and last stage, and over data-parallel replicas (each
        replica's loss is its part of the global batch's mean)."""
        for p in self.parameters():
            place_grad_like_param(p)
        if self.plan.tied_embeddings:
            self._sum_tied_grads()
        if self.plan.tp > 1:
            for module in self.modules():  # the same order on every TP rank
                if grad_summed_over_tp(module):
                    for p in module.parameters():
                        if p.grad is not None:
                            dist.all_reduce(p.grad, group=self.ctx.tp_mesh.get_group())
        if self.plan.dp > 1:
            for p in self.parameters():
                if p.grad is not None:
                    dist.all_reduce(local_tensor(p.grad), group=self.ctx.dp_group)

    def activation_offload_bytes(self, *, reset: bool = False) -> int:
        """Peak host bytes this rank's offloaded block inputs held since the last `reset=True` (0: no offload)."""
        counters = {id(o.counter): o.counter for s in self.stages if (o := getattr(s, "activation_offload", None))}
        peak = max((c.peak for c in counters.values()), default=0)  # one counter per rank (apply_checkpointing)
        for counter in counters.values() if reset else ():
            counter.reset_peak()
        return peak

    def busy_seconds(self) -> float:
        """Seconds this rank has spent computing inside its pipeline stages so far (waits excluded)."""
        return self._timer.busy_s

    @torch.no_grad()
    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """L2 norm of the gradients of `params` over the whole split model (collective), each counted once.

        TP-sharded parameters contribute their local piece from every TP rank; replicated ones
        (norms) only from TP rank 0; a tied lm_head copy only from the first stage; replicas
        hold equal gradients after summing and are divided out.
        """
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        # A tied lm_head copy holds the same (summed) gradient as the embedding: count the embedding only.
        head = self._head_weight() if self.plan.tied_embeddings else None
        for p in params:
            if p.grad is None or p is head:
                continue
            grad = p.grad
            sharded = shard_layout(grad) is not None or tp_shard_dim(p) is not None
            if sharded or self.ctx.coords.tp == 0:
                total += local_tensor(grad).double().pow(2).sum()
        dist.all_reduce(total)
        return (total / self.plan.dp).sqrt()

    def reduce_loss(self, loss: Optional[torch.Tensor], *, replicas: bool = True) -> float:
        """The last stage's loss on every rank (collective): summed over data-parallel replicas (each holds its
        part of the global batch's mean, `step`), or, with `replicas=False`, the one of replica 0 (every
        replica saw the same rows)."""
        value = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.has_last and self.ctx.coords.tp == 0 and (replicas or self.ctx.coords.dp == 0):
            value += loss.double()
        dist.all_reduce(value)
        return float(value)

    def _sum_tied_grads(self) -> None:
        ends = [p for p in (self._embed_weight(), self._head_weight()) if p is not None and p.grad is not None]
        if len(ends) == 2 and ends[0] is ends[1]:  # one stage holds both ends: one shared matrix
            return
        if self.ctx.tied_group is None:
            if len(ends) == 2:  # both ends on this rank (V schedules): add locally
                total = ends[0].grad + ends[1].grad
                ends[0].grad.copy_(total)
                ends[1].grad.copy_(total)
            return
        for p in ends:
            dist.all_reduce(local_tensor(p.grad), group=self.ctx.tied_group)

    def _embed_weight(self) -> Optional[nn.Parameter]:
        for s in self.stages:
            if s.body.embed_tokens is not None:
                return s.body.embed_tokens.weight
        return None

    def _head_weight(self) -> Optional[nn.Parameter]:
        for s in self.stages:
            if s.lm_head is not None:
                return s.lm_head.weight
        return None

    # --- internals ---------------------------------------------------------------------------

    def _relay_forward(self, input_ids: torch.Tensor, *, caches: Optional[list] = None,
                       position_ids: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Forward through the stages in order, passing hidden states rank to rank (no micro-batches).

        Used for inference when a rank holds several stages (torch's interleaved and V
        schedules contain backward actions and cannot run forward-only) and for generation,
        where `caches` holds one KV cache per stage of this rank.
        """
        owner = stage_to_pp_rank(self.plan)
        mine = dict(zip(self.stage_indices, self.stages))
        cache_of = dict(zip(self.stage_indices, caches or [None] * len(self.stages)))
        hidden_shape = (*input_ids.shape, boundary_width(self.config))
        x = input_ids
        for index in range(self.num_stages):
            if index not in mine:
                continue
            if index > 0 and owner[index - 1] != self.ctx.coords.pp:
                x = torch.empty(hidden_shape, dtype=self._dtype(), device=self.device)
                dist.recv(x, src=self.ctx.global_rank(pp=owner[index - 1]), group=self.ctx.pp_group)
            x = mine[index](x, cache=cache_of[index], position_ids=position_ids)
            if index + 1 < self.num_stages and owner[index + 1] != self.ctx.coords.pp:
                dist.send(x.contiguous(), dst=self.ctx.global_rank(pp=owner[index + 1]), group=self.ctx.pp_group)
        return x if self.has_last else None

    def _token_group(self):
        """The second pipeline group generation sends its tokens on (made once, by every rank's first `generate`)."""
        if self._tokens is None:
            self._tokens = token_group(self.ctx) if self.plan.pp > 1 else self.ctx.pp_group
        return self._tokens

    def _schedule(self, shape: tuple, *, loss_fn: Optional[Callable], name: Optional[str] = None,
                  reduce: Optional[tuple[Callable, int]] = None):
        """A schedule for inputs of `shape` (cached: pipeline buffers are sized per shape); `reduce`: (the
        last stage's reduction of each micro-batch's logits, the rows' sequence length), as `forward` takes it."""
        name = name or self.plan.schedule
        key = (shape, loss_fn, name, reduce)
        if key not in self._schedules:
            micro = micro_batches_for(batch=shape[0], planned=self.plan.micro_batches)
            modules = [ReducedOutput(m, *reduce) if reduce is not None and m.has_head else m for m in self.stages]
            stages = pipeline_stages(modules, indices=self.stage_indices, num_stages=self.num_stages,
                                     device=self.device, group=self.ctx.pp_group)
            # the router term is a mean over the step's forwards, as the mean of per-micro-batch losses had it
            if loss_fn is not None and not SCHEDULE_TAKES_LOSS_KWARGS:
                loss_fn = with_step_kwargs(loss_fn, self._step_loss_kwargs)
            if loss_fn is not None:
                loss_fn = self._timer.with_loss_in_forward(releasing_graph(with_router_loss(
                    loss_fn, self.stages, forwards=micro * self.plan.dp)), device=self.device)
            self._schedules[key] = build_schedule(name, self._timer.watch(stages), micro_batches=micro, loss_fn=loss_fn)
        return self._schedules[key]

    def _broadcast_logits(self, logits: Optional[torch.Tensor], *, shape: tuple) -> torch.Tensor:
        if self.plan.pp == 1:
            return logits
        if logits is None:
            logits = torch.empty(shape, dtype=self._dtype(), device=self.device)
        dist.broadcast(logits, src=self.ctx.global_rank(pp=self.last_pp_rank), group=self.ctx.pp_group)
        return logits

    def _dtype(self) -> torch.dtype:
        # the first floating parameter: a QLoRA stage's first one may be a bitsandbytes uint8 packed weight
        return next((p.dtype for p in self.parameters() if p.is_floating_point()), next(self.parameters()).dtype)


def place_grad_like_param(p: nn.Parameter) -> None:
    """Give a DTensor parameter's gradient the parameter's placement.

    The vocabulary-sharded embedding's gradient comes back Replicate (full size on every
    TP rank); resharding it (a local slice, no communication) makes the tied all-reduce
    and the optimizer see matching shards.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
        p.grad = p.grad.redistribute(placements=p.placements)


def positions_of(input_ids: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """`position_ids` on the ids' device, or, where None, 0, 1, ... for every row (one sequence a row)."""
    if position_ids is not None:
        return position_ids.to(input_ids.device)
    return torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)


def joined_rows(rows: torch.Tensor, groups: int) -> torch.Tensor:
    """`rows` `(batch, seq, ...)` as `groups` rows, each the consecutive rows of one micro-batch joined end to end."""
    return rows.reshape(groups, -1, *rows.shape[2:])


def micro_batches_for(*, batch: int, planned: int) -> int:
    """Micro-batches for a batch of `batch` sequences: the planned count, or its largest divisor of the batch."""
    if batch % planned == 0:
        return planned
    return max(d for d in range(1, min(batch, planned) + 1) if batch % d == 0)


def build_split_model(plan: Plan, name_or_path: str, *, ctx: ParallelContext, config=None,
                      dtype: Optional[torch.dtype] = None, lora: Optional[LoraSetup] = None, lora_seed: int = 0,
                      quantization_config=None) -> SplitModel:
    """This rank's SplitModel: stage modules on meta, the plan applied (`apply_plan`: TP, activation
    checkpointing, only this rank's bytes read — with `quantization_config`, a transformers
    `BitsAndBytesConfig` (a pre-quantized checkpoint's as `hfsplit.load.launch` resolved it), each block quantized
    on its device as it is read —, LoRA); `plan.applied` records the steps."""
    config = config if config is not None else load_config(name_or_path)
    if bool(getattr(config, "tie_word_embeddings", False)) != plan.tied_embeddings:
        raise PlanError(
            f"{name_or_path}: config tie_word_embeddings={config.tie_word_embeddings} but the plan says "
            f"tied_embeddings={plan.tied_embeddings}; re-plan for this checkpoint"
        )
    if why := tp_degree_error(config, plan.tp):  # a plan made by hand or for another config
        raise PlanError(f"{name_or_path}: {why}")
    dtype = dtype or getattr(torch, plan.spec.dtype)
    indices = stage_indices_of_pp_rank(plan, pp_rank=ctx.coords.pp)
    by_index = {s.index: s for s in plan.stages}
    modules = [build_stage_module(config=config, stage=by_index[index], tied=plan.tied_embeddings) for index in indices]

    load = functools.partial(load_stages, source=name_or_path, config=config, device=ctx.device, dtype=dtype,
                             tp_rank=ctx.coords.tp, tp_size=plan.tp, quantization_config=quantization_config,
                             experts=plan.spec.quantize_experts)
    applied = apply_plan(modules, plan=plan, ctx=ctx, load=load, lora=lora, lora_seed=lora_seed)
    model = SplitModel(plan=replace(plan, applied=applied), config=config, ctx=ctx, stages=modules,
                       stage_indices=indices)
    model.generation_config = generation_config_for(config, name_or_path)
    model.source = name_or_path
    model.hf_device_map = split_device_map(plan, body=modules[0].body_name, ctx=ctx)  # collective
    return model


def split_device_map(plan: Plan, *, body: str, ctx: ParallelContext) -> dict[str, str]:
    """`hf_device_map` of the split: every stage's modules (checkpoint prefixes, as transformers names them) →
    "rank:device" of the ranks holding them in this rank's replica (several, comma-joined, under TP). Collective:
    the ranks' devices are gathered."""
    devices = [None] * dist.get_world_size()
    dist.all_gather_object(devices, str(ctx.device))
    owner = stage_to_pp_rank(plan)
    out = {}
    for stage in plan.stages:
        ranks = [(ctx.coords.dp * plan.pp + owner[stage.index]) * plan.tp + tp for tp in range(plan.tp)]
        where = ",".join(f"{rank}:{devices[rank]}" for rank in ranks)
        names = [f"{body}.embed_tokens"] * stage.has_embed + [f"{body}.layers.{i}" for i in range(*stage.layers)]
        out.update({name: where for name in names + [f"{body}.norm", "lm_head"] * stage.has_head})
    return out


# transformers attributes of the whole model that a rank's part cannot stand for, and why
WHOLE_MODEL = {
    ("model", "lm_head", "base_model", "get_input_embeddings", "get_output_embeddings", "get_decoder",
     "set_input_embeddings", "set_output_embeddings", "resize_token_embeddings", "tie_weights"):
        "the model's modules are spread over the ranks (`hf_device_map`): this rank holds only its stages' "
        "modules, as `.stages`",
    ("gradient_checkpointing_enable", "gradient_checkpointing_disable", "is_gradient_checkpointing"):
        "the plan decides activation checkpointing per stage: pass activation_checkpointing= to "
        "hfsplit.from_pretrained (the recipe: --activation-checkpointing)",
}


def missing_on_split(model: SplitModel, name: str) -> AttributeError:
    """The error for an attribute `model` lacks: a `SplitAttributeError` saying why where transformers' models
    have it, else the plain AttributeError."""
    why = next((reason for names, reason in WHOLE_MODEL.items() if name in names), None)
    if why is None and not hasattr(PreTrainedModel, name):
        return AttributeError(f"'{type(model).__name__}' object has no attribute '{name}'")
    held = model.__dict__.get("stage_indices")
    why = why or ("it acts on the whole model in one process, and under a launch each rank holds only its "
                  "stages and runs them as a pipeline with the other ranks")
    return SplitAttributeError(
        f"{name}: not available on a model split over ranks (this rank holds stage(s) {held}): {why}. "
        "The split model has config, generation_config, hf_device_map, hfsplit_plan, forward, generate and "
        "save_pretrained")

