"""Third-party log records that tell a hfsplit user nothing, filtered at their source.

Each entry names one logger and the start of one message: nothing else is silenced, and every other warning of
every library still reaches the user. `install()` is called by the entry points (`hfsplit.finetune`, the
`hfsplit` command) and before hfsplit itself imports bitsandbytes; it is idempotent.

- bitsandbytes 0.50 logs, at import, on CPUs with AVX512-BF16 and without the optional `kernels` package,
  "Failed to load CPU gemm_4bit_forward from kernels-community ..." (once per process: three times in a run of
  two ranks and a launcher). The kernel it failed to load serves only 4-bit matrix-vector products in CPU
  inference (`bitsandbytes::gemv_4bit`), never a training step, and the import happens in every run that
  imports peft. A run that quantizes prints `MISSING_KERNELS_MEANING` instead, once, on rank 0.
- datasets logs "Failed to load JSON from file '...' with error ..." before it raises that same error, which
  hfsplit turns into the one line naming the file, the row and the fix (`hfsplit.training.sources`): the user
  would read the fault twice, the first time as a library's internals.
"""
from __future__ import annotations

import logging
import sys

BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
MISSING_KERNELS = "Failed to load CPU gemm_4bit_forward from kernels-community"
MISSING_KERNELS_MEANING = (
    "bitsandbytes: the optional `kernels` package is not installed, so 4-bit matrix-vector products of CPU "
    "inference use bitsandbytes' built-in kernel (training steps are unaffected; `pip install kernels` for the "
    "faster one)")


class MessageFilter(logging.Filter):
    """Drops the records of one logger whose message starts with `prefix`, and remembers that it did."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith(self.prefix):
            self.dropped += 1
            return False
        return True


_MISSING_KERNELS_FILTER = MessageFilter(MISSING_KERNELS)
# Each filtered logger and its filter.
FILTERS = {BNB_CPU_LOGGER: _MISSING_KERNELS_FILTER,
           "datasets.packaged_modules.json.json": MessageFilter("Failed to load JSON from file")}
_explained = False


def install() -> None:
    """Attach the filters to their loggers (before the libraries log: a logger exists before its module)."""
    for name, filter_ in FILTERS.items():
        logger = logging.getLogger(name)
        if filter_ not in logger.filters:
            logger.addFilter(filter_)


def explain_missing_kernels() -> None:
    """Print what bitsandbytes' missing-kernels warning means, once per process and on rank 0 only, when
    bitsandbytes logged it (call where a run quantizes: elsewhere it means nothing)."""
    global _explained
    if _explained or not _MISSING_KERNELS_FILTER.dropped or rank_of_group() != 0:
        return
    _explained = True
    print(MISSING_KERNELS_MEANING, file=sys.stderr, flush=True)


def rank_of_group() -> int:
    """This process's rank in the joined process group (0 before any: a single process, or before the join)."""
    import torch.distributed as dist  # here: the `hfsplit` command installs the filters before it loads torch

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
