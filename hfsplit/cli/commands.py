"""`hfsplit`: its commands, named here without loading them, so that `hfsplit --help` answers at once (no torch)."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

# Each command's one-line help, as `hfsplit --help` lists it; `hfsplit.cli.plan` parses and runs them all.
COMMANDS = {
    "plan": "plan a split of MODEL over a memory budget (reads config.json only)",
    "check": "prove the split of MODEL equals transformers on its config, shrunk (CPU, cached)",
    "merge": "merge a LoRA adapter into its base model, tensor by tensor (bounded host RAM)",
    "export-gguf": "write a model folder as one GGUF file (f16, bf16, f32, q8_0, q4_0) for llama.cpp",
    "accelerate-config": "print the path of the bundled accelerate config for CPU ranks",
}
DESCRIPTION = ("Plan, load and fine-tune Hugging Face causal LMs split across GPUs that are each too small: "
               "`hfsplit plan` says will it fit, and how, before a byte of weights is read. Fine-tuning is "
               "`python -m hfsplit.finetune` (its --help lists every option).")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run `hfsplit COMMAND ...`; its exit code. Without a command (`--help`, a typo) only this light parser
    answers: the command's own module, and torch with it, loads only when a command runs."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        from hfsplit.cli.plan import main as run  # lazy: `hfsplit --help` loads no torch (under 1 s)

        return run(argv)
    parser = argparse.ArgumentParser(prog="hfsplit", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help in COMMANDS.items():
        sub.add_parser(name, help=help, add_help=False)
    parser.parse_args(argv)  # --help, or argparse's error naming the commands
    return 2
