"""The fine-tuning loop over a split model: one readable loop, top to bottom.

Every rank runs this same loop (SPMD). Each step: the pipeline schedule runs forward
and backward over the micro-batches, gradients are clipped by their global norm across
pipeline and tensor groups, each rank's optimizer steps over its own parameters.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..errors import HfsplitError, NonFiniteError, PeerLostError
from .checkpointer import Checkpointer, TrainState
from .metrics import Metrics, StepOutcome, TrainResult, summary_line
from .options import FinetuneOptions, training_spec, with_plan_batch

__all__ = ["Run", "TrainResult", "build_run", "train", "train_step"]

TINY_MODEL = dict(arch="llama", num_layers=4, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=256,
                  max_positions=1024)


def causal_lm_loss(vocab_size: int):
    """transformers' own causal-LM loss (shift, ignore -100, mean over a micro-batch's tokens)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return ForCausalLMLoss(logits, labels, vocab_size)

    loss_fn.causal_lm = True  # a chunked_loss plan may compute it chunk by chunk (parallel/chunked_loss.py)
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
    from ..budget import local_share

    # CPU ranks of this host share its memory (ranks on other hosts have their own).
    return local_share(world_size, ranks_here=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))


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


def clip_(params: list[torch.nn.Parameter], *, norm: torch.Tensor, max_norm: float) -> None:
    if max_norm and max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(float(scale))


@dataclass
class Run:
    """Everything one fine-tuning run works with, built by `build_run` (the same fields on every rank)."""

    options: FinetuneOptions
    model: object  # SplitModel
    model_path: str
    tokenizer: object
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: object
    batches: object  # MicroBatches over the training rows
    held_out: object  # TokenRows for --eval-every, else None
    loss_fn: Callable
    total_steps: int
    metrics: Metrics
    checkpointer: Checkpointer
    lora_config: object = None
    first_step: int = 1
    calibration_spec: object = None  # the TrainingSpec the plan's FLOP/s was measured with

    @property
    def rows_per_replica(self) -> int:
        """Rows of one optimizer step that this rank's data-parallel replica trains on."""
        return self.model.plan.micro_batches * self.options.micro_batch_size


def train(options: FinetuneOptions, *, progress: bool = True) -> TrainResult:
    """Run the fine-tune `options` describe on this rank; return the run's figures.

    Args:
        options: the recipe options.
        progress: show the progress bar on the rank that holds the loss.
    """
    return fit(build_run(options, progress=progress))


def fit(run: Run) -> TrainResult:
    """The loop over a built run (`build_run`): steps, evaluation, checkpoints, the final save; the figures."""
    from .elastic import StopAtBoundary, stop_for_regroup
    from .memory import out_of_memory_is_one_line

    options = run.options
    stopper = StopAtBoundary()  # torchrun regrouping the ranks: checkpoint at the step's end, then leave
    step = run.first_step - 1
    try:
        for step in range(run.first_step, run.total_steps + 1):
            with out_of_memory_is_one_line(run.model, step=step):
                outcome = train_step(run, next(run.batches))
            if not outcome.finite:
                skip_or_stop(run, step, outcome)
                continue
            run.metrics.stepped(step, outcome, lr=run.scheduler.get_last_lr()[0], device=run.model.device)
            if options.eval_every and step % options.eval_every == 0:
                run.metrics.evaluated(step, eval_loss(run.model, run.held_out, run.loss_fn,
                                                      micro_batch_size=options.micro_batch_size))
            stop = step < run.total_steps and stopper.now()
            folder = run.checkpointer.after_step(step, total_steps=run.total_steps, force=stop)
            if stop:
                stop_for_regroup(stopper, run.metrics.log, step=step, checkpoint=folder)
        run.metrics.close_bar()
        saved = run.checkpointer.final()
        result = run.metrics.finish()
        result.saved_to = str(saved)
        # Leave together: a rank tearing down gloo while a peer still talks to it can abort the peer.
        dist.barrier()
    except RuntimeError as exc:  # torch.distributed errors (gloo, nccl, timeouts) are RuntimeErrors
        if not is_peer_failure(exc):
            raise
        raise peer_lost_error(exc, step=step, output_dir=options.output_dir) from None
    finally:
        run.metrics.close_bar()  # an error then prints on a line of its own, not after the bar
    if dist.get_rank() == 0:
        from ..calibrate import time_report

        print(time_report(run.model.plan, result.step_times_s, result.busy_s_per_rank), flush=True)
        recheck_calibration(run, result)
        print(summary_line(result), flush=True)
    return result


def recheck_calibration(run: Run, result: TrainResult) -> None:
    """Rank 0, which planned: a cached FLOP/s this run's busy time contradicts is replaced by the run's rate."""
    from ..calibrate import recheck_speed
    from ..checkpoint import load_config

    line = recheck_speed(run.model.plan, load_config(run.model_path), run.model.device,
                         step_times_s=result.step_times_s, busy_s=result.busy_s_per_rank, spec=run.calibration_spec)
    if line:
        print(line, flush=True)


def train_step(run: Run, batch: dict) -> StepOutcome:
    """One optimizer step over `batch` (the global batch; this replica takes its rows): forward and
    backward through the pipeline, global-norm clipping, AdamW and the schedule. A step whose loss or
    gradient norm is not finite changes no weight (its gradients are dropped)."""
    model = run.model
    mine = slice(model.ctx.coords.dp * run.rows_per_replica, (model.ctx.coords.dp + 1) * run.rows_per_replica)
    busy = model.busy_seconds()
    start = time.perf_counter()
    with compute_precision(model):
        loss = model.step(batch["input_ids"][mine], batch["labels"][mine], run.loss_fn)
    loss = model.reduce_loss(loss)
    norm = model.grad_norm(run.params)
    outcome = StepOutcome(loss=loss, grad_norm=float(norm), seconds=0.0, busy_s=0.0)
    if outcome.finite:
        clip_(run.params, norm=norm, max_norm=run.options.max_grad_norm)
        run.optimizer.step()
        run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    outcome.seconds = time.perf_counter() - start
    outcome.busy_s = model.busy_seconds() - busy
    return outcome


def skip_or_stop(run: Run, step: int, outcome: StepOutcome) -> None:
    """--on-nonfinite: log the non-finite step, then end the run (stop) or go on without it (skip)."""
    run.metrics.nonfinite(step, outcome)
    if run.options.on_nonfinite == "stop":
        raise NonFiniteError(
            f"step {step}: loss {outcome.loss} / gradient norm {outcome.grad_norm} is not finite; the weights are "
            f"those of step {step - 1}. Lower --learning-rate or --max-grad-norm, check the data, "
            "or pass --on-nonfinite skip to drop such steps")
    run.metrics.skipped(step, outcome)


def build_run(options: FinetuneOptions, *, progress: bool = True) -> Run:
    """Join the launch, plan, read the data, load this rank's part of the model, add adapters, and set up
    optimizer, schedule, metrics and checkpoints; resume when asked. Every input problem surfaces
    before any weight is read."""
    from ..parallel.apply import LoraSetup
    from ..parallel.launch import split_from_pretrained
    from .elastic import settle_growth

    started = time.time()
    model_path, launch = prepare(options)
    # A resumed elastic run keeps its global batch: the planner sets micro-batches for the dp it finds now.
    plan = plan_of_run(options, model_path=model_path, global_batch=launch.rows_per_step)
    plan = settle_growth(launch, plan, replan=lambda: plan_of_run(options, model_path=model_path,
                                                                  global_batch=launch.rows_per_step),
                         timeout_s=options.peer_timeout)  # a larger layout runs only when estimated faster
    tokenizer, rows = load_rows(options, model_path=model_path)
    config = lora_of_run(options, model_path=model_path)
    model = split_from_pretrained(model_path, plan=plan, dtype=weights_dtype(options.method, plan.spec.dtype),
                                  lora=LoraSetup(config, seed=options.seed) if config is not None else None,
                                  quantization_config=qlora_config_of_run(options, plan, model_path=model_path))
    plan = model.plan
    calibrated = training_spec(options)  # the shape its FLOP/s was probed at, which the run re-checks
    options = with_plan_batch(options, plan)  # the cut --global-batch left to the planner, if it did
    if dist.get_rank() == 0:
        print(plan.table(), flush=True)  # its last lines say what the run applied to each stage
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=options.learning_rate, weight_decay=options.weight_decay)
    run = Run(options=options, model=model, model_path=model_path, tokenizer=tokenizer, params=params,
              optimizer=optimizer, lora_config=config, loss_fn=causal_lm_loss(model.config.vocab_size),
              calibration_spec=calibrated, **data_of_run(options, rows, plan=plan, optimizer=optimizer))
    holds_loss = model.has_last and model.ctx.coords.tp == 0 and model.ctx.coords.dp == 0
    run.metrics = Metrics(options.output_dir, total_steps=run.total_steps, bubble_theory=plan.bubble_fraction,
                          tokens_per_step=run.rows_per_replica * plan.dp * options.seq_len,
                          holds_loss=holds_loss, progress=progress, append=launch.append)
    run.checkpointer = Checkpointer(
        model=model, state=TrainState(params=params, optimizer=optimizer, scheduler=run.scheduler,
                                      batches=run.batches),
        output_dir=options.output_dir, method=saved_method(options.method), base_model=model_path, lora_config=config,
        tokenizer=tokenizer, save_every=options.save_every, keep=options.save_total_limit, merge=options.merge,
        metrics=run.metrics)
    run.first_step = run.checkpointer.resume(launch.resume_from)
    log_launch(run, launch, started=started)
    run.metrics.begin(run.first_step)
    return run


def log_launch(run: Run, launch, *, started: float) -> None:
    """Check the kept global batch and log this launch's plan, and the restart it is, if any."""
    from . import elastic

    plan, options = run.model.plan, run.options
    elastic.check_global_batch(plan, rows_then=launch.rows_per_step, micro_batch_size=options.micro_batch_size)
    nodes = elastic.nodes_of_ranks()
    restarted = elastic.restart_record(launch, plan, step=run.first_step - 1, started=started, nodes=nodes)
    if restarted:
        run.metrics.log.write(restarted)
        if dist.get_rank() == 0:
            print(elastic.describe(restarted), flush=True)
    if launch.growth:
        run.metrics.log.write({**launch.growth, "step": run.first_step - 1})
        if dist.get_rank() == 0 and launch.growth["faster"]:  # the other verdict was printed before the regroup
            print(elastic.describe_growth(launch.growth), flush=True)
    run.metrics.log.write(elastic.plan_record(plan, step=run.first_step - 1, micro_batch_size=options.micro_batch_size,
                                              seq_len=options.seq_len, nodes=nodes))


def prepare(options: FinetuneOptions):
    """(the model's path, this launch's `LaunchState`), once the process group is joined and the output
    folder is checked: what to resume from (after a torchrun restart: the latest checkpoint)."""
    from ..parallel.mesh import init_distributed
    from .elastic import LaunchState
    from .save import writable_dir

    init_distributed(timeout_s=options.peer_timeout)
    writable_dir(options.output_dir)
    torch.manual_seed(options.seed)
    launch = LaunchState.decide(options.resume, options.output_dir)  # a missing checkpoint fails here
    return options.model or default_model_path(options.output_dir), launch


def load_rows(options: FinetuneOptions, *, model_path: str):
    """(tokenizer, token rows) of the run's dataset (the bundled tiny alpaca set by default)."""
    from .data import bundled_dataset_path, load_token_rows

    tokenizer = tokenizer_for(options, model_path=model_path)
    source = options.dataset or str(bundled_dataset_path("tiny_alpaca.jsonl"))
    return tokenizer, load_token_rows(source, tokenizer, seq_len=options.seq_len, format=options.dataset_format)


def lora_of_run(options: FinetuneOptions, *, model_path: str):
    """The run's peft LoraConfig (None unless --method lora or qlora): `apply_plan` adds it after TP, so the
    adapters follow the base layers' sharding."""
    from ..checkpoint import load_config
    from .lora import lora_config

    if options.method not in ("lora", "qlora"):
        return None
    config = lora_config(r=options.lora_r, alpha=options.lora_alpha, dropout=options.lora_dropout,
                         targets=options.lora_targets, model_config=load_config(model_path))
    if options.merge and config.target_parameters:
        raise HfsplitError(f"--merge folds adapters of linear layers; LoRA on fused experts "
                           f"({', '.join(config.target_parameters)}) is saved as a peft adapter only: drop --merge")
    return config


def data_of_run(options: FinetuneOptions, rows, *, plan, optimizer) -> dict:
    """The run's batches, held-out rows, step count and LR schedule (Run fields)."""
    from .data import MicroBatches
    from .lr_schedule import cosine_schedule_with_warmup  # transformers' own, without its 7 s of imports

    rows, held_out = split_eval_rows(rows, options)
    per_step = plan.micro_batches * plan.dp
    batches = MicroBatches(rows, micro_batch_size=options.micro_batch_size, num_micro_batches=per_step,
                           seed=options.seed)
    total_steps = total_steps_of(options, rows=len(rows), rows_per_step=per_step * options.micro_batch_size)
    scheduler = cosine_schedule_with_warmup(optimizer, options.warmup_steps, total_steps)
    return dict(batches=batches, held_out=held_out, total_steps=total_steps, scheduler=scheduler,
                metrics=None, checkpointer=None)


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


def plan_of_run(options: FinetuneOptions, *, model_path: str, global_batch: Optional[int] = None):
    """The run's Plan, made on rank 0 and shared with every rank, before any weight is read;
    `global_batch` (rows per step) replaces --micro-batches when a resumed run must keep its batch."""
    from ..parallel.launch import shared_plan
    from .options import plan_arguments

    from ..calibrate import run_link, run_speeds
    from ..checkpoint import load_config
    from ..models import check_supported

    check_sequence_length(model_path, options.seq_len)
    check_supported(load_config(model_path))  # refused by name before a probe runs one of its blocks
    world = int(os.environ.get("WORLD_SIZE", "1"))

    budget = options.max_memory or default_max_memory(world)
    arguments = plan_arguments(options, world_size=world)
    if global_batch:
        arguments.update(micro_batches=None, global_batch=global_batch)
    # Measured on this rank's own device (cached per device kind and dtype): the time model picks the schedule.
    arguments["device_speeds"] = run_speeds(model_path, arguments["spec"], budget)
    # One p2p probe between neighbours (pipeline sends, TP all-reduces), with the block's split-backward cost.
    arguments["link"] = run_link(model_path, arguments["spec"])
    return shared_plan(model_path, budget, **arguments)


def saved_method(method: str) -> str:
    """What the output folder holds: QLoRA writes the same peft adapter folder as LoRA."""
    return "lora" if method == "qlora" else method


def qlora_config_of_run(options: FinetuneOptions, plan, *, model_path: str):
    """The run's `BitsAndBytesConfig` (None unless --method qlora), refused in one line before any weight is
    read where bitsandbytes cannot serve it on this rank's device."""
    from ..quantize import quantization_of_checkpoint

    if options.method != "qlora":
        return quantization_of_checkpoint(model_path, None, method=options.method)  # refuses a pre-quantized one
    from ..parallel.mesh import device_of_rank
    from ..quantize import check_quantization, quantization_config_of

    qconfig = quantization_config_of(plan.spec)  # the spec carries the options' knobs (options.training_spec)
    qconfig = quantization_of_checkpoint(model_path, qconfig, method="qlora")  # as a pre-quantized one stores
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
    """Optimizer steps: `epochs` passes over the rows when given, else `max_steps`, else one epoch."""
    if options.epochs is None and options.max_steps is not None:
        return options.max_steps
    per_epoch = rows // rows_per_step
    if per_epoch < 1:
        raise HfsplitError(f"the dataset has {rows} rows, fewer than one step needs ({rows_per_step}); "
                           "lower --micro-batches or --micro-batch-size, or add data")
    return (options.epochs or 1) * per_epoch


def split_eval_rows(rows, options: FinetuneOptions):
    """(training rows, held-out rows): with `eval_every`, 5% (at least one micro-batch) is held out."""
    from .data import TokenRows

    if not options.eval_every:
        return rows, None
    count = max(options.global_batch or options.micro_batch_size * options.micro_batches, len(rows) // 20)
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
        losses.append(model.reduce_loss(loss, replicas=False))
    return sum(losses) / len(losses)
