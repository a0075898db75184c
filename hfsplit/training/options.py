"""Fine-tuning options: one dataclass, settable from a YAML recipe and overridden by flags."""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from ..errors import HfsplitError


@dataclass
class FinetuneOptions:
    """Everything `recipes/finetune.py` can be told. Each field is also a `--flag`.

    Args:
        model: hub name or local folder; None writes and uses the built-in tiny model.
        max_memory: per-rank budget ("2x8GiB"); None gives each rank an equal share of free host memory
            (CPU) or each GPU's free memory.
        dataset: local file (json/jsonl/csv/parquet/txt) or hub name; None uses the bundled tiny alpaca set.
        dataset_format: text | instruction | chat; None detects it from the columns.
        tokenizer: tokenizer name or folder; None uses the model's own, else hfsplit's tiny tokenizer.
        method: full | lora | qlora (LoRA on a bitsandbytes-quantized base; the built-in default is full fine-tuning: a random-init tiny model has nothing for adapters to adapt).
        lora_r, lora_alpha, lora_dropout: LoRA hyper-parameters.
        lora_targets: module names LoRA wraps; None wraps every attention and MLP projection.
        seq_len: tokens per sequence.
        micro_batch_size: sequences per micro-batch.
        micro_batches: micro-batches per optimizer step (gradient accumulation).
        global_batch: sequences per optimizer step over all replicas, instead of micro-batch size × micro-batches ×
            replicas; under --schedule auto the planner also chooses how to cut it (a micro-batch size up to
            --micro-batch-size × a count) by its time model, and the run trains on that cut.
        schedule: auto (the planner picks by its calibrated time model) | 1F1B | GPipe | Interleaved1F1B |
            ZBVZeroBubble | DualPipeV.
        activation_checkpointing: recompute block activations in backward.
        dtype: bfloat16 (mixed precision on GPU) or float32 (default on CPU).
        tp, pp: force tensor-parallel degree / pipeline depth instead of letting the planner choose.
        learning_rate, warmup_steps, weight_decay, max_grad_norm: optimisation.
        max_steps: optimizer steps; epochs sets it from the dataset size when given instead.
        seed: seeds weights of new adapters, data order and dropout.
        eval_every: evaluate on held-out rows every N steps (unset: never).
        output_dir: where metrics, checkpoints and the final model go.
        save_every: save a checkpoint every N steps (unset: only at the end).
        save_total_limit: keep only the newest K checkpoints (0: keep all).
        merge: LoRA runs also write `merged/`, the base model with the adapters folded in (a plain HF model folder).
        resume: "latest" (the newest checkpoint-N in output_dir; a bare `--resume`) or a checkpoint folder: restores weights,
            optimizer, scheduler, RNG and data position on every rank; under another split (budget,
            rank count, pp/tp) the weights and optimizer state are resharded to it. "auto": the latest checkpoint
            if there is one, keeping its global batch (what a torchrun restart does by itself; see training/elastic.py).
        on_nonfinite: skip (drop the step, log it, go on) | stop (end the run with an error naming the step)
            when the loss or the gradient norm is not finite.
        peer_timeout: seconds a rank waits for a peer before it gives up with an error (a dead or hung rank).
        bnb_4bit_quant_type, bnb_4bit_use_double_quant, load_in_8bit: `--method qlora`'s `BitsAndBytesConfig`
            knobs under its own names (NF4 + double quantization by default; compute dtype is --dtype).
        chunked_loss: the last stage runs lm_head and the loss a chunk of tokens at a time (never a whole
            micro-batch's logits); the same loss and gradients.
        quantize_experts: `--method qlora` on an MoE quantizes its fused experts to 4 bits too (on by default).
    """

    model: Optional[str] = None
    max_memory: Optional[str] = None
    dataset: Optional[str] = None
    dataset_format: Optional[str] = None
    tokenizer: Optional[str] = None
    method: str = "full"
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_targets: Optional[list[str]] = None
    seq_len: int = 128
    micro_batch_size: int = 2
    micro_batches: int = 4
    global_batch: Optional[int] = None
    schedule: str = "auto"
    activation_checkpointing: bool = False
    dtype: Optional[str] = None
    tp: Optional[int] = None
    pp: Optional[int] = None
    learning_rate: float = 2e-3
    warmup_steps: int = 10
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_steps: int = 200
    epochs: Optional[int] = None
    seed: int = 0
    eval_every: Optional[int] = None
    output_dir: str = "runs/tiny"
    save_every: Optional[int] = None
    save_total_limit: int = 0
    merge: bool = False
    resume: Optional[str] = None
    on_nonfinite: str = "skip"
    peer_timeout: float = 600.0
    bnb_4bit_quant_type: str = "nf4"
    bnb_4bit_use_double_quant: bool = True
    load_in_8bit: bool = False
    chunked_loss: bool = False
    quantize_experts: bool = field(default=True, metadata={
        "help": "QLoRA on an MoE: its fused experts in 4 bits too, each expert quantized as it is read (off: kept in "
                "--dtype, as transformers + bitsandbytes do)", "group": "method"})
    config: Optional[str] = field(default=None, metadata={"help": "YAML recipe file; flags override it"})

    def validate(self) -> None:
        if self.method not in ("lora", "qlora", "full"):
            raise HfsplitError(f"--method {self.method!r}: choose lora, qlora or full")
        check_qlora_options(self)
        for f in dataclasses.fields(self):  # a string is truthy: "off" would silently turn a switch on
            if f.type in ("bool", bool) and not isinstance(getattr(self, f.name), bool):
                raise HfsplitError(f"--{_flag(f.name)} is on or off (True or False in Python); "
                                   f"got {getattr(self, f.name)!r}")
        if self.on_nonfinite not in ("skip", "stop"):
            raise HfsplitError(f"--on-nonfinite {self.on_nonfinite!r}: choose skip or stop")
        if self.merge and self.method not in ("lora", "qlora"):
            raise HfsplitError("--merge folds LoRA adapters into the base model; it needs --method lora")
        if self.peer_timeout <= 0:
            raise HfsplitError(f"--peer-timeout must be a positive number of seconds (got {self.peer_timeout})")
        for name in ("seq_len", "micro_batch_size", "micro_batches", "max_steps", "lora_r"):
            if getattr(self, name) < 1:
                raise HfsplitError(f"--{_flag(name)} must be at least 1 (got {getattr(self, name)})")
        for name in ("warmup_steps", "weight_decay", "max_grad_norm", "lora_alpha", "save_total_limit", "seed"):
            _check_number(self, name, low=0)
        _check_number(self, "learning_rate", low=0, above=True)
        _check_number(self, "lora_dropout", low=0, high=1)
        # unset: off (or the planner's choice)
        for name in ("eval_every", "save_every", "epochs", "tp", "pp", "global_batch"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise HfsplitError(f"--{_flag(name)} must be at least 1, or left out (got {getattr(self, name)})")


def _flag(name: str) -> str:
    return name.replace("_", "-")


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


def training_spec(options: FinetuneOptions):
    """The one options → TrainingSpec function: what a step of this recipe does, for the planner."""
    import torch

    from ..plan import TrainingSpec

    dtype = options.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    # CPU ranks: no reserve; GPUs: None, measured per device by the planner (hfsplit/reserve.py).
    return TrainingSpec(method=options.method, seq_len=options.seq_len, micro_batch_size=options.micro_batch_size,
                        dtype=dtype, lora_r=options.lora_r,
                        lora_targets=tuple(options.lora_targets) if options.lora_targets else None,
                        activation_checkpointing=options.activation_checkpointing,
                        reserve_bytes=None if torch.cuda.is_available() else 0,
                        bnb_4bit_quant_type=options.bnb_4bit_quant_type,
                        bnb_4bit_use_double_quant=options.bnb_4bit_use_double_quant, load_in_8bit=options.load_in_8bit,
                        chunked_loss=options.chunked_loss, quantize_experts=options.quantize_experts)


def plan_arguments(options: FinetuneOptions, *, world_size: int) -> dict:
    """Keyword arguments of `make_plan` (besides model and budget) for the run `options` describe on
    `world_size` ranks: the trainer and `hfsplit plan --config` both plan with exactly these."""
    # The built-in default demonstrates the pipeline: one stage per rank unless told otherwise.
    pp = options.pp or (world_size if options.model is None and options.tp is None else None)
    return dict(spec=training_spec(options), **batch_arguments(options), schedule=options.schedule,
                tp=options.tp, pp=pp, world_size=world_size, activation_checkpointing=options.activation_checkpointing)


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
    if options.method == "qlora" and options.tp not in (None, 1):
        raise HfsplitError(f"--tp {options.tp} with --method qlora: a 4-bit base is not tensor-parallel here; "
                           "drop --tp (QLoRA splits over pipeline stages and data parallelism)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Pipelined fine-tuning of a split Hugging Face model")
    for f in dataclasses.fields(FinetuneOptions):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool",):
            parser.add_argument(flag, type=_bool, nargs="?", const=True, default=None)  # --merge or --merge off
        elif f.name == "resume":  # a bare --resume means the latest checkpoint
            parser.add_argument(flag, type=str, nargs="?", const="latest", default=None)
        elif f.name == "lora_targets":
            parser.add_argument(flag, type=lambda s: [t.strip() for t in s.split(",") if t.strip()], default=None)
        else:
            parser.add_argument(flag, type=_type_of(f), default=None)
    return parser


def _type_of(f):
    text = str(f.type)
    if "int" in text:
        return int
    if "float" in text:
        return float
    return str


def _from_yaml(name: str, value):
    """A recipe value as its field's type: YAML 1.1 reads `1e-4` (no dot) as a string."""
    field_ = next(f for f in dataclasses.fields(FinetuneOptions) if f.name == name)
    convert = _type_of(field_)
    if isinstance(value, str) and convert in (int, float):
        try:
            return convert(value)
        except ValueError:
            raise HfsplitError(f"{name}: {value!r} is not a number") from None
    return value


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "on", "yes"):
        return True
    if text.lower() in ("0", "false", "off", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not on/off")


def parse_options(argv: Optional[Sequence[str]] = None) -> FinetuneOptions:
    """Options from a YAML recipe (`--config`) overridden by command-line flags."""
    import yaml

    args = {k: v for k, v in vars(_parser().parse_args(argv)).items() if v is not None}
    values: dict = {}
    if "config" in args:
        path = Path(args["config"])
        if not path.is_file():
            raise HfsplitError(f"--config {path}: file not found")
        loaded = yaml.safe_load(path.read_text()) or {}
        known = {f.name for f in dataclasses.fields(FinetuneOptions)}
        unknown = sorted(set(k.replace("-", "_") for k in loaded) - known)
        if unknown:
            raise HfsplitError(f"{path}: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        values.update({k.replace("-", "_"): _from_yaml(k.replace("-", "_"), v) for k, v in loaded.items()})
    values.update(args)
    options = FinetuneOptions(**values)
    options.validate()
    return options
