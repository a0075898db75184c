"""Offloaded activation checkpointing: each checkpointed block's saved input waits in host memory.

Under activation checkpointing a block keeps only its input for backward, and that input is what stays on the
device: one hidden state per block and micro-batch in flight (for a 70B model at seq 2048, 40 blocks × 2 micro-batches
× 32 MiB = 2.5 GiB of a 24 GiB card). Unsloth's "offloaded gradient checkpointing" and qlora-pipe move it to host
memory and back before the block's recompute. hfsplit does the same with torch's own pieces:

- `torch.utils.checkpoint` (non-reentrant, the wrapper `apply.checkpointing` already uses) saves
  the block's inputs through whatever `saved_tensors_hooks` surround the call, and only those: the tensors the
  block saves inside are the checkpoint's own placeholders. So a pair of hooks around each checkpointed call
  moves exactly the block's input, and its unpack runs when backward first needs the block: right before the
  recompute.
- Not `torch.autograd.graph.save_on_cpu`: it keeps a CPU tensor where it is (a CPU rank would offload nothing
  and a test could not see the copy), copies back without a side stream, and knows nothing of the next block.

On CUDA the host buffer is pinned and both copies run on a side stream: out in forward beside the block's compute,
and back in backward one block early (when block i's input is brought back for its recompute, block i-1's is
fetched too), so that the copy hides behind block i's recompute. On a CPU rank the same code runs with plain host
copies. A stage after the first keeps its first block's input on the device: the pipeline holds that tensor
for the stage's backward anyway (`planning.stage_costs.kept_input` counts it there).

`HostBytes` counts what a rank holds in host memory (`activation_offload_bytes` in metrics.jsonl); a live-tensor
counter on a CPU rank asks `allocating_host_copy()` to leave the host buffers out of the device's figure.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Callable, Optional

import torch
from torch.distributed.tensor import DTensor

_HOST_ALLOCATIONS = [0]  # > 0 while a host buffer of the offload is being allocated


def allocating_host_copy() -> bool:
    """True while the offload allocates a host buffer: a live-tensor counter of a CPU rank's device memory leaves
    what is created then out (on a GPU the allocator's own peak never sees host memory)."""
    return _HOST_ALLOCATIONS[0] > 0


@contextlib.contextmanager
def host_allocation():
    """What is allocated inside is host memory (`allocating_host_copy` is True meanwhile)."""
    _HOST_ALLOCATIONS[0] += 1
    try:
        yield
    finally:
        _HOST_ALLOCATIONS[0] -= 1


class HostBytes:
    """Bytes of host memory a rank's offloaded block inputs hold: now (`live`) and at the peak since `reset_peak`."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def free(self, nbytes: int) -> None:
        self.live -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.live


class _Saved:
    """One block input as autograd holds it under the offload: on the host (or kept on the device), plus the
    device copy on its way back and the input of the block before it in the same forward (to fetch next)."""

    __slots__ = ("kept", "host", "device", "dtype", "ready", "back", "previous", "__weakref__")

    def __init__(self, *, kept: Optional[torch.Tensor] = None, host: Optional[torch.Tensor] = None,
                 device: Optional[torch.device] = None, previous: Optional[weakref.ref] = None):
        # `previous` is weak: autograd alone decides how long a block's input lives
        self.kept, self.host, self.device, self.previous = kept, host, device, previous
        self.back: Optional[torch.Tensor] = None  # the device copy fetched ahead of need
        self.ready = None  # its CUDA event


class StageOffload:
    """The offload of one stage's checkpointed blocks.

    Args:
        device: the stage's device.
        keep_first: leave the first block's input on the device (a stage that receives its input from another).
        counter: the rank's `HostBytes`, shared by its stages.
    """

    def __init__(self, *, device: torch.device, keep_first: bool, counter: HostBytes):
        self.device, self.keep_first, self.counter = device, keep_first, counter
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._last: tuple[int, Optional[weakref.ref]] = (-1, None)  # the block input packed last

    def checkpoint_function(self, position: int) -> Callable:
        """What the block at `position` in the stage checkpoints with (transformers' `_gradient_checkpointing_func`):
        torch's non-reentrant checkpoint, its saved input through this offload."""
        return functools.partial(self._checkpoint, position)

    def _checkpoint(self, position: int, function, *args, **kwargs):
        pack = functools.partial(self._pack, position)
        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            # early_stop=False: as apply.apply_activation_checkpointing (the whole block recomputes)
            return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, early_stop=False,
                                                     **kwargs)

    def _pack(self, position: int, tensor: torch.Tensor) -> _Saved:
        last_position, last = self._last
        previous = last if last_position == position - 1 else None  # the same forward's block before
        if (position == 0 and self.keep_first) or not _offloadable(tensor, self.device):
            saved = _Saved(kept=tensor, previous=previous)
        else:
            saved = _Saved(host=self._to_host(tensor), device=tensor.device, previous=previous)
            nbytes = saved.host.untyped_storage().nbytes()
            self.counter.add(nbytes)
            weakref.finalize(saved, self.counter.free, nbytes)
        self._last = (position, weakref.ref(saved))
        return saved

    def _unpack(self, saved: _Saved) -> torch.Tensor:
        if saved.kept is not None:
            tensor = saved.kept
        else:
            if saved.back is None:
                self._fetch(saved)
            tensor = self._take(saved)
        previous = saved.previous() if saved.previous is not None else None
        if previous is not None and previous.kept is None and previous.back is None:
            self._fetch(previous)  # the next block backward recomputes: its input comes back meanwhile
        return tensor

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.stream is None:
            with host_allocation():
                host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            return host.copy_(tensor)
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)  # the block's input is complete before it is copied
        with torch.cuda.stream(self.stream):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self.stream)  # its memory is not reused before the copy has read it
        return host

    def _fetch(self, saved: _Saved) -> None:
        """Start bringing `saved`'s input back to the device (on CUDA asynchronously, on the side stream)."""
        back = torch.empty(saved.host.shape, dtype=saved.host.dtype, device=saved.device)
        if self.stream is None:
            saved.back = back.copy_(saved.host)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # `back`'s memory is free to write
        with torch.cuda.stream(self.stream):
            back.copy_(saved.host, non_blocking=True)
            saved.ready = torch.cuda.Event()
            saved.ready.record(self.stream)
        back.record_stream(self.stream)
        saved.back = back

    def _take(self, saved: _Saved) -> torch.Tensor:
        """The device copy of `saved`'s input, once it has arrived; the holder lets go of it (the recompute's graph
        holds it from here, so it goes when the block's backward is done)."""
        back, saved.back = saved.back, None
        if saved.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(saved.ready)
            saved.ready = None
        return back


def _offloadable(tensor: torch.Tensor, device: torch.device) -> bool:
    """A plain floating tensor on the stage's device (a DTensor or an integer tensor stays as it is)."""
    return not isinstance(tensor, DTensor) and tensor.is_floating_point() and tensor.device.type == device.type
