"""The per-device reserve: memory a device gives up before any tensor of the plan exists.

`max_memory` keeps accelerate's meaning: what the user gives, the plan may use. What the
plan cannot place there is only what the process itself costs on that device beyond the
tensors the cost model counts:

- CPU: nothing. The budget is RAM for tensors; the interpreter and libraries the process
  already holds are not part of it (accelerate's `device_map` counts them nowhere either).
- CUDA: the context (driver, cuBLAS/cuDNN kernels), the caching allocator's fragmentation,
  and NCCL's communication buffers. The context is measured with `torch.cuda.mem_get_info`
  when this process can see the device; the other two need a GPU run to measure and are
  documented constants until `scripts/gpu_check.py` (row "reserve: context / fragmentation /
  NCCL") measures them.
"""
from __future__ import annotations

import functools
from typing import Mapping

from hfsplit.budget import gpu_index

# Measured by others on A100/H100 with torch 2.x: the context alone takes 400–600 MiB. Used when the
# planning process cannot see the GPU (planning on a laptop for a remote cluster).
CUDA_CONTEXT_BYTES = 512 << 20
# NCCL keeps NCCL_BUFFSIZE (4 MiB) per channel and peer; a few channels to the pipeline and TP peers
# come to ~100–300 MiB. gpu_check.py row "reserve: NCCL" is to replace this figure.
NCCL_BUFFER_BYTES = 256 << 20
# The caching allocator rounds blocks up and keeps freed blocks split ("reserved but unallocated" in
# OOM reports). A fixed figure, not a fraction of the budget: the planner's "N devices of X each"
# suggestions search budgets under one reserve, and must stay true at the budget they name.
# gpu_check.py row "reserve: fragmentation" is to replace it.
FRAGMENTATION_BYTES = 256 << 20


def device_reserve_bytes(device: str, *, distributed: bool = True) -> int:
    """Bytes of `device` (a budget key: "cpu", "0", "cuda:1", "mps") the plan cannot use.

    Args:
        device: the device key as `parse_max_memory` returns it.
        distributed: NCCL buffers exist (a multi-rank launch).
    """
    if device in ("cpu", "disk", "meta"):
        return 0
    if device == "mps":
        return 0  # unified memory: as on the CPU, the process already holds its runtime
    context = cuda_context_bytes(_cuda_index(device))
    nccl = NCCL_BUFFER_BYTES if distributed else 0
    return context + nccl + FRAGMENTATION_BYTES


def reserve_for(budgets: Mapping[str, int], *, distributed: bool = True, gpus: bool = True) -> int:
    """The reserve the planner charges every device of `budgets`: the largest device's own figure.

    One figure per plan keeps the planner's per-stage arithmetic unchanged; on a mix of CPU and
    GPU budgets the CPU is charged the GPU's reserve (conservative). The one place saying that a CPU budget has
    no reserve: a "cpu" key, and every key where the ranks run on CPUs (`gpus=False`: gloo ranks' "0", "1"
    budgets are not GPUs).
    """
    if not gpus:
        return 0
    return max((device_reserve_bytes(d, distributed=distributed) for d in budgets), default=0)


@functools.lru_cache(maxsize=None)
def cuda_context_bytes(index: int) -> int:
    """The CUDA context's bytes on GPU `index`: measured when this process sees that GPU, else
    CUDA_CONTEXT_BYTES.

    Measured as the device's used memory right after this process made its context and before
    it allocated any tensor (`torch.cuda.mem_get_info`), less what the device used already
    (other processes), read through NVML where torch offers it.
    """
    import torch

    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return CUDA_CONTEXT_BYTES
    before = _nvml_used(index)
    free, total = torch.cuda.mem_get_info(index)  # creates the context if there is none yet
    if before is None or torch.cuda.memory_allocated(index):
        return CUDA_CONTEXT_BYTES  # cannot separate the context from other users or our own tensors
    return max(total - free - before, 0)


def _nvml_used(index: int):
    """Used bytes of GPU `index` before this process touched it (None without NVML)."""
    import torch

    if torch.cuda.is_initialized():
        return None  # the context exists already: "before" can no longer be read
    try:
        return int(torch.cuda.device_memory_used(index))
    except Exception:  # no pynvml / amdsmi: torch cannot read usage without a context
        return None


def _cuda_index(device: str) -> int:
    return gpu_index(device) or 0
