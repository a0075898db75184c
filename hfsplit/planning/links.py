"""What the time model charges beyond FLOPs: the rank-to-rank link, the host link and the fixed cost per schedule
action.

`Link` is the α-β model (a fixed latency per message plus bytes over bandwidth). A launched run
measures it with one small p2p probe (`hfsplit.load.probes.probe_link`); `hfsplit plan` on a machine
without the target devices uses `DEFAULT_LINK`, a datasheet-like figure for a GPU interconnect.

The host link (device ↔ host memory: PCIe on a GPU, a memory copy on a CPU rank) carries offloaded activations.
Until the launch's probe measures it (`hfsplit.load.probes.host_copy_seconds`), its bandwidth is the budget's GPU kind's
host link (`hfsplit.gpu_kinds`) at the share a pinned copy reaches (`pinned_copy_bandwidth`), else `host_link_bandwidth`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """One rank-to-rank link.

    Args:
        bandwidth: bytes per second one message moves at once under way.
        latency_s: fixed seconds per message (launch, handshake), whatever its size.
        measured: whether a probe measured it (printed with the plan).
        action_s: fixed seconds of one schedule action (a stage's forward, backward or weight-gradient pass for
            one micro-batch: the module call and the autograd engine's start), whatever its FLOPs. Measured with
            the link at launch: it is why many small actions (ZBV, Interleaved) can run slower than 1F1B.
        split_backward: compute time of a block's forward + backward with the backward split into input- and
            weight-gradient passes (zero-bubble schedules) over the same with one backward; measured by the
            calibration probe with torch's own split (on CPU ranks about 1.1: two autograd passes, smaller matmuls).
        host_bandwidth: device ↔ host copy rate, measured by the launch's probe (0: the device table's figure).
        host_overlap: whether host copies hide behind compute (a CUDA side stream) or add to it (a CPU rank).
    """

    bandwidth: float
    latency_s: float = 0.0
    measured: bool = False
    action_s: float = 0.0
    split_backward: float = 1.0
    host_bandwidth: float = 0.0  # bytes/s between the device and pinned host memory; 0: `host_link_bandwidth()`
    host_overlap: bool = True  # host copies run on a side stream beside compute (CUDA); False: in line (CPU ranks)

    def send_s(self, nbytes: float) -> float:
        """Seconds to move one message of `nbytes` to a neighbour."""
        return self.latency_s + nbytes / self.bandwidth

    def all_reduce_s(self, nbytes: float, ranks: int, count: int = 1) -> float:
        """Seconds of `count` ring all-reduces of `nbytes` each over `ranks` ranks: each is 2(t-1)
        messages of nbytes/t (reduce-scatter then all-gather), the bandwidth-optimal algorithm NCCL
        and gloo use for large tensors."""
        if ranks < 2 or count < 1:
            return 0.0
        steps = 2 * (ranks - 1)
        return count * steps * self.latency_s + nbytes * count * steps / ranks / self.bandwidth

    def host_copy_s(self, nbytes: float, copies: int, *, compute_s: float) -> float:
        """Seconds `copies` host copies of `nbytes` in all add to `compute_s` of work they run beside: behind
        it on a side stream (only what exceeds it shows, plus each copy's launch), else in line."""
        if copies < 1:
            return 0.0
        moving = nbytes / (self.host_bandwidth or host_link_bandwidth("cuda"))
        launches = copies * HOST_COPY_LATENCY_S
        return launches + (max(moving - compute_s, 0.0) if self.host_overlap else moving)

    def host_gbs_described(self) -> str:
        """The host link's rate and where it comes from, for the plan's notes."""
        rate = self.host_bandwidth or host_link_bandwidth()
        where = "measured by the launch's probe" if self.measured else (
            "the GPU kind's table" if self.host_bandwidth else "`links.host_link_bandwidth`, no GPU kind named")
        return f"{rate / 1e9:.2f} GB/s ({where})"

    def describe(self) -> str:
        """One line for the plan's notes."""
        how = "measured by the launch's p2p probe" if self.measured else "assumed (no probe)"
        return (f"link {self.bandwidth / 1e9:.2f} GB/s, {self.latency_s * 1e6:.0f} µs per message, "
                f"{self.action_s * 1e6:.0f} µs per schedule action, split backward ×{self.split_backward:.2f}, "
                f"host link {(self.host_bandwidth or host_link_bandwidth()) / 1e9:.2f} GB/s"
                f"{'' if self.measured else ' (device table)'} ({how})")


def fit_link(sizes: tuple[int, int], seconds: tuple[float, float]) -> Link:
    """The α-β link through two timed message sizes (small, large): the slope is the bandwidth, the
    small message's remainder the latency. A noisy probe where the large message timed no slower
    falls back to the large message's own rate and no latency."""
    (small, large), (t_small, t_large) = sizes, seconds
    if t_large <= t_small:
        return Link(bandwidth=large / max(t_large, 1e-9), latency_s=0.0, measured=True)
    bandwidth = (large - small) / (t_large - t_small)
    return Link(bandwidth=bandwidth, latency_s=max(t_small - small / bandwidth, 0.0), measured=True)


DEFAULT_LINK = Link(bandwidth=50e9)  # an NVLink-class figure, no latency (the planner without a probe)

# Device ↔ pinned host memory, one direction, as measured by others (nvbandwidth, bandwidthTest): PCIe 4.0 x16
# moves about 25 GB/s of its 32, PCIe 5.0 about 50. A CPU rank's "host link" is a memory copy (one thread).
HOST_LINKS = {"cuda": 25e9, "pcie4": 25e9, "pcie5": 50e9, "pcie3": 12e9, "cpu": 5e9}
HOST_COPY_LATENCY_S = 10e-6  # launching one asynchronous copy and its event (CUDA); a call on a CPU rank


# A pinned copy over PCIe reaches this share of the link's datasheet rate per direction (25 of PCIe 4.0 x16's 32 GB/s).
PINNED_COPY_SHARE = HOST_LINKS["pcie4"] / 32e9


def pinned_copy_bandwidth(datasheet_bandwidth: float) -> float:
    """Bytes per second a pinned device ↔ host copy moves over a host link of `datasheet_bandwidth` (a GPU kind's
    `host_link_bandwidth`, one direction): the figure the time model charges offload with until a probe measures it."""
    return datasheet_bandwidth * PINNED_COPY_SHARE


def host_link_bandwidth(kind: str = "cuda") -> float:
    """Bytes per second between a device of `kind` ("cuda", "pcie5", "cpu", ...) and host memory, from
    `HOST_LINKS` (unknown kinds: a PCIe 4.0 GPU). The one lookup the time model makes for the host link."""
    return HOST_LINKS.get(kind, HOST_LINKS["cuda"])
