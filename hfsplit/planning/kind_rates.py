"""The rates a plan over named GPU kinds is timed with, and where each comes from.

A budget that names kinds (`--max-memory 2xRTX4090`, `RTX4090,RTX3090`) times each device at its kind's expected
rate from the bundled table (`hfsplit.gpu_kinds`: peak dense bf16 × efficiency), and the links between them at the
kinds' GPU-to-GPU bandwidth, instead of the planner's generic unit. Where a run on that kind has measured this
block shape (the calibration cache, keyed by kind, dtype, method and shape: `calibration_key`), the measurement
replaces the table's figure. A launched run measures its own device at once (`hfsplit.load.probes.run_speeds`):
devices of the kind it runs on get the measured rate, and other kinds of a mixed budget the table's ratio to it.
The plan's notes say, per kind, which figure it was timed with.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping, Optional

from hfsplit.gpu_kinds import GpuKind
from hfsplit.planning.costs.cache import read_cache
from hfsplit.planning.links import DEFAULT_LINK, Link, pinned_copy_bandwidth


@dataclass(frozen=True)
class KindRates:
    """What `make_plan` times kind-named devices with.

    Args:
        speeds: relative speed per device key (FLOP/s over the planner's unit).
        link: the link to plan with when the caller gave none: the named devices' (`links.DEFAULT_LINK` when no
            kind is named); None when the caller gave one.
        notes: one line per kind, and one for the link, saying which figures are the table's and which measured.
        bandwidths: bytes/s each kind-named device reads memory at (`GpuKind.expected_memory_bandwidth`), which
            times generation's decode steps.
    """

    speeds: dict
    link: Optional[Link]
    notes: tuple[str, ...]
    bandwidths: dict = field(default_factory=dict)


def calibration_key(config, spec, device_kind: str) -> str:
    """The calibration cache's key: device kind, dtype, method and the block's shape at the spec's micro-batch."""
    return (f"{device_kind}|{spec.dtype}|{spec.method}|r={spec.lora_r}|b={spec.micro_batch_size}"
            f"|s={spec.seq_len}|{config.hidden_size}|{getattr(config, 'intermediate_size', None)}"
            f"|{config.num_attention_heads}|{getattr(config, 'num_key_value_heads', None)}|{config.model_type}" + ("|packed" if spec.packing else ""))


def measured_record(config, spec, kind: GpuKind) -> Optional[dict]:
    """What a run on `kind` measured for this block shape (the calibration cache's record), or None."""
    return read_cache("speed", calibration_key(config, spec, kind.name)) if config is not None else None


def kind_rates(kinds: Mapping[str, GpuKind], *, unit: float, config=None, spec=None,
               given: Optional[Mapping] = None, link_given: bool = False) -> KindRates:
    """Speeds and link for the devices of `kinds` (`hfsplit.budget.budget_kinds`) in planner units of `unit` FLOP/s.

    Args:
        kinds: device key → its GPU kind.
        unit: FLOP/s of speed 1 (`timing.DEVICE_FLOPS`).
        config, spec: the model and step, to find a run's measurement of this block shape (None: table only).
        given: speeds the caller gave (a launched run's calibration): kept, and said so.
        link_given: the caller gave the link (a launched run's probe): no link from the table.
    """
    given = given or {}
    speeds, notes = {}, []
    for kind in dict.fromkeys(kinds.values()):
        devices = [d for d, k in kinds.items() if k == kind]
        where = f"device{'s' if len(devices) > 1 else ''} {device_list(devices)}"
        if all(d in given for d in devices):
            notes.append(f"{where}: {kind.name}, timed at the speed the caller gave (a launched run: measured on "
                         f"its own device), not the table's")
            continue
        record = measured_record(config, spec, kind)
        if record is not None:
            rate = record["flops"] / record["seconds"]
            age = (time.time() - record.get("measured_at", time.time())) / 3600
            notes.append(f"{where}: {kind.name}, {rate / 1e12:.1f} TFLOP/s measured for this block shape by a run "
                         f"on one ({record.get('source', 'probe')}, {age:.0f} h ago; calibration cache), "
                         "not the table's")
        else:
            rate = kind.expected_flops
            notes.append(f"{where}: {kind.describe()}")
        speeds.update({d: rate / unit for d in devices if d not in given})
    named = kinds_link(kinds)
    if named is not None and not link_given:
        slowest = min(kinds.values(), key=lambda k: k.peer_bandwidth)
        how = "NVLink" if slowest.peer_bandwidth > slowest.host_link_bandwidth else slowest.host_link
        notes.append(f"link between devices: {named.bandwidth / 1e9:.0f} GB/s a direction ({slowest.name}'s {how}; "
                     "table, no latency modelled)")
    link = None if link_given else (named or DEFAULT_LINK)
    return KindRates(speeds=speeds, link=link, notes=tuple(notes),
                     bandwidths={d: k.expected_memory_bandwidth for d, k in kinds.items()})


def device_list(devices: list[str]) -> str:
    """"0-7" for a run of consecutive GPU indices, else the keys with commas."""
    if len(devices) > 2 and all(d.isdigit() for d in devices) and \
            [int(d) for d in devices] == list(range(int(devices[0]), int(devices[0]) + len(devices))):
        return f"{devices[0]}-{devices[-1]}"
    return ", ".join(devices)


def kinds_link(kinds: Mapping[str, GpuKind]) -> Optional[Link]:
    """The links of a budget of kinds: rank to rank, the slowest kind's GPU-to-GPU bandwidth; to the host (offloaded
    activations), the slowest kind's host link at a pinned copy's rate (None: no kinds)."""
    if not kinds:
        return None
    return Link(bandwidth=min(k.peer_bandwidth for k in kinds.values()),
                host_bandwidth=min(pinned_copy_bandwidth(k.host_link_bandwidth) for k in kinds.values()))


def measured_speeds(kinds: Mapping[str, GpuKind], budgets: Mapping[str, int], *, measured_flops: float,
                    here: Optional[GpuKind], unit: float) -> dict:
    """A launched run's `device_speeds` from its own measurement `measured_flops` on a device of kind `here`
    (None: no kind of the table): devices of that kind, and devices named by size only, run at the measured rate;
    other kinds of a mixed budget at the table's ratio to it (the measurement scales the whole table). When the
    run's device is none of the budget's kinds (CPU ranks planning 24 GiB devices), the measurement times all:
    it is what runs."""
    if here is None or here not in kinds.values():
        return {key: measured_flops / unit for key in budgets}
    scale = measured_flops / here.expected_flops
    return {key: (kinds[key].expected_flops * scale if key in kinds else measured_flops) / unit for key in budgets}
