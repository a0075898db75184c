"""Building a fine-tuning run: join the launch, plan, read the data, load this rank's part of the model, and set
up everything the loop (`hfsplit.training.trainer`) works with. Every input problem surfaces here, before any
weight is read.
"""
from __future__ import annotations

import dataclasses

import os
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from hfsplit.apply.lora import lora_config_of
from hfsplit.budget import local_share
from hfsplit.checkpoint.resolve import load_config
from hfsplit.checkpoint.synthetic import TINY_MODEL, tiny_tokenizer, write_tiny_checkpoint
from hfsplit.errors import HfsplitError
from hfsplit.load.launch import shared_plan, split_from_pretrained
from hfsplit.load.proof import Verdict, proven_split
from hfsplit.load.probes import run_link, run_speeds
from hfsplit.parallel.mesh import World, init_distributed
from hfsplit.training import elastic
from hfsplit.training.checkpointer import Checkpointer, TrainState
from hfsplit.training.elastic import LaunchState, settle_growth
from hfsplit.training.lr_schedule import cosine_schedule_with_warmup  # transformers' own, without its 7 s of imports
from hfsplit.training.metrics import Metrics, TrainResult
from hfsplit.training.optimizers import build_optimizer, optim_of_rank
from hfsplit.objectives import objective_of
from hfsplit.objectives.dpo import check_dpo_router_eval  # noqa: F401  (its tests import it from here)
from hfsplit.training.options import FinetuneOptions, dataset_of, packing_of, plan_arguments, training_spec, with_plan_batch
from hfsplit.training.resume import check_trainer_state, trusted_checkpoint
from hfsplit.parallel.save import writable_dir
from hfsplit.training.trainer import Run, fit


def train(options: FinetuneOptions, *, progress: bool = True) -> TrainResult:
    """Run the fine-tune `options` describe on this rank; return the run's figures.

    Args:
        options: the recipe options.
        progress: show the progress bar on the rank that holds the loss.
    """
    return fit(build_run(options, progress=progress))


def default_model_path(output_dir: str) -> str:
    """The built-in tiny model, written once next to the run's output (rank 0 writes, others wait)."""
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


def default_max_memory(world: World) -> str:
    """An equal share of what this host's devices have free, one budget per rank."""
    # CPU ranks of this host share its memory (ranks on other hosts have their own).
    return local_share(world.world_size, ranks_here=world.local_world_size)


def check_sequence_length(model_path: str, seq_len: int) -> None:
    """A clear error, before any weight is read, for sequences longer than the model's positions."""
    limit = getattr(load_config(model_path), "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        raise HfsplitError(f"--seq-len {seq_len} is beyond {model_path}'s {limit} positions "
                           f"(max_position_embeddings); use --seq-len {limit} or less")


def build_run(options: FinetuneOptions, *, progress: bool = True) -> Run:
    """Join the launch, plan, read the data, load this rank's part of the model, add adapters, and set up
    optimizer, schedule, metrics and checkpoints; resume when asked. Every input problem surfaces
    before any weight is read."""
    started = time.time()
    world = init_distributed(timeout_s=options.peer_timeout)
    torch.manual_seed(options.seed)
    launch = launch_state(options)
    model_path = options.model or default_model_path(options.output_dir)
    check_sequence_length(model_path, options.seq_len)  # both before the data is read
    options = packing_proven(options, proven_split(load_config(model_path)))  # refused by name before a probe runs
    objective = objective_of(options.objective)
    objective.check_model(options, load_config(model_path))
    tokenizer, rows = load_rows(options, model_path=model_path)  # before the plan: it counts a cached reference's pairs
    # A resumed elastic run keeps its global batch: the planner sets micro-batches for the dp it finds now.
    planned = dict(model_path=model_path, global_batch=launch.rows_per_step,
                   reference_pairs=cached_pairs(options, rows))
    plan = plan_of_run(options, world=world, **planned)
    plan = settle_growth(launch, plan, replan=lambda regrouped: plan_of_run(options, world=regrouped, **planned),
                         timeout_s=options.peer_timeout)  # a larger layout runs only when estimated faster
    config = lora_of_run(plan, model_path=model_path, merge=options.merge)  # the adapters the plan adds, checked
    # the plan carries the LoRA, the quantization and the weights' dtype: the seed alone travels beside it
    model = split_from_pretrained(model_path, plan=plan, dtype=getattr(torch, plan.spec.weights_dtype),
                                  lora_seed=options.seed)
    plan = model.plan
    calibrated = training_spec(options)  # the shape its FLOP/s was probed at, which the run re-checks
    options = with_plan_batch(options, plan)  # the cut --global-batch left to the planner, if it did
    if dist.get_rank() == 0:
        print(plan.table(), flush=True)  # its last lines say what the run applied to each stage
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, optim=optim_of_rank(plan, model.stage_indices), lr=options.learning_rate,
                                weight_decay=options.weight_decay)  # the plan's: fp32 or 8-bit moments
    run = Run(options=options, model=model, model_path=model_path, tokenizer=tokenizer, params=params,
              optimizer=optimizer, lora_config=config, loss_fn=loss_of_run(options, model), objective=objective,
              calibration_spec=calibrated, **data_of_run(options, rows, plan=plan, optimizer=optimizer))
    holds_loss = model.has_last and model.ctx.coords.tp == 0 and model.ctx.coords.dp == 0
    if launch.resume_from is not None:  # another run's checkpoint is refused before the metrics files open
        check_trainer_state(launch.resume_from, model=model, params=params)
    run.metrics = Metrics(options.output_dir, total_steps=run.total_steps, bubble_theory=plan.bubble_fraction,
                          padded_padding=rows.padded_padding if rows.packed else None,
                          holds_loss=holds_loss, progress=progress, append=launch.append,
                          offloads=plan.offload_bytes > 0)
    run.checkpointer = Checkpointer(
        model=model, state=TrainState(params=params, optimizer=optimizer, scheduler=run.scheduler,
                                      batches=run.batches),
        output_dir=options.output_dir, method=saved_method(options.method), base_model=model_path, lora_config=config,
        tokenizer=tokenizer, save_every=options.save_every, keep=options.save_total_limit, merge=options.merge,
        metrics=run.metrics, max_shard_size=options.max_shard_size)
    objective.prepare(run, progress=progress and holds_loss)  # before a resume loads trained weights
    run.first_step = run.checkpointer.resume(launch.resume_from)
    log_launch(run, launch, started=started)
    run.metrics.begin(run.first_step)
    return run


def log_launch(run: Run, launch, *, started: float) -> None:
    """Check the kept global batch and log this launch's plan, and the restart it is, if any."""
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


def launch_state(options: FinetuneOptions) -> LaunchState:
    """What this launch resumes from (after a torchrun restart: the latest checkpoint), every file of it checked
    on every rank before any weight is read; the output folder checked writable first."""
    writable_dir(options.output_dir)
    launch = LaunchState.decide(options.resume, options.output_dir)  # a missing checkpoint fails here
    if launch.resume_from is not None:  # every rank reads what it will resume from without running code, or refuses
        trusted_checkpoint(launch.resume_from)
    return launch


def loss_of_run(options: FinetuneOptions, model):
    """The last stage's loss: the objective's (transformers' causal-LM loss for SFT)."""
    return objective_of(options.objective).loss(options, model)


def load_rows(options: FinetuneOptions, *, model_path: str):
    """(tokenizer, token rows) of the run's dataset (the objective's bundled tiny set by default), as its objective
    reads them, every token one the model has an embedding for."""
    tokenizer = tokenizer_for(options, model_path=model_path)
    rows = objective_of(options.objective).load_rows(options, tokenizer, source=dataset_of(options),
                                                     packing=packing_of(options))
    if torch.is_tensor(getattr(rows, "input_ids", None)):
        check_token_ids(rows, vocab_size=load_config(model_path).get_text_config().vocab_size,
                        tokenizer=options.tokenizer or model_path, model=model_path)
    return tokenizer, rows


def check_token_ids(rows, *, vocab_size: int, tokenizer: Optional[str], model: str) -> None:
    """One line when the tokenizer gives ids past the model's embeddings (it belongs to another model)."""
    largest = int(rows.input_ids.max()) if rows.input_ids.numel() else -1
    if largest >= vocab_size:
        raise HfsplitError(f"{tokenizer or 'the tokenizer'}: gives token id {largest}, beyond {model}'s vocab_size "
                           f"{vocab_size} (its embedding rows): it is another model's tokenizer; pass the model's own "
                           "(leave --tokenizer unset)")


def lora_of_run(plan, *, model_path: str, merge: bool):
    """The peft LoraConfig of the plan's adapters (None unless a LoRA or QLoRA plan), as the LoRA step builds it
    (`lora_config_of` the plan's spec), refused before any weight is read where --merge cannot fold it."""
    if plan.spec.method not in ("lora", "qlora"):
        return None
    config = lora_config_of(plan.spec, load_config(model_path))
    if merge and config.target_parameters:
        raise HfsplitError(f"--merge folds adapters of linear layers; LoRA on fused experts "
                           f"({', '.join(config.target_parameters)}) is saved as a peft adapter only: drop --merge")
    return config


def data_of_run(options: FinetuneOptions, rows, *, plan, optimizer) -> dict:
    """The run's batches, held-out rows, step count and LR schedule (Run fields)."""
    rows, held_out = split_eval_rows(rows, options)
    per_step = plan.micro_batches * plan.dp
    batches = objective_of(options.objective).batches(options, rows, micro_batches=per_step)
    total_steps = total_steps_of(options, rows=len(rows), rows_per_step=batches.batch_size)
    scheduler = cosine_schedule_with_warmup(optimizer, options.warmup_steps, total_steps)
    return dict(batches=batches, held_out=held_out, total_steps=total_steps, scheduler=scheduler,
                metrics=None, checkpointer=None)


def packing_proven(options: FinetuneOptions, verdict: Verdict) -> FinetuneOptions:
    """`options` with packing turned off where the proof found a packed row's examples not isolated in this model
    (a recurrent layer that cannot restart at an example boundary): one line under --packing auto, refused under
    --packing on."""
    if verdict.packing or not packing_of(options):
        return options
    if options.packing == "on":
        raise HfsplitError(f"--packing on: {verdict.model_type} cannot pack: {verdict.reason}; pass --packing off")
    print(f"packing off for {verdict.model_type}: {verdict.reason}", flush=True)
    return dataclasses.replace(options, packing="off")


def plan_of_run(options: FinetuneOptions, *, model_path: str, world: World, global_batch: Optional[int] = None,
                reference_pairs: Optional[int] = None):
    """The run's Plan for `world`'s ranks, made on rank 0 and shared with every rank, before any weight is read;
    `global_batch` (rows per step) replaces --micro-batches when a resumed run must keep its batch;
    `reference_pairs`: the examples a precomputed reference caches (`cached_pairs`)."""
    budget = options.max_memory or default_max_memory(world)
    arguments = plan_arguments(options, world_size=world.world_size, reference_pairs=reference_pairs)
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


def tokenizer_for(options: FinetuneOptions, *, model_path: Optional[str]):
    """The tokenizer named by --tokenizer, else the model's own, else hfsplit's tiny one."""
    name = options.tokenizer or model_path
    if name is None:
        return tiny_tokenizer()
    from transformers import AutoTokenizer

    if not Path(name).exists() and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise HfsplitError(f"{name}: no such tokenizer folder; pass --tokenizer an existing folder or a hub name "
                           "'org/name'")
    try:  # False, not None: transformers would otherwise ask on a terminal whether to run the folder's code
        return AutoTokenizer.from_pretrained(name, trust_remote_code=options.trust_remote_code)
    except (OSError, ValueError) as exc:
        if "trust_remote_code" in str(exc):
            raise HfsplitError(f"{name}: the tokenizer ships Python code of its own (auto_map), which hfsplit does "
                               "not run unless told: read it, then pass --trust-remote-code, or pass --tokenizer "
                               "NAME_OR_FOLDER of a tokenizer transformers knows") from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HfsplitError(f"{name}: no tokenizer found ({first}); pass --tokenizer NAME_OR_FOLDER") from exc


def total_steps_of(options: FinetuneOptions, *, rows: int, rows_per_step: int) -> int:
    """Optimizer steps: `epochs` passes over the rows when given, else `max_steps`, else one epoch."""
    if options.epochs is None and options.max_steps is not None:
        return options.max_steps
    per_epoch = rows // rows_per_step
    if per_epoch < 1:
        raise HfsplitError(f"the dataset has {rows} rows, fewer than one step needs ({rows_per_step}); "
                           "lower --micro-batches or --micro-batch-size, or add data")
    return (options.epochs or 1) * per_epoch


def cached_pairs(options: FinetuneOptions, rows) -> Optional[int]:
    """The examples whose log-probs a precomputed reference caches, for the plan (`TrainingSpec.reference_pairs`):
    the objective's count (DPO: every pair, training and held-out), else None."""
    return objective_of(options.objective).cached_examples(options, rows)


def split_eval_rows(rows, options: FinetuneOptions):
    """(training rows, held-out rows): with `eval_every`, 5% (at least one micro-batch) is held out."""
    if not options.eval_every:
        return rows, None
    count = max(options.global_batch or options.micro_batch_size * options.micro_batches, len(rows) // 20)
    group = 1 if packing_of(options) else objective_of(options.objective).counts.rows_per_example
    count += -count % group  # whole examples (DPO's pairs; a packed row holds whole ones)
    if count >= len(rows):
        raise HfsplitError(f"the dataset has {len(rows)} rows: too few to hold out {count} for --eval-every")
    return rows.select(slice(count, None)), rows.select(slice(None, count))
