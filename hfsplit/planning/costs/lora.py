"""LoRA adapters for the cost model's traces, without importing peft.

`import peft` imports bitsandbytes, whose import compiles kernels with `torch.compile` and so loads
torch._inductor: about 3 s of a first `hfsplit plan`, more than the traces themselves. Counting the
bytes of a LoRA block only needs what peft's vanilla `lora.Linear.forward` does (peft 0.21, no
dropout, no DoRA, not merged):

    result = base_layer(x); x = x.to(lora_A.weight.dtype)   # only when the dtypes differ
    result = result + lora_B(lora_A(x)) * scaling;  result = result.to(result_dtype)

`TraceLora` runs exactly those operations on the real block's own linear, so its trace keeps and frees
the same tensors. `tests/planning/test_plan_time.py` holds the block's trace with these adapters equal to its
trace with peft's `inject_adapter_in_model`; the runtime always applies real peft adapters.
"""
from __future__ import annotations

import torch
from torch import nn


class TraceLora(nn.Module):
    """A linear layer with a rank-`r` adapter, as peft's LoRA forward computes it (adapters in fp32)."""

    def __init__(self, base_layer: nn.Linear, r: int, alpha: int, adapter_dtype: torch.dtype, cast_input: bool = True):
        super().__init__()
        self.cast_input = cast_input  # peft's `cast_input_dtype_enabled` (off under hfsplit.apply.autocast)
        self.base_layer = base_layer
        device = base_layer.weight.device
        self.lora_A = nn.Linear(base_layer.in_features, r, bias=False, device=device, dtype=adapter_dtype)
        self.lora_B = nn.Linear(r, base_layer.out_features, bias=False, device=device, dtype=adapter_dtype)
        self.scaling = alpha / r  # peft's default scaling (use_rslora=False)

    @property
    def weight(self) -> torch.Tensor:  # read by forwards that check the layer's dtype (Granite 4's mixers), as peft's
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        result_dtype = result.dtype
        if self.cast_input and x.dtype != self.lora_A.weight.dtype:
            x = x.to(self.lora_A.weight.dtype)
        result = result + self.lora_B(self.lora_A(x)) * self.scaling
        return result.to(result_dtype)


def inject_trace_adapters(block: nn.Module, targets: list[str], *, r: int, alpha: int = 8,
                          adapter_dtype: torch.dtype = torch.float32, cast_input: bool = True) -> None:
    """Wrap every `nn.Linear` of `block` whose name ends with one of `targets` (peft's suffix match) in a
    `TraceLora`. `alpha` is peft's `LoraConfig` default; it scales values only, never bytes. `cast_input=False`
    traces adapters whose input casting is off (a forward under autocast)."""
    chosen = [(name, module) for name, module in block.named_modules()
              if isinstance(module, nn.Linear) and any(name == t or name.endswith("." + t) for t in targets)]
    for name, module in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = block.get_submodule(parent_name) if parent_name else block
        setattr(parent, child, TraceLora(module, r, alpha, adapter_dtype, cast_input))
