"""Command line: `hfsplit merge` (an adapter folded into its base) and `hfsplit export-gguf` (a model for llama.cpp)."""
from __future__ import annotations

import argparse
import signal
import sys

from hfsplit.budget import DEFAULT_MAX_SHARD_SIZE

COMMANDS = ("merge", "export-gguf")


def add_ship_parsers(sub) -> None:
    """The `merge` and `export-gguf` subcommands."""
    merge = sub.add_parser("merge", help="merge a peft LoRA adapter into its base model (streamed, bounded RAM)",
                           description="Fold a peft LoRA adapter into its base and write a transformers model folder, "
                                       "one tensor at a time: host RAM stays under the largest tensor + the adapter "
                                       "+ 1 GiB. Equal to peft's merge_and_unload; a 4-bit or 8-bit bitsandbytes base "
                                       "is dequantized first (the output is 16-bit).")
    merge.add_argument("base", metavar="BASE", help="base model: a folder or hub name (16-bit or bitsandbytes)")
    merge.add_argument("adapter", metavar="ADAPTER", help="the peft adapter folder (adapter_config.json + weights)")
    merge.add_argument("out", metavar="OUT", help="output folder (written beside, renamed into place when complete)")
    merge.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                       help=f"largest safetensors shard, as save_pretrained (default {DEFAULT_MAX_SHARD_SIZE})")
    gguf = sub.add_parser("export-gguf", help="write a model folder as one GGUF file for llama.cpp (streamed)",
                          description="Convert a transformers model folder (a merged one, say) to GGUF with the gguf "
                                      "package: hyper-parameters, tokenizer and tensors, one tensor at a time.")
    gguf.add_argument("model", metavar="MODEL_DIR", help="a transformers model folder or hub name")
    gguf.add_argument("out", metavar="OUT.gguf", help="the GGUF file to write (renamed into place when complete)")
    gguf.add_argument("--type", dest="gguf_type", default="f16", choices=("f32", "f16", "bf16", "q8_0", "q4_0"),
                      help="tensor type of the matrices (default f16; norms and biases stay f32)")


def run_ship(args: argparse.Namespace) -> int:
    """Run `merge` or `export-gguf`; errors propagate to the CLI's handler (one line, exit 2). SIGTERM unwinds like
    Ctrl-C, so the half-written output is removed."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if args.command == "merge":
        from hfsplit.ship.merge import merge_adapter  # lazy: `hfsplit plan --help` builds this parser without torch

        out = merge_adapter(args.base, args.adapter, args.out, max_shard_size=args.max_shard_size)
    else:
        from hfsplit.ship.gguf_export import export_gguf  # lazy: the same

        out = export_gguf(args.model, args.out, tensor_type=args.gguf_type)
    print(out, file=sys.stdout)
    return 0


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)
