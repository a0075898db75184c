"""Host memory of CPU ranks: make glibc's malloc hand freed tensor memory back, so RSS follows the live tensors.

On CPU, torch allocates every tensor with malloc. glibc serves a block above its mmap threshold with its own
mmap (unmapped on free), and smaller ones from its heaps, which keep freed memory for reuse. The threshold is
dynamic: each time a mapped block is freed, glibc raises it to that block's size, up to 32 MiB. After the first
steps, a training step's activations (SmolLM2-135M at seq 512 x micro-batch 4: 4.5-12 MiB each) all come from
the heaps, and the freed ones stay resident in pieces no later request fits: measured peak RSS 1.99x the live
tensors (scripts/bench_memory.py), where the plan predicts the live tensors (as a GPU's allocator peak).
A fixed threshold (which turns the dynamic one off) gives each large block its own mapping again: 1.04x, but
each block is then faulted in afresh: that step took 113 s against 90 s (one run each on a shared machine). So it
is opt-in: `HFSPLIT_MMAP_THRESHOLD=65536` on CPU ranks that must stay within a RAM budget.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
ENV = "HFSPLIT_MMAP_THRESHOLD"  # bytes, e.g. 65536; unset or 0 leaves glibc's dynamic threshold alone


def fix_mmap_threshold(threshold: int | None = None) -> bool:
    """Set glibc's mmap threshold to `threshold` bytes (default `$HFSPLIT_MMAP_THRESHOLD`) for this process.

    Returns whether it was set: False without glibc (macOS, musl) or with no threshold / 0.
    """
    if threshold is None:
        threshold = int(os.environ.get(ENV) or 0)
    if threshold <= 0:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        libc = None
    mallopt = getattr(libc, "mallopt", None)
    return bool(mallopt and mallopt(M_MMAP_THRESHOLD, int(threshold)) == 1)
