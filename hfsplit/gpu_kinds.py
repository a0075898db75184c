"""GPU kinds a budget may name (`--max-memory 2xRTX4090`, `RTX4090,RTX3090`, `8xH100-80GB`): a bundled table.

Each kind is its memory and the figures the time model needs: peak dense bf16 tensor FLOP/s (fp32 accumulate,
what PyTorch's bf16 matmuls use), memory bandwidth, the host link (PCIe) and the GPU-to-GPU link. Every figure
comes from the vendor's datasheet or architecture whitepaper named in the kind's `source`; where a figure is
derived (sparse → dense, bidirectional → one direction, ECC) the kind's `notes` say how.

Conventions:
- FLOP/s are dense: datasheets print 2:4-sparse figures with an asterisk, and dense is half of it.
- Link bandwidths are per direction, the datasheets' bidirectional figure halved (a pipeline send or an offload
  copy moves one way at a time). PCIe 4.0 x16 is 32 GB/s a direction, 5.0 x16 64 GB/s.
- Memory is the datasheet capacity read in GiB (the memory chips are binary); GDDR6 datacenter cards with ECC on
  by default (L4, L40S, A10G) give 1/16 of it to ECC, which is taken off (what `nvidia-smi` then reports within
  0.1 %). HBM parts report 0.3-0.6 % less than their capacity, which the planner's per-device reserve absorbs.
- `efficiency` turns the peak into the rate a training step is expected to reach: 0.40 unless a kind's notes
  say otherwise (the model FLOPs utilisation well-run transformer training reports on A100/H100, 35-50 %, at
  the low end because LoRA steps at small micro-batches run more non-matmul work). A launched run measures its
  own device (`hfsplit.load.probes`), and that measurement replaces peak × efficiency for its kind.
- `MEMORY_EFFICIENCY` turns the datasheet memory bandwidth into the rate generation's decode steps read weights and
  KV cache at (0.70: streaming reads reach 85-90 % of the datasheet, a decode step's small kernels, dequantized
  4-bit weights among them, less).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union

from hfsplit.errors import BudgetError

GIB = 2**30
GB = 1e9
TFLOPS = 1e12
MEMORY_EFFICIENCY = 0.70
DEFAULT_EFFICIENCY = 0.40
PCIE4_X16 = ("PCIe 4.0 x16", 32 * GB)
PCIE5_X16 = ("PCIe 5.0 x16", 64 * GB)


@dataclass(frozen=True)
class GpuKind:
    """One row of the table.

    Args:
        name: what `--max-memory` takes ("RTX4090"); case, spaces, dashes and underscores are ignored.
        memory_bytes: what a run may plan with before the reserve (see the module's conventions).
        bf16_flops: peak dense bf16 tensor FLOP/s with fp32 accumulate.
        memory_bandwidth: bytes/s of device memory.
        host_link: the link to the host, as the datasheet names it ("PCIe 4.0 x16").
        host_link_bandwidth: bytes/s per direction of that link.
        peer_bandwidth: bytes/s per direction between two such GPUs: NVLink where the board has it, else the host
            link (consumer cards without peer-to-peer go through host memory: no faster than it).
        source: the datasheet or whitepaper every figure comes from.
        notes: how derived figures were derived, and why an efficiency is not the default.
        efficiency: expected fraction of `bf16_flops` a training step reaches.
        aliases: other names `--max-memory` takes for this kind.
        device_names: regular expressions matching what `torch.cuda.get_device_name` reports for it.
    """

    name: str
    memory_bytes: int
    bf16_flops: float
    memory_bandwidth: float
    host_link: str
    host_link_bandwidth: float
    peer_bandwidth: float
    source: str
    notes: str = ""
    efficiency: float = DEFAULT_EFFICIENCY
    aliases: tuple[str, ...] = ()
    device_names: tuple[str, ...] = ()

    @property
    def expected_memory_bandwidth(self) -> float:
        """Bytes/s a decode step is expected to read on this kind (`MEMORY_EFFICIENCY` of the datasheet's)."""
        return self.memory_bandwidth * MEMORY_EFFICIENCY

    @property
    def expected_flops(self) -> float:
        """FLOP/s a training step is expected to reach on this kind before anything was measured."""
        return self.bf16_flops * self.efficiency

    def describe(self) -> str:
        """The figures a plan is timed with, and where they come from."""
        return (f"{self.name}, {self.bf16_flops / TFLOPS:.1f} TFLOP/s peak dense bf16 × efficiency "
                f"{self.efficiency:.2f} = {self.expected_flops / TFLOPS:.1f} TFLOP/s expected, "
                f"{self.memory_bandwidth / GB:.0f} GB/s memory, {self.host_link} {self.host_link_bandwidth / GB:.0f} "
                f"GB/s a direction; table: {self.source}")


def _kind(name: str, *, memory_gib: float, tflops: float, bandwidth_gbs: float, host: tuple[str, float],
          peer_gbs: Optional[float] = None, ecc_default: bool = False, **more) -> GpuKind:
    """A table row from datasheet units; `peer_gbs` is the NVLink figure per direction (None: the host link)."""
    memory = memory_gib * GIB * (15 / 16 if ecc_default else 1)
    return GpuKind(name=name, memory_bytes=int(memory), bf16_flops=tflops * TFLOPS,
                   memory_bandwidth=bandwidth_gbs * GB, host_link=host[0], host_link_bandwidth=host[1],
                   peer_bandwidth=peer_gbs * GB if peer_gbs else host[1], **more)


AMPERE_GA102 = "NVIDIA Ampere GA102 GPU Architecture whitepaper v2.1, appendix table (GeForce RTX 3090 / RTX A6000)"
ADA = "NVIDIA Ada GPU Architecture whitepaper v2.1, appendix table A (GeForce RTX 4090)"
BLACKWELL_RTX = "NVIDIA RTX Blackwell GPU Architecture whitepaper v1.1, appendix table (GeForce RTX 5090)"
A100 = "NVIDIA A100 Tensor Core GPU datasheet (SXM4 columns)"
H100 = "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column)"
SPARSE = "the datasheet's BF16 figure is 2:4-sparse; dense is half"
NVLINK = "NVLink {0} GB/s bidirectional: {1} GB/s a direction"

KINDS: tuple[GpuKind, ...] = (
    _kind("RTX3090", memory_gib=24, tflops=71, bandwidth_gbs=936, host=PCIE4_X16, source=AMPERE_GA102,
          notes="GeForce: fp32-accumulate tensor rate is half the fp16-accumulate one (142)",
          device_names=(r"RTX 3090(?! Ti)",)),
    _kind("RTX4090", memory_gib=24, tflops=165.2, bandwidth_gbs=1008, host=PCIE4_X16, source=ADA,
          notes="GeForce: fp32-accumulate tensor rate is half the fp16-accumulate one (330.3); no peer-to-peer",
          device_names=(r"RTX 4090(?! D)",)),
    _kind("RTX5090", memory_gib=32, tflops=209.5, bandwidth_gbs=1792, host=PCIE5_X16, source=BLACKWELL_RTX,
          notes="GeForce: fp32-accumulate tensor rate is half the fp16-accumulate one (419); no peer-to-peer",
          device_names=(r"RTX 5090",)),
    _kind("RTXA6000", memory_gib=48, tflops=154.8, bandwidth_gbs=768, host=PCIE4_X16,
          source=AMPERE_GA102 + "; NVIDIA RTX A6000 datasheet", aliases=("A6000",),
          notes="the optional NVLink bridge (112.5 GB/s) is not assumed", device_names=(r"RTX A6000",)),
    _kind("L4", memory_gib=24, tflops=121, bandwidth_gbs=300, host=PCIE4_X16, ecc_default=True, efficiency=0.30,
          source="NVIDIA L4 Tensor Core GPU datasheet",
          notes=f"{SPARSE} (242); efficiency 0.30: a 72 W card holds its tensor clocks well below boost under "
                "sustained load", device_names=(r"\bL4\b",)),
    _kind("L40S", memory_gib=48, tflops=362.05, bandwidth_gbs=864, host=PCIE4_X16, ecc_default=True,
          source="NVIDIA L40S GPU datasheet", notes="dense figure as printed (733 with sparsity)",
          device_names=(r"\bL40S\b",)),
    _kind("A10G", memory_gib=24, tflops=70, bandwidth_gbs=600, host=PCIE4_X16, ecc_default=True,
          source="AWS EC2 G5 instance specifications (memory, bandwidth); NVIDIA publishes no A10G datasheet: the "
                 "tensor rate is the one AWS-hosted comparisons give (Baseten, 'NVIDIA A10 vs A10G')",
          notes="an AWS-only variant of the A10 (125 dense) with a lower tensor rate; the least certain row",
          device_names=(r"\bA10G\b",)),
    _kind("A100-40GB", memory_gib=40, tflops=312, bandwidth_gbs=1555, host=PCIE4_X16, peer_gbs=300, source=A100,
          notes="dense figure as printed (624 with sparsity); " + NVLINK.format(600, 300),
          device_names=(r"A100.*40GB",)),
    _kind("A100-80GB", memory_gib=80, tflops=312, bandwidth_gbs=2039, host=PCIE4_X16, peer_gbs=300, source=A100,
          notes="dense figure as printed (624 with sparsity); " + NVLINK.format(600, 300),
          device_names=(r"A100.*80GB",)),
    _kind("H100-80GB", memory_gib=80, tflops=989.5, bandwidth_gbs=3350, host=PCIE5_X16, peer_gbs=450, source=H100,
          notes=f"{SPARSE} (1979); " + NVLINK.format(900, 450), aliases=("H100", "H100-SXM", "H100-SXM5"),
          device_names=(r"H100 80GB HBM3", r"H100-SXM", r"H100 SXM")),
    _kind("H100-PCIE", memory_gib=80, tflops=756.5, bandwidth_gbs=2000, host=PCIE5_X16,
          source="NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe column)",
          notes=f"{SPARSE} (1513); the optional NVLink bridge is not assumed", device_names=(r"H100 PCIe",)),
    _kind("H200", memory_gib=141, tflops=989.5, bandwidth_gbs=4800, host=PCIE5_X16, peer_gbs=450,
          source="NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column)", aliases=("H200-141GB", "H200-SXM"),
          notes=f"{SPARSE} (1979); " + NVLINK.format(900, 450), device_names=(r"\bH200\b",)),
    _kind("B200", memory_gib=180, tflops=2250, bandwidth_gbs=8000, host=PCIE5_X16, peer_gbs=900,
          source="NVIDIA HGX B200 datasheet (per GPU: the board's figures divided by 8)", aliases=("B200-180GB",),
          notes=f"{SPARSE} (4500); " + NVLINK.format(1800, 900) + "; the GPU speaks PCIe 6.0 but HGX/DGX B200 hosts "
                "run 5.0", device_names=(r"\bB200\b",)),
)


KIND_NAMES = tuple(kind.name for kind in KINDS)


def _folded(name: str) -> str:
    """A kind name as compared: upper case, without spaces, dashes, underscores or a leading "NVIDIA"."""
    text = re.sub(r"[\s_\-]+", "", name).upper()
    return text[len("NVIDIA"):] if text.startswith("NVIDIA") and len(text) > len("NVIDIA") else text


_BY_NAME = {_folded(n): kind for kind in KINDS for n in (kind.name, *kind.aliases)}
_AMBIGUOUS = {"A100": ("A100-40GB", "A100-80GB")}


def is_gpu_kind(text: str) -> bool:
    """Whether `text` names a kind of the table (or an ambiguous family of them, which `gpu_kind` refuses)."""
    return _folded(text) in _BY_NAME or _folded(text) in _AMBIGUOUS


def gpu_kind(name: Union[str, GpuKind]) -> GpuKind:
    """The table's row for `name` ("RTX4090", "rtx 4090", "H100-80GB"); BudgetError naming the known kinds."""
    if isinstance(name, GpuKind):
        return name
    folded = _folded(str(name))
    if folded in _AMBIGUOUS:
        raise BudgetError(f"max_memory: {name!r} is ambiguous; write {' or '.join(_AMBIGUOUS[folded])}")
    if folded not in _BY_NAME:
        raise BudgetError(f"max_memory: {name!r} is neither a memory size nor a GPU kind of the table; kinds: "
                          f"{', '.join(KIND_NAMES)} (or give its memory, e.g. '24GiB')")
    return _BY_NAME[folded]


def kind_of_device_name(device_name: str) -> Optional[GpuKind]:
    """The kind a CUDA device reports itself as (`torch.cuda.get_device_name`: "NVIDIA GeForce RTX 4090"), or None
    when the table has no such kind."""
    for kind in KINDS:
        if any(re.search(pattern, device_name, flags=re.IGNORECASE) for pattern in kind.device_names):
            return kind
    return None


def host_link_bandwidth(kind: Union[str, GpuKind]) -> float:
    """Bytes/s one direction of the GPU kind's host link carries at its datasheet rate (PCIe 4.0 x16: 32e9;
    5.0 x16: 64e9): what offloading to host memory moves through. A pinned copy reaches about 80-90 % of it."""
    return gpu_kind(kind).host_link_bandwidth
