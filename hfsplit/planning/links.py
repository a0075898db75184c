"""What the time model charges beyond FLOPs: the rank-to-rank link and the fixed cost per schedule action.

`Link` is the α-β model (a fixed latency per message plus bytes over bandwidth). A launched run
measures it with one small p2p probe (`hfsplit.load.probes.probe_link`); `hfsplit plan` on a machine
without the target devices uses `DEFAULT_LINK`, a datasheet-like figure for a GPU interconnect.
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
    """

    bandwidth: float
    latency_s: float = 0.0
    measured: bool = False
    action_s: float = 0.0
    split_backward: float = 1.0

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

    def describe(self) -> str:
        """One line for the plan's notes."""
        how = "measured by the launch's p2p probe" if self.measured else "assumed (no probe)"
        return (f"link {self.bandwidth / 1e9:.2f} GB/s, {self.latency_s * 1e6:.0f} µs per message, "
                f"{self.action_s * 1e6:.0f} µs per schedule action, split backward ×{self.split_backward:.2f} "
                f"({how})")


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
