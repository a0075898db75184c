"""The fine-tuning loop over a split model: one readable loop, top to bottom.

Every rank runs this same loop (SPMD). Each step: the pipeline schedule runs forward
and backward over the micro-batches, gradients are clipped by their global norm across
pipeline and tensor groups, each rank's optimizer steps over its own parameters.
"""
from __future__ import annotations

import datetime
import functools
import json
import math
import os
import re
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import HfsplitError, NonFiniteError, PeerLostError
from .options import FinetuneOptions

TINY_MODEL = dict(arch="llama", num_layers=4, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=256,
                  max_positions=1024)


@dataclass
class TrainResult:
    """What a run reports at the end (on every rank)."""

    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    bubble_measured: float = 0.0
    bubble_theory: float = 0.0
    skipped_steps: list[int] = field(default_factory=list)
    peak_memory_bytes: list[int] = field(default_factory=list)
    saved_to: str = ""
    eval_losses: list[float] = field(default_factory=list)


def causal_lm_loss(vocab_size: int):
    """transformers' own causal-LM loss (shift, ignore -100, mean over a micro-batch's tokens)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return ForCausalLMLoss(logits, labels, vocab_size)

    return loss_fn


def default_model_path(output_dir: str) -> str:
    """The built-in tiny model, written once next to the run's output (rank 0 writes, others wait)."""
    from ..checkpoint.synthetic import write_tiny_checkpoint

    folder = Path(output_dir).parent / "tiny-llama"
    if (not dist.is_initialized() or dist.get_rank() == 0) and not (folder / "config.json").is_file():
        spec = dict(TINY_MODEL)
        arch = spec.pop("arch")
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        write_tiny_checkpoint(tmp, arch, sharded=True, **spec)
        os.replace(tmp, folder)
    if dist.is_initialized():
        dist.barrier()
    return str(folder)


def default_max_memory(world_size: int) -> str:
    """An equal share of what this host's devices have free, one budget per rank."""
    from ..budget import local_max_memory

    free = local_max_memory()
    # CPU ranks of this host share its memory (ranks on other hosts have their own).
    sharing = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if "cpu" in free else 1
    return f"{world_size}x{min(free.values()) // sharing}B"


def check_sequence_length(model_path: str, seq_len: int) -> None:
    """A clear error, before any weight is read, for sequences longer than the model's positions."""
    from ..checkpoint import load_config

    limit = getattr(load_config(model_path), "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        raise HfsplitError(f"--seq-len {seq_len} is beyond {model_path}'s {limit} positions "
                           f"(max_position_embeddings); use --seq-len {limit} or less")


def weights_dtype(method: str, dtype: str) -> torch.dtype:
    """Dtype the weights are held in: full fine-tuning in 16 bits keeps fp32 weights (the master copy,
    AMP-style) and computes under autocast; LoRA keeps the frozen base in 16 bits (peft keeps adapters fp32)."""
    if method == "full" and dtype in ("bfloat16", "float16"):  # (QLoRA: base and compute in `dtype`)
        return torch.float32
    return getattr(torch, dtype)


def compute_precision(model):
    """Autocast to the plan's 16-bit dtype where the weights are fp32 masters; a no-op otherwise."""
    import contextlib

    wanted = getattr(torch, model.plan.spec.dtype)
    held = next(p.dtype for p in model.parameters())
    if wanted in (torch.bfloat16, torch.float16) and held == torch.float32 and model.plan.spec.method == "full":
        return torch.autocast(device_type=model.device.type, dtype=wanted)
    return contextlib.nullcontext()


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: the accelerator's allocator peak, else the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class StageTimer:
    """Seconds this rank spends computing inside the pipeline stages (forward and backward chunks)."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self._wrapped: set[int] = set()

    def watch(self, schedule) -> None:
        stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage")]
        for stage in stages:
            if id(stage) in self._wrapped:
                continue
            self._wrapped.add(id(stage))
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy_s += time.perf_counter() - start

        return run


def global_grad_norm(model, params: list[torch.nn.Parameter]) -> torch.Tensor:
    """L2 norm of all gradients of the split model, each parameter counted once.

    TP-sharded parameters contribute their local piece from every TP rank; replicated ones
    (norms) only from TP rank 0; a tied lm_head copy only from the first stage; replicas
    hold equal gradients after averaging and are divided out.
    """
    from torch.distributed.tensor import DTensor, Shard

    from .lora import tp_shard_dim

    plan, coords = model.plan, model.ctx.coords
    total = torch.zeros((), dtype=torch.float64, device=model.device)
    # A tied lm_head copy holds the same (summed) gradient as the embedding: count the embedding only.
    head = model._head_weight() if plan.tied_embeddings else None
    for p in params:
        if p.grad is None or p is head:
            continue
        grad = p.grad
        sharded = (isinstance(grad, DTensor) and any(isinstance(x, Shard) for x in grad.placements)) or \
            tp_shard_dim(p) is not None
        if isinstance(grad, DTensor):
            grad = grad.to_local()
        if sharded or coords.tp == 0:
            total += grad.double().pow(2).sum()
    dist.all_reduce(total)
    return (total / plan.dp).sqrt()


def clip_(params: list[torch.nn.Parameter], *, norm: torch.Tensor, max_norm: float) -> None:
    if max_norm and max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(float(scale))


def train(options: FinetuneOptions, *, model=None, rows=None, progress: bool = True) -> TrainResult:
    """Run the fine-tune `options` describe on this rank; return the run's figures.

    Args:
        options: the recipe options.
        model: a ready SplitModel (tests); built from `options` otherwise.
        rows: ready TokenRows (tests); loaded from `options.dataset` otherwise.
        progress: show the progress bar on the rank that holds the loss.
    """
    from tqdm.auto import tqdm
    from transformers import get_cosine_schedule_with_warmup

    from ..parallel.mesh import init_single_process_group
    from ..parallel.split_model import split_from_pretrained
    from .data import MicroBatches, bundled_dataset_path, load_token_rows
    from .lora import add_lora, lora_config
    from .resume import checkpoint_to_resume, prune_checkpoints, read_trainer_state, write_trainer_state
    from .save import save_split_model, writable_dir

    from accelerate import PartialState

    # accelerate owns the launch: it joins the process group (gloo on CPU ranks, nccl on GPUs). The
    # timeout bounds every wait on a peer, so a dead or hung rank ends the run instead of hanging it.
    PartialState(cpu=not torch.cuda.is_available(), timeout=datetime.timedelta(seconds=options.peer_timeout))
    if not dist.is_initialized():  # started without a launcher: one rank
        init_single_process_group(timeout_s=options.peer_timeout)
    writable_dir(options.output_dir)  # fail before any weight is read
    torch.manual_seed(options.seed)
    resume_from = checkpoint_to_resume(options.resume, options.output_dir) if options.resume else None
    model_path = options.model
    if model is None:
        model_path = options.model or default_model_path(options.output_dir)
        plan = plan_of_run(options, model_path=model_path)
    tokenizer = None
    if rows is None:  # data problems surface before any weight is read
        tokenizer = tokenizer_for(options, model_path=model_path)
        source = options.dataset or str(bundled_dataset_path("tiny_alpaca.jsonl"))
        rows = load_token_rows(source, tokenizer, seq_len=options.seq_len, format=options.dataset_format)
    if model is None:
        model = split_from_pretrained(model_path, plan=plan, dtype=weights_dtype(options.method, plan.spec.dtype),
                                      quantization_config=qlora_config_of_run(options, plan))
    plan = model.plan
    holds_loss = model.has_last and model.ctx.coords.tp == 0 and model.ctx.coords.dp == 0
    if dist.get_rank() == 0:
        print(plan.table(), flush=True)
    config = None
    if options.method in ("lora", "qlora"):
        config = lora_config(r=options.lora_r, alpha=options.lora_alpha, dropout=options.lora_dropout,
                             targets=options.lora_targets, model_config=model.config)
        tp_group = model.ctx.tp_mesh.get_group() if plan.tp > 1 else None
        for stage in model.stages:
            add_lora(stage, config, seed=options.seed, tp_group=tp_group, tp_rank=model.ctx.coords.tp,
                     tp_size=plan.tp, tp_plan=getattr(model.config, "base_model_tp_plan", None))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=options.learning_rate, weight_decay=options.weight_decay)

    m, dp = plan.micro_batches, plan.dp
    rows, held_out = split_eval_rows(rows, options)
    batches = MicroBatches(rows, micro_batch_size=options.micro_batch_size, num_micro_batches=m * dp,
                           seed=options.seed)
    total_steps = total_steps_of(options, rows=len(rows), rows_per_step=m * dp * options.micro_batch_size)
    scheduler = get_cosine_schedule_with_warmup(optimizer, options.warmup_steps, total_steps)
    loss_fn = causal_lm_loss(model.config.vocab_size)
    metrics = _MetricsLog(options.output_dir, enabled=dist.get_rank() == 0, append=bool(options.resume))
    timer = StageTimer()
    result = TrainResult(bubble_theory=plan.bubble_fraction)
    per_replica = m * options.micro_batch_size
    first = 1
    if resume_from is not None:
        folder = resume_from
        reading = time.perf_counter()
        first = read_trainer_state(folder, model=model, params=params, optimizer=optimizer, scheduler=scheduler,
                                   batches=batches) + 1
        metrics.write({"step": first - 1, "resumed_from": str(folder), "resume_s": time.perf_counter() - reading})
        if dist.get_rank() == 0:
            print(f"resumed from {folder} at step {first - 1}", flush=True)
    bar = tqdm(total=total_steps, initial=first - 1, disable=not (progress and holds_loss), desc="fine-tune", dynamic_ncols=True)
    busy_total = wall_total = 0.0
    step = first - 1
    try:
        for step in range(first, total_steps + 1):
            batch = next(batches)
            mine = slice(model.ctx.coords.dp * per_replica, (model.ctx.coords.dp + 1) * per_replica)
            busy_before = timer.busy_s
            start = time.perf_counter()
            with compute_precision(model):
                loss = model.step(batch["input_ids"][mine], batch["labels"][mine], loss_fn)
            for schedule in model._schedules.values():
                timer.watch(schedule)
            loss = _shared_loss(model, loss)
            norm = global_grad_norm(model, params)
            if not (math.isfinite(loss) and math.isfinite(float(norm))):
                metrics.write({"step": step, "skipped": True, "loss": loss, "grad_norm": float(norm)})
                if options.on_nonfinite == "stop":
                    raise NonFiniteError(
                        f"step {step}: loss {loss} / gradient norm {float(norm)} is not finite; the weights are "
                        f"those of step {step - 1}. Lower --learning-rate or --max-grad-norm, check the data, "
                        "or pass --on-nonfinite skip to drop such steps")
                result.skipped_steps.append(step)
                optimizer.zero_grad(set_to_none=True)
                if holds_loss:
                    bar.write(f"step {step}: non-finite loss {loss} / gradient norm {float(norm)}; step skipped")
                continue
            clip_(params, norm=norm, max_norm=options.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - start
            if step > first:  # the first step builds the schedule and warms up
                busy_total += timer.busy_s - busy_before
                wall_total += elapsed
            result.losses.append(loss)
            result.step_times_s.append(elapsed)
            tokens = per_replica * dp * options.seq_len
            peaks = _gather_ints(peak_memory_bytes(model.device))
            record = {"step": step, "loss": loss, "lr": scheduler.get_last_lr()[0], "grad_norm": float(norm),
                      "tokens_per_s": tokens / elapsed, "peak_memory_bytes": peaks}
            metrics.write(record)
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{record['lr']:.2e}", tok_s=f"{tokens / elapsed:.0f}",
                            peak_mib="/".join(str(p >> 20) for p in peaks))
            bar.update(1)
            result.peak_memory_bytes = peaks
            if options.eval_every and step % options.eval_every == 0:
                record["eval_loss"] = eval_loss(model, held_out, loss_fn, micro_batch_size=options.micro_batch_size)
                if holds_loss:
                    bar.write(f"step {step}: eval loss {record['eval_loss']:.4f}")
                metrics.write({"step": step, "eval_loss": record["eval_loss"]})
                result.eval_losses.append(record["eval_loss"])
            if options.save_every and step % options.save_every == 0 and step < total_steps:
                state = functools.partial(write_trainer_state, model=model, params=params, optimizer=optimizer,
                                          scheduler=scheduler, batches=batches, step=step)
                saving = time.perf_counter()
                folder = save_split_model(model, Path(options.output_dir) / f"checkpoint-{step}",
                                          method=saved_method(options.method), lora_config=config, tokenizer=tokenizer,
                                          base_model=model_path, extra=state)
                metrics.write({"step": step, "checkpoint": str(folder), "save_s": time.perf_counter() - saving,
                               "removed": [str(p) for p in prune_checkpoints(options.output_dir,
                                                                              keep=options.save_total_limit)]})
        bar.close()
        final = Path(options.output_dir) / ("adapter" if options.method != "full" else "model")
        save_split_model(model, final, method=saved_method(options.method), lora_config=config, tokenizer=tokenizer,
                         base_model=model_path)
        result.saved_to = str(final)
        if options.merge:
            save_split_model(model, Path(options.output_dir) / "merged", method="full", tokenizer=tokenizer,
                             base_model=model_path, merge_lora=True)
        busy = _gather_floats(busy_total)
        result.bubble_measured = 1 - (sum(busy) / len(busy)) / wall_total if wall_total else 0.0
        timed = result.step_times_s[1:] or result.step_times_s
        result.tokens_per_s = per_replica * dp * options.seq_len / (sum(timed) / len(timed)) if timed else 0.0
        metrics.close()
        # Leave together: a rank tearing down gloo while a peer still talks to it can abort the peer.
        dist.barrier()
    except RuntimeError as exc:  # torch.distributed errors (gloo, nccl, timeouts) are RuntimeErrors
        if not is_peer_failure(exc):
            raise
        raise peer_lost_error(exc, step=step, output_dir=options.output_dir) from None
    if dist.get_rank() == 0:
        print(f"done: {len(result.losses)} steps, final loss {result.losses[-1] if result.losses else float('nan'):.4f}, "
              f"{result.tokens_per_s:.0f} tokens/s, bubble measured {100 * result.bubble_measured:.1f}% "
              f"(theory {100 * result.bubble_theory:.1f}%), skipped steps {result.skipped_steps or 'none'}", flush=True)
    return result


def is_peer_failure(exc: BaseException) -> bool:
    """Whether `exc` says another rank is gone or silent (as opposed to a bug on this rank)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()  # gloo reports a vanished peer as a plain RuntimeError
    return any(sign in text for sign in ("connection closed", "connection reset", "broken pipe", "timed out"))


def peer_lost_error(exc: BaseException, *, step: int, output_dir: str) -> PeerLostError:
    """The one-line error a surviving rank ends with, pointing at what is left to resume from."""
    from .resume import latest_checkpoint

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    reason = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0]  # drop the "[gloo/.../pair.cc:537]" prefix
    last = latest_checkpoint(output_dir)
    resume = f"The last complete checkpoint is {last}; resume with --resume latest" if last else \
        "No checkpoint was saved yet (use --save-every N)"
    return PeerLostError(f"rank {dist.get_rank()} lost contact with another rank during step {step} ({reason[:160]}): "
                         f"a rank died or hung (--peer-timeout bounds the wait). {resume}")


def plan_of_run(options: FinetuneOptions, *, model_path: str):
    """The run's Plan, made on rank 0 and shared with every rank, before any weight is read."""
    from ..costs import TrainingSpec
    from ..parallel.split_model import shared_plan

    check_sequence_length(model_path, options.seq_len)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dtype = options.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    spec = TrainingSpec(method=options.method, seq_len=options.seq_len, micro_batch_size=options.micro_batch_size,
                        dtype=dtype, lora_r=options.lora_r,
                        lora_targets=tuple(options.lora_targets) if options.lora_targets else None,
                        activation_checkpointing=options.activation_checkpointing, reserve_bytes=0,
                        bnb_4bit_quant_type=options.bnb_4bit_quant_type,
                        bnb_4bit_use_double_quant=options.bnb_4bit_use_double_quant, load_in_8bit=options.load_in_8bit)
    # The built-in default demonstrates the pipeline: one stage per rank unless told otherwise.
    pp = options.pp or (world if options.model is None and options.tp is None else None)
    return shared_plan(model_path, options.max_memory or default_max_memory(world), spec=spec,
                       micro_batches=options.micro_batches, schedule=options.schedule, tp=options.tp, pp=pp,
                       world_size=world, activation_checkpointing=options.activation_checkpointing)


def saved_method(method: str) -> str:
    """What the output folder holds: QLoRA writes the same peft adapter folder as LoRA."""
    return "lora" if method == "qlora" else method


def qlora_config_of_run(options: FinetuneOptions, plan):
    """The run's `BitsAndBytesConfig` (None unless --method qlora), refused in one line before any weight is
    read where bitsandbytes cannot serve it on this rank's device."""
    if options.method != "qlora":
        return None
    from ..parallel.mesh import device_of_rank
    from ..quantize import check_quantization, quantization_config

    qconfig = quantization_config(load_in_8bit=options.load_in_8bit, quant_type=options.bnb_4bit_quant_type,
                                  double_quant=options.bnb_4bit_use_double_quant, compute_dtype=plan.spec.dtype)
    check_quantization(qconfig, device=device_of_rank(local_rank=int(os.environ.get("LOCAL_RANK", "0"))))
    return qconfig


def tokenizer_for(options: FinetuneOptions, *, model_path: Optional[str]):
    """The tokenizer named by --tokenizer, else the model's own, else hfsplit's tiny one."""
    from .data import tiny_tokenizer

    name = options.tokenizer or model_path
    if name is None:
        return tiny_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise HfsplitError(f"{name}: no tokenizer found ({exc}); pass --tokenizer NAME_OR_FOLDER") from exc


def total_steps_of(options: FinetuneOptions, *, rows: int, rows_per_step: int) -> int:
    """Optimizer steps: `max_steps`, or `epochs` passes over the rows when given."""
    if not options.epochs:
        return options.max_steps
    per_epoch = rows // rows_per_step
    if per_epoch < 1:
        raise HfsplitError(f"the dataset has {rows} rows, fewer than one step needs ({rows_per_step}); "
                           "lower --micro-batches or --micro-batch-size, or add data")
    return options.epochs * per_epoch


def split_eval_rows(rows, options: FinetuneOptions):
    """(training rows, held-out rows): with `eval_every`, 5% (at least one micro-batch) is held out."""
    from .data import TokenRows

    if not options.eval_every:
        return rows, None
    count = max(options.micro_batch_size * options.micro_batches, len(rows) // 20)
    if count >= len(rows):
        raise HfsplitError(f"the dataset has {len(rows)} rows: too few to hold out {count} for --eval-every")
    train = TokenRows(rows.input_ids[count:], rows.labels[count:])
    return train, TokenRows(rows.input_ids[:count], rows.labels[:count])


@torch.no_grad()
def eval_loss(model, rows, loss_fn, *, micro_batch_size: int) -> float:
    """Mean loss over the held-out rows (forward only through the pipeline), on every rank."""
    losses = []
    size = micro_batch_size * model.plan.micro_batches  # the training step's shape: same micro-batch count
    for start in range(0, len(rows) - size + 1, size):
        with compute_precision(model):
            logits = model.forward(rows.input_ids[start:start + size])
        loss = loss_fn(logits, rows.labels[start:start + size].to(logits.device)) if logits is not None else None
        losses.append(_shared_loss(model, loss, replicas=False))
    return sum(losses) / len(losses)


def _shared_loss(model, loss: Optional[torch.Tensor], *, replicas: bool = True) -> float:
    """The loss on every rank: from the last stage, averaged over data-parallel replicas."""
    value = torch.zeros((), dtype=torch.float64, device=model.device)
    counted = model.has_last and model.ctx.coords.tp == 0 and (replicas or model.ctx.coords.dp == 0)
    if counted:
        value += loss.double()
    dist.all_reduce(value)
    return float(value) / (model.plan.dp if replicas else 1)


def _gather_ints(value: int) -> list[int]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, int(value))
    return out


def _gather_floats(value: float) -> list[float]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, float(value))
    return out


class _MetricsLog:
    """Metrics to `metrics.jsonl` and accelerate's TensorBoard tracker, from rank 0."""

    def __init__(self, output_dir: str, *, enabled: bool, append: bool = False) -> None:
        self.enabled = enabled
        self.file = None
        self.writer = None
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.file = open(out / "metrics.jsonl", "a" if append else "w")
        try:
            from accelerate.tracking import TensorBoardTracker

            self.writer = TensorBoardTracker("hfsplit", str(out / "tensorboard"))
            self.writer.start()
        except Exception:  # tensorboard missing: the JSONL file still has everything
            self.writer = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            self.writer.log(scalars, step=record["step"])

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.writer is not None:
            self.writer.finish()
