"""Per-device memory budgets: parse what users write (sizes or GPU kinds of `hfsplit.gpu_kinds`), discover local
devices."""
from __future__ import annotations

import re
from typing import Mapping, NamedTuple, Optional, Union

from hfsplit.errors import BudgetError
from hfsplit.gpu_kinds import KIND_NAMES, GpuKind, gpu_kind, is_gpu_kind

# The largest safetensors shard a save writes unless told (save_pretrained's): here, where the command line reads it
# without the writer (torch).
DEFAULT_MAX_SHARD_SIZE = "5GB"
BudgetSpec = Union[str, int, Mapping[Union[int, str], Union[int, str]], None]


class Device(NamedTuple):
    """One device of a budget: the bytes a plan may use, and the GPU kind when the budget named one."""

    memory: int
    kind: Optional[GpuKind]


_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)
_REPEAT = re.compile(r"^\s*(\d+)\s*[x×\*]\s*(.+)$", re.IGNORECASE)
_KEYED = re.compile(r"^\s*(\d+|cpu|mps|disk|(?:cuda|xpu|npu):\d+)\s*[:=]\s*(.+)$", re.IGNORECASE)
_EXAMPLE = ('examples: "24GiB", "4x24GiB", "24GiB,12GiB,12GiB", "2x24GiB,cpu:64GiB", "0:24GiB,1:12GiB,cpu:64GiB", '
            '"2xRTX4090", "RTX4090,RTX3090", {0: "24GiB", 1: "12GiB", "cpu": "64GiB"}')


def parse_size(value: Union[str, int, float], *, what: str = "size") -> int:
    """Bytes in `value`: an int (bytes) or a string like "24GiB", "512MB" (case-insensitive)."""
    if isinstance(value, bool):
        raise BudgetError(f"{what}: {value!r} is not a memory size; {_EXAMPLE}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise BudgetError(f"{what}: {value!r} must be a positive number of bytes; {_EXAMPLE}")
        return int(value)
    match = _SIZE.match(str(value))
    if not match:
        raise BudgetError(f"{what}: cannot read {value!r} as a memory size; {_EXAMPLE}")
    number, unit = match.groups()
    if unit is None:
        if "." in number:
            raise BudgetError(f"{what}: {value!r} has no unit; write e.g. '{number}GiB'; {_EXAMPLE}")
        unit = "b"
    size = int(float(number) * _UNITS[unit.lower()])
    if size <= 0:
        raise BudgetError(f"{what}: {value!r} must be larger than zero; {_EXAMPLE}")
    return size


def _device_key(key: Union[int, str]) -> str:
    """Canonical device name: 0 → "cuda:0" style index kept as int-like, "cpu" stays "cpu"."""
    if isinstance(key, int) or (isinstance(key, str) and key.isdigit()):
        return str(int(key))
    name = str(key).strip().lower()
    if name in ("cpu", "disk", "mps") or re.fullmatch(r"(cuda|xpu|npu|mps):\d+", name):
        return name
    raise BudgetError(f"max_memory: unknown device key {key!r}; use GPU indices (0, 1, ...) or 'cpu'; {_EXAMPLE}")


def _device(value: Union[str, int, float], *, key: str, what: str) -> Device:
    """One device's budget: a size, or a GPU kind of the table (its memory, and the kind for the time model)."""
    if isinstance(value, str) and is_gpu_kind(value):
        if key in ("cpu", "mps"):
            raise BudgetError(f"{what}: {value!r} is a GPU kind; give device {key!r} a memory size")
        kind = gpu_kind(value)
        return Device(kind.memory_bytes, kind)
    if isinstance(value, str) and value.strip().startswith("-") and _SIZE.match(value.strip()[1:]):
        raise BudgetError(f"{what}: {value!r} is negative; give each device a size larger than zero; {_EXAMPLE}")
    if isinstance(value, str) and not _SIZE.match(value):
        raise BudgetError(f"{what}: cannot read {value!r} as a memory size or a GPU kind; {_EXAMPLE}; GPU kinds: "
                          f"{', '.join(KIND_NAMES)}")
    return Device(parse_size(value, what=what), None)


def parse_devices(spec: BudgetSpec) -> dict[str, Device]:
    """Parse a `max_memory` value into `{device: Device}` (bytes, and the GPU kind where one was named), in order.

    Args:
        spec: a dict like accelerate's (`{0: "24GiB", "cpu": "64GiB"}`, values in bytes, sizes or GPU kinds), a
            single size or kind (one device), `"4x24GiB"`, `"24GiB,12GiB,12GiB"`, `"2xRTX4090"`,
            `"RTX4090,RTX3090"`, or the dict's own form as text: `"0:24GiB,1:12GiB,cpu:64GiB"`; unnamed GPUs may
            end with `cpu:SIZE` (`"2x24GiB,cpu:64GiB"`), the host RAM, as the dict's "cpu" key.
    """
    if spec is None:
        raise BudgetError(f"max_memory: no budget given; {_EXAMPLE}")
    if isinstance(spec, Mapping):
        if not spec:
            raise BudgetError(f"max_memory: the dict is empty; {_EXAMPLE}")
        return _keyed([(_device_key(k), v, f"max_memory[{k!r}]") for k, v in spec.items()])
    if isinstance(spec, (int, float)):
        return {"0": Device(parse_size(spec, what="max_memory"), None)}
    text = str(spec).strip()
    if not text:
        raise BudgetError(f"max_memory: empty string; {_EXAMPLE}")
    parts = [_KEYED.match(part) or part for part in text.split(",")]
    keyed = [p for p in parts if not isinstance(p, str)]
    host = [p for p in keyed if p.group(1).lower() == "cpu"]
    if host and len(host) == len(keyed) < len(parts):  # unnamed GPUs, then the host's RAM: "2x24GiB,cpu:64GiB"
        gpus = parse_devices(",".join(p for p in parts if isinstance(p, str)))
        return {**gpus, **_keyed([("cpu", host[-1].group(2).strip(), f"max_memory part {host[-1].group(0).strip()!r}")])}
    if keyed and len(keyed) < len(parts):
        raise BudgetError(f"max_memory: {text!r} names the devices of some parts and not of others; name all "
                          f"(0:24GiB,1:12GiB) or none (24GiB,12GiB); {_EXAMPLE}")
    if keyed:
        return _keyed([(_device_key(m.group(1)), m.group(2).strip(), f"max_memory part {m.group(0).strip()!r}")
                       for m in keyed])
    devices: list[Device] = []
    for part in parts:
        repeat = _REPEAT.match(part)
        count, value = (int(repeat.group(1)), repeat.group(2)) if repeat else (1, part)
        if count < 1:
            raise BudgetError(f"max_memory: {part.strip()!r} asks for {count} devices; {_EXAMPLE}")
        devices += [_device(value.strip(), key="0", what=f"max_memory part {part.strip()!r}")] * count
    return {str(i): device for i, device in enumerate(devices)}


def _keyed(items: list[tuple[str, object, str]]) -> dict[str, Device]:
    """Devices named by key (the dict form, or "0:24GiB,cpu:64GiB"): each key once, never the disk."""
    out: dict[str, Device] = {}
    for name, value, what in items:
        if name == "disk":
            raise BudgetError("max_memory: hfsplit never offloads to disk; drop the 'disk' key")
        if name in out:
            raise BudgetError(f"max_memory: device {name!r} is given twice; give each device once; {_EXAMPLE}")
        out[name] = _device(value, key=name, what=what)
    return out


def parse_max_memory(spec: BudgetSpec) -> dict[str, int]:
    """Parse a `max_memory` value into `{device: bytes}` with devices in order (`parse_devices` without kinds).

    Returns:
        Ordered dict; GPU indices become "0", "1", ...; "cpu" stays "cpu"; a GPU kind becomes its memory.
    """
    return {name: device.memory for name, device in parse_devices(spec).items()}


def budget_kinds(spec: BudgetSpec) -> dict:
    """`{device: GpuKind}` for the devices `spec` names by GPU kind (none: an empty dict)."""
    return {name: device.kind for name, device in parse_devices(spec).items() if device.kind is not None}


def local_max_memory(reserve_bytes: int = 0) -> dict[str, int]:
    """What local devices report free, less `reserve_bytes` each; the CPU when there is no GPU."""
    import psutil
    import torch

    if torch.cuda.is_available():
        out = {}
        for i in range(torch.cuda.device_count()):
            free, _total = torch.cuda.mem_get_info(i)
            out[str(i)] = max(free - reserve_bytes, 0)
        return out
    return {"cpu": max(psutil.virtual_memory().available - reserve_bytes, 0)}


def local_share(world_size: int, *, ranks_here: int) -> str:
    """What a run without a budget plans with: `world_size` ranks, each an equal share of what this host's devices
    have free (CPU ranks of one host share its RAM: `ranks_here` of them; GPUs are one a rank)."""
    free = local_max_memory()
    sharing = ranks_here if "cpu" in free else 1
    return f"{world_size}x{min(free.values()) // sharing}B"


def check_devices_here(devices: Mapping[str, int], *, what: str = "max_memory") -> None:
    """Refuse, before any weight is read, a device of `devices` (budget keys and their bytes) that this machine
    lacks, with what to pass instead: one process runs on the devices it sees (`hfsplit plan` plans for any)."""
    missing = next((name for name in devices if not device_here(name)), None)
    if missing is None:
        return
    kind = missing.split(":")[0] if ":" in missing else "cuda" if missing.isdigit() else missing
    count = _device_count(kind)
    has = f"no {kind.upper()}" if not count else \
        f"{count} {kind.upper()} device(s) ({', '.join(map(str, range(count)))})"
    elsewhere = sum(v for k, v in devices.items() if k != "cpu")
    host = format_size(devices.get("cpu") or elsewhere)
    raise BudgetError(f"{what}: device {missing} is not present: this machine has {has}; pass "
                      + (f"max_memory={{'cpu': '{host}'}}" if not count else
                         f"budgets for those (max_memory={{0: ..., 'cpu': '{host}'}})")
                      + (" or run on GPUs" if not count else f" or run where device {missing} is"))


def device_here(name: str) -> bool:
    """Whether this process can place tensors on budget device `name` ("cpu", "0", "cuda:1", "mps", "xpu:0")."""
    if name in ("cpu", "disk", "meta"):
        return True
    kind = name.split(":")[0] if ":" in name else "cuda" if name.isdigit() else name
    index = gpu_index(name) or 0
    return index < _device_count(kind)


def _device_count(kind: str) -> int:
    """Devices of `kind` ("cuda", "mps", "xpu", "npu") this process sees."""
    import torch

    if kind == "mps":
        return int(torch.backends.mps.is_available())
    backend = getattr(torch, kind, None)
    return backend.device_count() if backend is not None and backend.is_available() else 0


def format_size(n: int) -> str:
    """`n` bytes as a budget takes it: "4GiB", "1536MiB" (a whole number of the largest unit that divides it)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


def torch_gpus() -> int:
    """How many CUDA devices this process sees."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_rank_count() -> int:
    """Ranks a launch here starts by default: one per GPU, else the bundled accelerate config's two CPU ranks."""
    return torch_gpus() or 2


def format_bytes(n: float) -> str:
    """Human-readable size in binary units."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def gpu_index(device: str) -> Optional[int]:
    """The GPU index a device key names ("0", "cuda:1"), None for any other ("cpu", "mps", "cuda"): the one
    parser of device names for the planner's reserve and a rank's GPU."""
    tail = str(device).rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else None


def torch_device(device):
    """A device in accelerate's notation (0, "1", "cpu", "cuda:1") or a torch.device, as a torch.device:
    the one device parser (budgets, device maps and the checkpoint reader all use it)."""
    import torch

    if isinstance(device, torch.device):
        return device
    if isinstance(device, int) or (isinstance(device, str) and device.isdigit()):
        return torch.device(int(device))
    return torch.device(device)
