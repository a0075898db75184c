"""Fine-tuning options, declared once: each field's type, choices, default and help live on the field.

`recipes/finetune.py`, `python -m hfsplit.finetune`, a YAML recipe (`--config`) and `hfsplit plan` all read
these fields; the defaults are those of a real model (LoRA r=16, seq 2048, micro-batch 1), and the built-in
tiny demo's own values live in its bundled recipe (`bundled/tiny.yaml`), which applies when no model is given.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import re
import sys
import typing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Optional, Sequence, Union

import yaml

from hfsplit.budget import DEFAULT_MAX_SHARD_SIZE, parse_size, torch_gpus
from hfsplit.errors import HfsplitError
from hfsplit.objectives import OBJECTIVES, option_mixins, option_rules_of
from hfsplit.objectives.options import reference_of
from hfsplit.plan import TrainingSpec
from hfsplit.training.option_fields import GROUPS, option
from hfsplit.training.sources import DatasetError, bundled_dataset_path, detect_format, load_examples, packs_by_default

__all__ = ["ACCELERATE_CPU_CONFIG", "GROUPS", "TINY_RECIPE", "FinetuneOptions", "option", "options_from",
           "parse_options", "reference_of", "tiny_demo_options", "training_spec"]
TINY_RECIPE = Path(__file__).parent / "bundled" / "tiny.yaml"
# accelerate launch on CPU ranks needs its multi-process launcher (STACK.md): `hfsplit accelerate-config` prints it.
ACCELERATE_CPU_CONFIG = Path(__file__).parent / "bundled" / "accelerate_cpu.yaml"


@dataclass
class FinetuneOptions(*option_mixins()):
    """Everything a fine-tuning run can be told. Each field is also a `--flag` and a key of a YAML recipe;
    flags override the recipe. See each field's help (`recipes/finetune.py --help`). The objectives' own options
    are declared without torch (`hfsplit.objectives.options`) and mixed in; where an option is left unset, the
    objective's default applies (`Objective.defaults`)."""

    model: Optional[str] = option(
        None, "model", "hub name (org/name) or local folder; unset: the built-in tiny demo (a tiny Llama written "
        "locally, the bundled alpaca data, two CPU ranks; its own values from hfsplit/training/bundled/tiny.yaml)")
    config: Optional[str] = option(None, "model", "a YAML recipe whose keys are these options; flags override it")
    tokenizer: Optional[str] = option(None, "model", "tokenizer name or folder; unset: the model's own")
    trust_remote_code: bool = option(
        False, "model", "let transformers run the Python code a tokenizer's folder or hub repo ships (its auto_map); "
        "off: such a tokenizer is refused. Models never run a checkpoint's code: hfsplit builds transformers' own "
        "classes")
    dtype: Optional[Literal["bfloat16", "float16", "float32"]] = option(
        None, "model", "weights and activations; unset: bfloat16 on GPUs, float32 on CPU ranks (full fine-tuning "
        "in 16 bits keeps fp32 master weights and computes under autocast)")
    dataset: Optional[str] = option(
        None, "data", "local json/jsonl/csv/parquet/txt file or folder, or a hub dataset name; "
        "unset: the bundled tiny alpaca set")
    dataset_format: Optional[Literal["text", "instruction", "chat"]] = option(
        None, "data", "text (packed blocks), instruction (alpaca; loss on the response) or chat (`messages` through "
        "the chat template; loss on assistant turns); unset: detected from the columns")
    packing: Literal["auto", "on", "off"] = option(
        "auto", "data", "auto: instruction and chat examples packed several to a row by best-fit decreasing, each "
        "isolated (position ids restart, attention stays inside it), text documents joined and cut into blocks; on: "
        "packed, text documents too (each its own example); off: one example a row, padded to --seq-len. "
        "Preference pairs (--objective dpo): auto is off (each pair two padded rows, TRL's layout); on packs several "
        "pairs a row, a pair's chosen and rejected always in one row, each sequence isolated")
    seq_len: int = option(2048, "data", "tokens per sequence")
    eval_every: Optional[int] = option(None, "data", "evaluate on held-out rows (5%%) every N steps; unset: never")
    method: Literal["lora", "qlora", "full"] = option(
        "lora", "method", "lora (frozen base + adapters), qlora (LoRA on a bitsandbytes 4-bit or 8-bit base) or full")
    objective: str = option(
        "sft", "method", "sft (next-token loss on the responses), dpo (direct preference optimisation on "
        "prompt/chosen/rejected pairs, TRL's DPOTrainer loss) or another registered objective "
        "(hfsplit/objectives)", choices=tuple(OBJECTIVES))
    beta: Optional[float] = option(
        None, "objective", "the strength of the pull towards the reference model (TRL's beta); unset: the "
        "objective's default (DPO: 0.1)")
    reference: Optional[Literal["adapters-off", "precomputed"]] = option(
        None, "objective", "where an objective's reference log-probs come from: adapters-off (the same stages with "
        "the LoRA adapters disabled, a no-grad pass per micro-batch) or precomputed (one no-grad pass before "
        "training, what full fine-tuning uses with DPO); unset: adapters-off with LoRA/QLoRA, precomputed with full")
    lora_r: int = option(16, "method", "LoRA rank")
    lora_alpha: int = option(32, "method", "LoRA alpha (the adapters' scale is alpha / r)")
    lora_dropout: float = option(0.05, "method", "dropout on the adapters' inputs")
    lora_targets: Optional[list[str]] = option(
        None, "method", "comma-separated module (or expert parameter) names LoRA wraps; "
        "unset: every attention and MLP projection")
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = option("nf4", "method", "QLoRA: the 4-bit data type")
    bnb_4bit_use_double_quant: bool = option(True, "method", "QLoRA: quantize the quantization constants too")
    load_in_8bit: bool = option(False, "method", "QLoRA on an 8-bit base (LLM.int8) instead of 4-bit")
    quantize_experts: bool = option(
        True, "method", "QLoRA on an MoE: its fused experts in 4 bits too, each expert quantized as it is read "
        "(off: kept in --dtype, as transformers + bitsandbytes do)")
    merge: bool = option(False, "method", "LoRA: also write merged/, the base model with the adapters folded in")
    max_memory: Optional[str] = option(
        None, "parallelism", 'per-rank budget: "2x24GiB", "24GiB,12GiB"; unset: what each rank\'s device has free')
    tp: Optional[int] = option(None, "parallelism", "force the tensor-parallel degree; unset: the planner's choice")
    pp: Optional[int] = option(None, "parallelism", "force the pipeline depth; unset: the planner's choice")
    schedule: Literal["auto", "1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV",
                      "InterleavedZeroBubble", "LoopedBFS"] = option(
        "auto", "parallelism", "pipeline schedule; auto: the fastest by the planner's calibrated time model")
    micro_batch_size: Optional[int] = option(
        None, "parallelism", "rows per micro-batch (a packed row holds several examples; DPO's padded pairs take two "
        "rows each, so it is even there); unset: the objective's default (1; DPO: 2, one pair)")
    micro_batches: Optional[int] = option(
        None, "parallelism", "micro-batches per optimizer step (gradient accumulation); unset: 4 x pipeline depth")
    global_batch: Optional[int] = option(
        None, "parallelism", "sequences per optimizer step over all replicas, instead of --micro-batches; under "
        "--schedule auto the planner also chooses the micro-batch size (up to --micro-batch-size) and count")
    activation_checkpointing: Union[bool, Literal["auto", "offload"]] = option(
        "auto", "parallelism", "recompute block activations in backward: on, off, offload (on, with each block's saved "
        "input in host RAM until its recompute), or auto (the planner picks per stage the fastest of off / on / offload "
        "that fits)")
    headroom: float = option(
        0.0, "parallelism", "fraction of each device's budget the plan leaves free, a margin for what the estimate "
        "misses (0.03: every device at most 97%% full)")
    chunked_loss: Union[bool, Literal["auto"]] = option(
        "auto", "parallelism", "the last stage runs lm_head and the loss a chunk of tokens at a time (never a whole "
        "micro-batch's logits): the same loss and gradients in less memory, for one more lm_head forward; auto: on "
        "where the plan fits only with it, or faster")
    tiled_mlp: Union[bool, Literal["auto"]] = option(
        "auto", "parallelism", "each block's MLP runs the sequence a slice at a time, forward and recompute-backward "
        "(its intermediates never whole): the same loss and gradients for one more MLP forward a micro-batch; auto: "
        "on a stage only where nothing else fits it")
    host_embedding: Union[bool, Literal["auto"]] = option(
        "auto", "parallelism", "LoRA/QLoRA: the first stage's frozen embedding table in host RAM, looked up on the "
        "CPU; auto: where its card fits no other way")
    optim: Literal["auto", "adamw_torch", "adamw_8bit", "paged_adamw_8bit"] = option(
        "auto", "optimisation", "the optimizer, by transformers' names: auto (fp32 AdamW, bitsandbytes' 8-bit moments "
        "on a stage only where fp32 ones would not fit), adamw_torch, adamw_8bit or paged_adamw_8bit")
    learning_rate: float = option(2e-4, "optimisation", "peak learning rate (AdamW; cosine decay after warm-up)")
    warmup_steps: int = option(10, "optimisation", "linear warm-up steps")
    weight_decay: float = option(0.0, "optimisation", "AdamW weight decay")
    max_grad_norm: float = option(1.0, "optimisation", "clip gradients to this global norm")
    max_steps: Optional[int] = option(None, "optimisation", "optimizer steps; unset: --epochs passes over the data")
    epochs: Optional[int] = option(None, "optimisation", "passes over the data when --max-steps is unset; unset: 1")
    seed: int = option(0, "optimisation", "seeds new adapters, data order and dropout")
    output_dir: Optional[str] = option(
        None, "checkpoints", "metrics, checkpoints and the final model go here; unset: runs/<model name>")
    save_every: Optional[int] = option(None, "checkpoints", "save a checkpoint every N steps; unset: only at the end")
    save_total_limit: int = option(0, "checkpoints", "keep only the newest K checkpoints; 0 keeps all")
    max_shard_size: str = option(
        DEFAULT_MAX_SHARD_SIZE, "checkpoints", "largest safetensors shard of model/ and merged/, as save_pretrained "
        "(each stage streams its tensors into shards of at most this size)")
    timeline_step: Optional[int] = option(
        None, "checkpoints", "the step whose pipeline actions every rank records (clock stamps around its stages' "
        "forward and backward chunks), written as timeline.json and drawn beside the plan's timeline in "
        "timeline.png; unset: the last step; 0: none")
    resume: Optional[str] = option(
        None, "checkpoints", "a checkpoint folder, or latest (a bare --resume): weights, optimizer, scheduler, RNG and "
        "data position, resharded to this run's split; auto: the latest if there is one (what a torchrun restart "
        "does by itself)", const="latest")
    on_nonfinite: Literal["skip", "stop"] = option(
        "skip", "faults", "a non-finite loss or gradient norm: skip (drop the step, log it) or stop (exit 3)")
    peer_timeout: float = option(600.0, "faults", "seconds a rank waits for a silent peer before it gives up")

    def validate(self) -> None:
        check_choices(self)
        check_qlora_options(self)
        for f in dataclasses.fields(self):  # a string is truthy: "off" would silently turn a switch on
            if bool in _types_of(f) and not isinstance(getattr(self, f.name), bool) and \
                    getattr(self, f.name) not in _choices_of(f):
                allowed = " or ".join(repr(c) for c in _choices_of(f))
                raise HfsplitError(f"--{_flag(f.name)} is on or off (True or False in Python)"
                                   f"{' or ' + allowed if allowed else ''}; got {getattr(self, f.name)!r}")
        if self.max_memory is not None and not str(self.max_memory).strip():
            raise HfsplitError("--max-memory is empty; give sizes (2x24GiB) or GPU kinds (2xRTX4090), or leave it out "
                               "for what each device has free")
        if self.merge and self.method not in ("lora", "qlora"):
            raise HfsplitError("--merge folds LoRA adapters into the base model; it needs --method lora")
        if self.lora_targets is not None and not self.lora_targets:  # "--lora-targets ," would mean the default
            raise HfsplitError("--lora-targets names no module; name them (q_proj,v_proj) or leave it out for every "
                               "attention and MLP projection")
        if self.global_batch and self.micro_batches:  # the planner cuts a global batch: the count would be dropped
            raise HfsplitError(f"--global-batch {self.global_batch} and --micro-batches {self.micro_batches} both set "
                               "a step's size; give one (--global-batch: sequences a step, cut by the planner)")
        option_rules_of(self.objective).check_options(self)
        parse_size(self.max_shard_size, what="--max-shard-size")  # refused before the run, not at its end
        if self.peer_timeout <= 0:
            raise HfsplitError(f"--peer-timeout must be a positive number of seconds (got {self.peer_timeout})")
        for name in ("seq_len", "micro_batch_size", "lora_r"):
            if getattr(self, name) < 1:
                raise HfsplitError(f"--{_flag(name)} must be at least 1 (got {getattr(self, name)})")
        for name in ("warmup_steps", "weight_decay", "max_grad_norm", "lora_alpha", "save_total_limit", "seed"):
            _check_number(self, name, low=0)
        if self.timeline_step is not None:  # unset: the last step
            _check_number(self, "timeline_step", low=0)
        _check_number(self, "learning_rate", low=0, above=True)
        _check_number(self, "lora_dropout", low=0, high=1)
        _check_number(self, "headroom", low=0, high=0.49)
        # unset: off (or the planner's choice)
        for name in ("eval_every", "save_every", "epochs", "tp", "pp", "global_batch", "max_steps", "micro_batches"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise HfsplitError(f"--{_flag(name)} must be at least 1, or left out (got {getattr(self, name)})")

    def __post_init__(self):
        if self.objective in OBJECTIVES:  # the objective's defaults where an option is left unset (parsed once)
            for name, value in option_rules_of(self.objective).defaults(self).items():
                if getattr(self, name) is None:
                    setattr(self, name, value)
        if self.output_dir is None:  # runs/<the model's folder or hub name>
            self.output_dir = f"runs/{Path(self.model).name}" if self.model else "runs/tiny"


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _field_types() -> dict:
    return typing.get_type_hints(FinetuneOptions)


def _types_of(f) -> tuple:
    """The plain types a field takes (Optional/Union unwrapped; a Literal's values are choices, not types)."""
    hint = _field_types()[f.name]
    args = typing.get_args(hint) if typing.get_origin(hint) is Union else (hint,)
    return tuple(typing.get_origin(a) or a for a in args if a is not type(None) and typing.get_origin(a) is not Literal)


def _choices_of(f) -> tuple:
    """The values a field allows: its `choices`, else its Literal's (empty when it has neither)."""
    if "choices" in f.metadata:
        return tuple(f.metadata["choices"])
    hint = _field_types()[f.name]
    args = typing.get_args(hint) if typing.get_origin(hint) is Union else (hint,)
    return tuple(v for a in args if typing.get_origin(a) is Literal for v in typing.get_args(a))


def check_choices(options) -> None:
    """One line naming the option whose value is none of its choices."""
    for f in dataclasses.fields(options):
        choices, value = _choices_of(f), getattr(options, f.name)
        if bool in _types_of(f):  # a switch: `validate` names it as one
            continue
        if choices and value is not None and value not in choices:
            raise HfsplitError(f"--{_flag(f.name)} {value!r}: choose {', '.join(map(str, choices[:-1]))} "
                               f"or {choices[-1]}")


def _check_number(options, name: str, *, low: float, high: float = math.inf, above: bool = False) -> None:
    """One line naming the option when its value is not a finite number in [low, high] (> low with `above`)."""
    value = getattr(options, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HfsplitError(f"--{_flag(name)} must be a number (got {value!r})")
    if math.isfinite(value) and (value > low if above else value >= low) and value <= high:
        return
    bound = f"above {low:g}" if above else f"at least {low:g}"
    if high < math.inf:
        bound += f" and at most {high:g}"
    raise HfsplitError(f"--{_flag(name)} must be a finite number {bound} (got {value})")


def dataset_of(options: FinetuneOptions) -> str:
    """The run's dataset: --dataset, else the objective's bundled tiny set (alpaca; preference pairs for DPO)."""
    return options.dataset or str(bundled_dataset_path(option_rules_of(options.objective).default_dataset))


def packing_of(options: FinetuneOptions) -> bool:
    """Whether the run packs its rows: --packing on / off, or under auto whether its format packs by default
    (instruction and chat do; the format is --dataset-format, else read from the dataset's columns)."""
    packs = option_rules_of(options.objective).packs(options)  # the objective's rows may decide (DPO's pairs)
    if packs is not None:
        return packs
    if options.packing != "auto":
        return options.packing == "on"
    if options.dataset_format:
        return packs_by_default(options.dataset_format)
    if options.dataset is None:  # the bundled alpaca set
        return packs_by_default("instruction")
    try:
        return packs_by_default(detect_format(load_examples(options.dataset).column_names))
    except DatasetError as err:  # named as reading the rows names it
        raise DatasetError(f"{options.dataset}: {err}") from err


def training_spec(options: FinetuneOptions, *, gpu: Optional[bool] = None):
    """The one options → TrainingSpec function: what a step of this recipe does, for the planner, on GPUs or
    on CPU ranks (`gpu`; None: whatever this machine has)."""
    gpu = bool(torch_gpus()) if gpu is None else gpu
    dtype = options.dtype or ("bfloat16" if gpu else "float32")
    return TrainingSpec(method=options.method, seq_len=options.seq_len, micro_batch_size=options.micro_batch_size,
                        dtype=dtype, lora_r=options.lora_r, lora_alpha=options.lora_alpha,
                        lora_dropout=options.lora_dropout,
                        lora_targets=tuple(options.lora_targets) if options.lora_targets else None,
                        # what the user fixed (off, on, offload), else off until the planner decides (auto)
                        activation_checkpointing=False if options.activation_checkpointing == "auto"
                        else options.activation_checkpointing,
                        optim=options.optim if options.optim != "auto" else "adamw_torch",
                        bnb_4bit_quant_type=options.bnb_4bit_quant_type,
                        bnb_4bit_use_double_quant=options.bnb_4bit_use_double_quant, load_in_8bit=options.load_in_8bit,
                        chunked_loss=options.chunked_loss is True, packing=packing_of(options),
                        quantize_experts=options.quantize_experts, objective=options.objective,
                        **option_rules_of(options.objective).spec_fields(options))


def plan_arguments(options: FinetuneOptions, *, world_size: int, gpu: Optional[bool] = None,
                   reference_pairs: Optional[int] = None) -> dict:
    """Keyword arguments of `make_plan` (besides model and budget) for the run `options` describe on
    `world_size` ranks (on GPUs or CPU ranks: `training_spec`): the trainer and `hfsplit plan` both plan with
    exactly these. `reference_pairs`: the examples whose log-probs a precomputed reference caches (the run knows
    them from its data; `TrainingSpec.reference_pairs`), else None."""
    # The built-in default demonstrates the pipeline: one stage per rank unless told otherwise.
    pp = options.pp or (world_size if options.model is None and options.tp is None else None)
    gpu = bool(torch_gpus()) if gpu is None else gpu  # CPU ranks: no reserve (hfsplit/planning/reserve.py)
    spec = replace(training_spec(options, gpu=gpu), reference_pairs=reference_pairs)
    return dict(spec=spec, **batch_arguments(options), schedule=options.schedule, gpus=gpu,
                tp=options.tp, pp=pp, world_size=world_size, activation_checkpointing=options.activation_checkpointing,
                optim=options.optim, headroom=options.headroom, chunked_loss=options.chunked_loss,
                tiled_mlp=options.tiled_mlp, host_embedding=options.host_embedding)


def batch_arguments(options: FinetuneOptions) -> dict:
    """`make_plan`'s micro_batches / global_batch: the count, or a global batch the planner cuts (under auto)."""
    if not options.global_batch:
        return dict(micro_batches=options.micro_batches)
    return dict(micro_batches="auto" if options.schedule == "auto" else None, global_batch=options.global_batch)


def with_plan_batch(options: FinetuneOptions, plan) -> FinetuneOptions:
    """`options` with the micro-batch size and count the plan runs (they differ where auto cut a global batch)."""
    return dataclasses.replace(options, micro_batch_size=plan.spec.micro_batch_size, micro_batches=plan.micro_batches)


def check_qlora_options(options: FinetuneOptions) -> None:
    """One line for bitsandbytes knobs without --method qlora, or a QLoRA run given a full-only option."""
    knobs = {"bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True, "load_in_8bit": False,
             "quantize_experts": True}
    given = [k for k, default in knobs.items() if getattr(options, k) != default]
    if given and options.method != "qlora":
        raise HfsplitError(f"--{given[0].replace('_', '-')} sets the quantized base of --method qlora; "
                           f"drop it or pass --method qlora (got --method {options.method})")
    four_bit = [f"--{k.replace('_', '-')} {_shown(getattr(options, k))}" for k in given if k != "load_in_8bit"]
    if options.load_in_8bit and four_bit:  # an 8-bit base has no 4-bit data type nor 4-bit constants to quantize
        raise HfsplitError(f"--load-in-8bit and {four_bit[0]} contradict each other: {four_bit[0]} sets a 4-bit base; "
                           f"drop {four_bit[0]} for an 8-bit base, or --load-in-8bit for a 4-bit one")
    if options.method == "qlora" and options.tp not in (None, 1):
        raise HfsplitError(f"--tp {options.tp} with --method qlora: a 4-bit base is not tensor-parallel here; "
                           "drop --tp (QLoRA splits over pipeline stages and data parallelism)")


def _shown(value) -> str:
    """A value as its flag takes it: on / off for a switch."""
    return {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)


# The options a plan depends on (what `plan_arguments` reads, the dataset for its packing): `hfsplit plan --help` lists
# these. It takes the others too, so that a recipe's command line plans as it runs, and names them in one line.
PLANNED = ("model", "config", "dtype", "dataset", "dataset_format", "packing", "seq_len", "method", "objective",
           "reference", "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "bnb_4bit_quant_type",
           "bnb_4bit_use_double_quant", "load_in_8bit", "quantize_experts", "max_memory", "tp", "pp", "schedule",
           "micro_batch_size", "micro_batches", "global_batch", "activation_checkpointing", "headroom", "chunked_loss",
           "tiled_mlp", "host_embedding",
           "optim", "num_generations", "max_completion_length")


def training_only_flags() -> list[str]:
    """The flags of the options no plan depends on (`PLANNED`'s complement), in field order."""
    return ["--" + _flag(f.name) for f in dataclasses.fields(FinetuneOptions) if f.name not in PLANNED]


def add_option_arguments(parser: argparse.ArgumentParser, names: Optional[Sequence[str]] = None) -> None:
    """Add a `--flag` per FinetuneOptions field to `parser`, listed by group, each with its help, choices and
    default; the fields outside `names` (default: none) are taken but left out of `--help`. Defaults stay None in
    the namespace, so only given flags override a recipe (`options_from`)."""
    for group in GROUPS:
        fields_ = [f for f in dataclasses.fields(FinetuneOptions) if f.metadata["group"] == group]
        shown = [f for f in fields_ if names is None or f.name in names]
        section = parser.add_argument_group(f"{group} options") if shown else parser
        for f in fields_:
            argument = _argument_of(f)
            if f not in shown:
                argument["help"] = argparse.SUPPRESS
            section.add_argument("--" + _flag(f.name), dest=f.name, default=None, **argument)


class OptionParser(argparse.ArgumentParser):
    """argparse, answering a mistyped flag with the flags closest to it (its own, or its chosen command's)."""

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            chosen = self.chosen(parsed)
            chosen.error(unknown_arguments(extras, [s for a in chosen._actions for s in a.option_strings]))
        return parsed

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(negative_values_joined(args, self.valued_flags()), namespace)

    def valued_flags(self) -> set[str]:
        """The flags that take a value, of this parser and its commands'."""
        flags = set()
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                flags.update(*(p.valued_flags() for p in action.choices.values() if isinstance(p, OptionParser)))
            elif action.nargs != 0:
                flags.update(s for s in action.option_strings if s.startswith("--"))
        return flags

    def chosen(self, parsed) -> argparse.ArgumentParser:
        """The subcommand's parser `parsed` went through (`hfsplit plan`), else this one."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and getattr(parsed, action.dest, None) in action.choices:
                return action.choices[getattr(parsed, action.dest)]
        return self

    def error(self, message: str):
        """One line, as every refusal of the recipe is (argparse would print the whole usage first)."""
        self.exit(2, f"{self.prog}: {message} (--help lists the options)\n")


def negative_values_joined(args: list[str], flags: set[str]) -> list[str]:
    """`--max-memory -1GiB` as `--max-memory=-1GiB`: argparse takes a value that starts with '-' but is no plain
    number for a flag, and refused with "expected one argument"; joined, the value reaches the option's own check,
    whose line names it and the fix."""
    out: list[str] = []
    for arg in args:
        if out and out[-1] in flags and re.match(r"-\.?\d", arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def unknown_arguments(extras: Sequence[str], flags: Sequence[str]) -> str:
    """What argparse could not place: each unknown flag with the known ones closest to it (difflib), else the
    arguments left over."""
    typos = [extra.split("=", 1)[0] for extra in extras if extra.startswith("--")]
    if not typos:
        return f"unrecognized arguments: {' '.join(extras)}"
    return "; ".join(f"unknown flag {typo}" + (f": did you mean {' or '.join(close)}?" if close else "")
                     for typo, close in ((t, closest_flags(t, flags)) for t in typos))


def closest_flags(typed: str, flags: Sequence[str]) -> list[str]:
    """Up to three of `flags` closest to `typed` (`_` read as `-`), as close as the closest give or take 0.05."""
    scored = sorted(((difflib.SequenceMatcher(None, typed.replace("_", "-"), flag).ratio(), flag) for flag in flags),
                    reverse=True)
    return [flag for score, flag in scored[:3] if score >= max(0.6, scored[0][0] - 0.05)] if scored else []


def _argument_of(f) -> dict:
    """argparse keywords of one field: how its text converts, its choices, and help ending in its default."""
    types, choices = _types_of(f), _choices_of(f)
    shown = "unset" if f.default is None else "on" if f.default is True else "off" if f.default is False else f.default
    text = f.metadata["help"] if f.default is None and "unset:" in f.metadata["help"] else \
        f"{f.metadata['help']} (default: {shown})"
    if bool in types:  # --merge, --merge off; tri-state switches also take their choices (auto)
        return dict(type=_switch(choices), nargs="?", const=True, metavar="on|off" + "".join(f"|{c}" for c in choices),
                    help=text)
    if "const" in f.metadata:  # a bare --resume means the latest checkpoint
        return dict(type=str, nargs="?", const=f.metadata["const"], help=text)
    if list in types:
        return dict(type=lambda s: [t.strip() for t in s.split(",") if t.strip()], metavar="A,B", help=text)
    convert = int if int in types else float if float in types else str
    return dict(type=convert, help=text, **({"metavar": "|".join(map(str, choices))} if choices else {}))


def _switch(choices: tuple):
    def convert(text: str):
        if text.lower() in ("1", "true", "on", "yes"):
            return True
        if text.lower() in ("0", "false", "off", "no"):
            return False
        if text in choices:
            return text
        raise argparse.ArgumentTypeError(f"{text!r} is not {'/'.join(('on', 'off') + choices)}")
    return convert


def _from_yaml(name: str, value, *, path: Path):
    """A recipe value as its field's type: YAML 1.1 reads `1e-4` (no dot) as a string."""
    field_ = next(f for f in dataclasses.fields(FinetuneOptions) if f.name == name)
    types = _types_of(field_)
    if isinstance(value, str) and (int in types or float in types) and value not in _choices_of(field_):
        try:
            return (int if int in types else float)(value)
        except ValueError:
            raise HfsplitError(f"{path}: {name}: {value!r} is not a number; fix it in the recipe") from None
    return value


def read_recipe(path: Path) -> dict:
    """The mapping a YAML recipe holds, or one line naming the file and what is wrong (empty, not YAML, no mapping)."""
    if not path.is_file():
        raise HfsplitError(f"--config {path}: file not found")
    try:
        text = path.read_text(encoding="utf-8")
        loaded = yaml.safe_load(text)
    except UnicodeDecodeError as err:
        raise HfsplitError(f"{path}: not UTF-8 text (byte {err.start}); save the recipe as UTF-8 YAML") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise HfsplitError(f"{path}: not valid YAML{where} ({getattr(err, 'problem', None) or err}); fix the recipe "
                           "(one `option: value` a line, as recipes/tiny/lora.yaml)") from None
    if loaded is None:
        raise HfsplitError(f"{path}: the recipe is empty; write `option: value` lines (as recipes/tiny/lora.yaml) or "
                           "drop --config")
    if not isinstance(loaded, dict):
        raise HfsplitError(f"{path}: a recipe is a mapping of `option: value` lines (as recipes/tiny/lora.yaml), "
                           f"not a {type(loaded).__name__}")
    return loaded


def recipe_values(path: Path) -> dict:
    """A YAML recipe's options by field name, each unknown key refused by name."""
    loaded = read_recipe(path)
    known = {f.name for f in dataclasses.fields(FinetuneOptions)}
    unknown = sorted(set(k.replace("-", "_") for k in loaded) - known)
    if unknown:
        raise HfsplitError(f"{path}: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return {k.replace("-", "_"): _from_yaml(k.replace("-", "_"), v, path=path) for k, v in loaded.items()}


def options_from(given: dict) -> FinetuneOptions:
    """The options of a run: the defaults, under the built-in tiny demo's recipe when no model is named, under
    the `config` recipe, under the `given` values (flags); validated."""
    given = {k: v for k, v in given.items() if v is not None}
    recipe = recipe_values(Path(given["config"])) if "config" in given else {}
    values = over_recipe(recipe, given)
    if values.get("model") is None:
        values = over_recipe(recipe_values(TINY_RECIPE), values)
    options = FinetuneOptions(**values)
    options.validate()
    return options


def over_recipe(recipe: dict, given: dict) -> dict:
    """`given` over `recipe`; a step's size given one way (--global-batch, or --micro-batches) replaces the recipe's
    of the other way, as a flag overrides a recipe (both given together are refused by `validate`)."""
    other = {"global_batch": "micro_batches", "micro_batches": "global_batch"}
    recipe = {k: v for k, v in recipe.items() if not (k in other and other[k] in given and k not in given)}
    return {**recipe, **given}


def tiny_demo_options(**overrides) -> FinetuneOptions:
    """The built-in tiny demo's options (its bundled recipe), with `overrides` on top: what tests and benches on
    tiny checkpoints start from."""
    return FinetuneOptions(**over_recipe(recipe_values(TINY_RECIPE), overrides))


def options_parser(**kwargs) -> argparse.ArgumentParser:
    parser = OptionParser(**kwargs)
    add_option_arguments(parser)
    return parser


def parse_options(argv: Optional[Sequence[str]] = None) -> FinetuneOptions:
    """Options from the command line (and the YAML recipe it names with `--config`); flags win."""
    parser = options_parser(prog="finetune", description="Fine-tune a Hugging Face causal LM split across the "
                            "launched ranks (accelerate launch / torchrun; one process without a launcher).")
    return options_from(vars(parser.parse_args(argv)))
