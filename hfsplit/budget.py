"""Per-device memory budgets: parse what users write, discover local devices."""
from __future__ import annotations

import re
from typing import Mapping, Union

from hfsplit.errors import BudgetError

BudgetSpec = Union[str, int, Mapping[Union[int, str], Union[int, str]], None]

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)
_REPEAT = re.compile(r"^\s*(\d+)\s*[x×\*]\s*(.+)$", re.IGNORECASE)
_EXAMPLE = 'examples: "24GiB", "4x24GiB", "24GiB,12GiB,12GiB", {0: "24GiB", 1: "12GiB", "cpu": "64GiB"}'


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


def parse_max_memory(spec: BudgetSpec) -> dict[str, int]:
    """Parse a `max_memory` value into `{device: bytes}` with devices in order.

    Args:
        spec: a dict like accelerate's (`{0: "24GiB", "cpu": "64GiB"}`, values in bytes or strings),
            a single size (one device), `"4x24GiB"`, or `"24GiB,12GiB,12GiB"`.

    Returns:
        Ordered dict; GPU indices become "0", "1", ...; "cpu" stays "cpu".
    """
    if spec is None:
        raise BudgetError(f"max_memory: no budget given; {_EXAMPLE}")
    if isinstance(spec, Mapping):
        if not spec:
            raise BudgetError(f"max_memory: the dict is empty; {_EXAMPLE}")
        out = {}
        for key, value in spec.items():
            name = _device_key(key)
            if name == "disk":
                raise BudgetError("max_memory: hfsplit never offloads to disk; drop the 'disk' key")
            out[name] = parse_size(value, what=f"max_memory[{key!r}]")
        return out
    if isinstance(spec, (int, float)):
        return {"0": parse_size(spec, what="max_memory")}
    text = str(spec).strip()
    if not text:
        raise BudgetError(f"max_memory: empty string; {_EXAMPLE}")
    sizes: list[int] = []
    for part in text.split(","):
        repeat = _REPEAT.match(part)
        if repeat:
            count = int(repeat.group(1))
            if count < 1:
                raise BudgetError(f"max_memory: {part.strip()!r} asks for {count} devices; {_EXAMPLE}")
            sizes += [parse_size(repeat.group(2), what=f"max_memory part {part.strip()!r}")] * count
        else:
            sizes.append(parse_size(part, what=f"max_memory part {part.strip()!r}"))
    return {str(i): size for i, size in enumerate(sizes)}


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


def format_bytes(n: float) -> str:
    """Human-readable size in binary units."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def torch_device(device):
    """A device in accelerate's notation (0, "1", "cpu", "cuda:1") or a torch.device, as a torch.device:
    the one device parser (budgets, device maps and the checkpoint reader all use it)."""
    import torch

    if isinstance(device, torch.device):
        return device
    if isinstance(device, int) or (isinstance(device, str) and device.isdigit()):
        return torch.device(int(device))
    return torch.device(device)
