"""Command line: `hfsplit plan` — will it fit, and how — before a byte of weights is read."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

from hfsplit.apply import third_party_logs
from hfsplit.budget import format_bytes, local_rank_count, local_share, parse_max_memory, parse_size, torch_gpus
from hfsplit.cli.charts import plan_memory_chart
from hfsplit.cli.ship import COMMANDS as SHIP_COMMANDS, add_ship_parsers, run_ship
from hfsplit.errors import HfsplitError, PlanError
from hfsplit.training.options import (ACCELERATE_CPU_CONFIG, PLANNED, FinetuneOptions, OptionParser,
                                      add_option_arguments, options_from, plan_arguments, training_only_flags)


class WholeFlags(argparse.HelpFormatter):
    """argparse's help, its paragraphs wrapped at spaces only: a flag is never broken at its hyphens."""

    def _fill_text(self, text, width, indent):
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False)


def plan_parser(sub) -> argparse.ArgumentParser:
    """`hfsplit plan`: MODEL, the fine-tuning options a plan depends on (listed; the others are taken unlisted, so
    a recipe's command line plans as it runs), and the flags that only a plan has."""
    p = sub.add_parser("plan", help="plan a split of MODEL over a memory budget (reads config.json only)",
                       description="Will it fit, and how: plan the split a fine-tuning run with these options "
                                   "would make, before a byte of weights is read. Flags override a --config recipe.",
                       formatter_class=WholeFlags,
                       epilog="It also takes the recipe's training options, which change no plan ("
                              + ", ".join(training_only_flags())
                              + "): `python -m hfsplit.finetune --help` says what each does.")
    p.add_argument("model_name", nargs="?", default=None, metavar="MODEL",
                   help="hub name (org/name), local folder, or config.json (default: --model, or the --config recipe's)")
    only = p.add_argument_group("plan options")
    kind = only.add_mutually_exclusive_group()
    kind.add_argument("--full", action="store_const", const="full", dest="method_alias", help="same as --method full")
    kind.add_argument("--qlora", action="store_const", const="qlora", dest="method_alias", help="same as --method qlora")
    kind.add_argument("--inference", action="store_true", help="plan forward only (no gradients, no optimizer)")
    only.add_argument("--reserve", default=None, help="per-device reserve overriding the measured one (default: 0 on "
                                                     "the CPU; on GPUs context + fragmentation + NCCL, hfsplit/planning/reserve.py)")
    only.add_argument("--device-speeds", default=None, help="relative speed per device, e.g. 1,1,0.5 (default: 1 each)")
    only.add_argument("--nproc", type=positive_int, default=None, help="ranks the launch would start, for a --config recipe "
                      "without max_memory (default: one per local GPU, else 2 CPU ranks as the bundled accelerate "
                      "config launches)")
    only.add_argument("--max-seq-len", action="store_true",
                      help="plan the longest sequence this job fits at instead of --seq-len: a binary search on the "
                           "planner, to multiples of 256 tokens, up to the model's max_position_embeddings")
    only.add_argument("--json", action="store_true", help="print the Plan as JSON instead of the table")
    only.add_argument("--png", default=None, help="also draw per-device memory bars into this PNG file (default: no chart)")
    add_option_arguments(p, names=PLANNED)
    return p


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def plan_request(args) -> tuple[str, object, dict, tuple[str, ...]]:
    """(model, budget, make_plan keyword arguments, notes for the plan): the fine-tuning options of the flags (over
    the --config recipe's) planned exactly as the trainer plans them (`plan_arguments`), plus the plan-only flags.
    The budget stays as written, so GPU kinds it names time the plan (`hfsplit.kind_rates`)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(FinetuneOptions)}
    if args.model_name is not None:
        given["model"] = args.model_name
    if args.method_alias is not None:
        if args.method not in (None, args.method_alias):
            raise HfsplitError(f"--{args.method_alias} and --method {args.method} disagree; give one")
        given["method"] = args.method_alias
    if args.inference and args.method:
        raise HfsplitError("--inference plans forward only; drop --method")
    if args.config is None and (given["model"] is None or args.max_memory is None):
        raise HfsplitError("hfsplit plan needs MODEL and --max-memory, or --config RECIPE.yaml")
    options = options_from(given)  # refused in one line before anything loads torch
    check_png_path(args.png)
    budget, notes = options.max_memory, ()
    if budget is None:  # what the recipe does without one: an equal share of what this machine has free
        budget, notes = local_budget(args.nproc)
    devices = parse_max_memory(budget)
    from hfsplit.planning.memory_choices import host_budget  # lazy: it reads models' layouts (torch)

    # A recipe plans as it runs here; a model on numbered devices is planned for GPUs (16-bit, a reserve).
    gpu = None if args.config else any(device != "cpu" for device in devices)
    devices, _ = host_budget(devices, single_process=False)  # a "cpu" entry beside GPUs is their host's RAM
    kwargs = plan_arguments(options, world_size=len(devices), gpu=gpu)
    spec = kwargs["spec"]
    if args.inference:
        spec = replace(spec, method="inference")
    if args.reserve:
        spec = replace(spec, reserve_bytes=parse_size(args.reserve, what="--reserve"))
    return options.model or tiny_model(), budget, {**kwargs, "spec": spec}, notes


def local_budget(nproc: Optional[int]) -> tuple[str, tuple[str, ...]]:
    """(budget, the note saying so) of a recipe without max_memory, launched here on `nproc` ranks (default one
    per local GPU, or the bundled accelerate config's two CPU ranks): each rank's equal share of what this
    machine's devices have free now, as the run takes it (`budget.local_share`)."""
    ranks = nproc or local_rank_count()
    budget = local_share(ranks, ranks_here=ranks)
    share = parse_max_memory(budget)["0"]
    where = "GPU's free memory" if torch_gpus() else "free host RAM (CPU ranks share it)"
    return budget, (f"budget: the recipe sets no max_memory, so this plans what it would run here: {ranks} rank(s), "
                    f"each {format_bytes(share)} of this machine's {where}, measured now (--max-memory plans "
                    f"other devices; --nproc other rank counts)",)


def tiny_model():
    """The recipe's built-in tiny model as its config, all that planning reads: nothing is written (the run writes
    its checkpoint beside its output)."""
    from hfsplit.checkpoint.synthetic import TINY_MODEL, tiny_config  # lazy: as make_plan (run_plan)

    spec = dict(TINY_MODEL)
    config = tiny_config(spec.pop("arch"), **spec)
    config._name_or_path = "tiny-llama"  # what the plan calls it: the folder name the run writes it to
    return config


def run_plan(args) -> int:
    model, budget, kwargs, notes = plan_request(args)
    from hfsplit.checkpoint.resolve import load_config  # lazy: the checkpoint package loads torch

    # the config first: an unknown name fails at once, before the planner (transformers' models) loads
    model = load_config(model) if isinstance(model, str) else model
    from hfsplit.planning.planner import make_plan  # lazy: transformers and the cost model; `plan --help` stays quick

    if args.device_speeds:
        kwargs["device_speeds"] = device_speeds(args.device_speeds, list(parse_max_memory(budget)))
    from hfsplit.load.proof import proven_split  # lazy: the proof builds models (transformers)

    config = model
    verdict = proven_split(config)  # refused by name, with the first block that differs, before anything is planned
    if not verdict.packing and kwargs["spec"].packing:  # as the run turns it off
        kwargs["spec"] = dataclasses.replace(kwargs["spec"], packing=False)
    plan = (longest_plan(make_plan, config, budget, kwargs) if args.max_seq_len
            else make_plan(config, budget, **kwargs))
    if plan.tp > 1:  # the chosen plan shards: its tp proof on this config, refused by name before it is printed
        from hfsplit.load.tp_proof import proven_tp  # lazy: as the proof

        proven_tp(config, plan.tp)
    notes = notes + (() if verdict.packing else (f"packing off for {verdict.model_type}: {verdict.reason}"[:200],))
    plan = dataclasses.replace(plan, notes=notes + plan.notes)
    print(plan.to_json() if args.json else plan.table())
    if args.png:
        try:
            print(f"memory chart: {plan_memory_chart(plan, args.png)}", file=sys.stderr)
        except OSError as err:  # a folder checked at the door, then gone or read-only (/proc)
            raise HfsplitError(f"--png {args.png}: cannot write it ({err.strerror}); pass a path in a folder you "
                               "can write") from None
    return 0


def device_speeds(text: str, devices: list) -> dict:
    """`--device-speeds 1,1,0.5`: each device's relative speed, a finite number above 0, one a device."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0 < v < float("inf") for v in values):
        raise HfsplitError(f"--device-speeds {text!r}: give a number above 0 for each device, e.g. 1,1,0.5 (a device "
                           "half as fast as the others)")
    if len(values) != len(devices):
        raise HfsplitError(f"--device-speeds has {len(values)} values for {len(devices)} devices; give one each")
    return dict(zip(devices, values))


def check_png_path(path: Optional[str]) -> None:
    """`--png PATH` is refused before planning when its folder does not exist."""
    if path is not None and not Path(path).resolve().parent.is_dir():
        raise HfsplitError(f"--png {path}: the folder {Path(path).resolve().parent} does not exist; create it or "
                           "pass a path in an existing folder")


def longest_plan(make_plan, model, budget, kwargs: dict):
    """`--max-seq-len`: the plan at the longest sequence that fits, its length in a note; refused (exit 2) when not
    even 256 tokens fit."""
    from hfsplit.planning.max_seq import MULTIPLE, max_seq_len  # lazy: as make_plan

    plan = max_seq_len(make_plan, model, budget, **kwargs)
    if plan is None:
        raise PlanError(f"{model}: not even {MULTIPLE} tokens fit this budget; plan --seq-len {MULTIPLE} for the "
                        "diagnosis and the changes that fit")
    note = (f"longest sequence that fits: {plan.spec.seq_len} tokens (binary search on the planner, multiples of "
            f"{MULTIPLE}; {MULTIPLE} more do not fit)")
    return dataclasses.replace(plan, notes=(note,) + plan.notes)


def run_check(args) -> int:
    """`hfsplit check MODEL`: the proof's verdict for MODEL's config, one line; 0 when it splits, 2 when refused.
    With `--tp N` (N > 1), also the tp proof on the same config (two child CPU ranks, cached), refused with exit 2."""
    from hfsplit.checkpoint.resolve import load_config  # lazy: the checkpoint package loads torch
    from hfsplit.load.proof import all_verdicts, families_markdown, tp_line, verdict_of  # lazy: transformers, torch

    if args.all:
        print(families_markdown(all_verdicts(progress=True)))
        return 0
    if not args.model:
        raise HfsplitError("check: name a model (hub name, folder or config.json), or pass --all")
    config = load_config(args.model)
    verdict = verdict_of(config)
    print(verdict.line())
    if not verdict.split:
        return 2
    if args.tp <= 1:  # no tp asked: the type-level finding of the tp=2 sweep, which costs no process
        print(tp_line(config))
        return 0
    from hfsplit.load.tp_proof import proven_tp  # lazy: as the proof

    print(proven_tp(config, args.tp).line())
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = OptionParser(prog="hfsplit", description="`hfsplit COMMAND`, run (`hfsplit.cli.commands` lists them)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan_parser(sub)
    sub.add_parser("accelerate-config", help="print the path of the bundled accelerate config for CPU ranks",
                   description="accelerate launch --config_file \"$(hfsplit accelerate-config)\" -m hfsplit.finetune "
                               "runs the built-in demo on two CPU ranks from an installed package")
    check = sub.add_parser("check", help="prove the split of a model equals transformers (its config shrunk, CPU)",
                           description="Build MODEL's config shrunk (same class, flags and layer kinds, tiny sizes), "
                                       "run it whole and split at pp=2 on the CPU, and compare logits and gradients "
                                       "(fp32, 1e-5) and a packed row. Prints the verdict; exit 2 when refused. "
                                       "Cached by the config's hash. With --tp 2, also sharded at tp=2 over two "
                                       "child CPU ranks and compared the same way.")
    check.add_argument("model", nargs="?", help="hub name, local folder or config.json (bundled configs answer offline)")
    check.add_argument("--all", action="store_true", help="every causal-LM type transformers registers, on its "
                                                         "default config: the table of docs/guides/families.md")
    check.add_argument("--tp", type=int, default=1, metavar="N",
                       help="also prove the tensor-parallel split on this config: sharded over two CPU ranks (child "
                            "processes, a few seconds, cached); exit 2 when refused. Default: the type's tp=2 "
                            "finding only")
    add_ship_parsers(sub)
    args = parser.parse_args(argv)
    if args.command == "accelerate-config":
        print(ACCELERATE_CPU_CONFIG)
        return 0
    third_party_logs.install()
    try:
        if args.command == "check":
            return run_check(args)
        return run_ship(args) if args.command in SHIP_COMMANDS else run_plan(args)
    except HfsplitError as exc:  # the API's errors may name the command already (export_gguf's): once is enough
        print(f"hfsplit {args.command}: {str(exc).removeprefix(args.command + ': ')}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
