"""peft's LoRA on a parameter of 4-bit fused experts (`hfsplit.apply.quantized_experts`), with no ΔW of them all.

peft's `ParamWrapper` adapts a 3-D expert parameter by registering `W + s · lhs @ rhs` as a parametrization of it for
each forward, so the experts' forward reads one dense `[E, out, in]` tensor: on 4-bit experts that is every expert
in 16 bits (peft computes it once more when it registers the parametrization). `ParamWrapper` here is the same
wrapper (its adapters, names, init, saving and loading are peft's own) whose forward hands the experts module the
low-rank factors instead (`hfsplit.apply.quantized_experts.adapting`): the 4-bit forward adds `s · (x A_eᵀ) B_eᵀ` to each
routed expert's rows. `register_quantized_experts_lora` maps 4-bit experts to it in a `LoraConfig` (peft's custom
module mapping; not saved with the adapter config, so the adapter folder loads in plain peft).
"""
from __future__ import annotations

import functools

from hfsplit.apply.quantized_experts import QuantizedExperts, adapting
from hfsplit.errors import HfsplitError


def register_quantized_experts_lora(config) -> None:
    """Make peft build this module's `ParamWrapper` for target parameters of 4-bit experts under `config` (a
    LoraConfig)."""
    config._register_custom_module({QuantizedExperts: param_wrapper_class()})


@functools.cache
def param_wrapper_class() -> type:
    """The `ParamWrapper` class, built on first use: peft's LoRA layers import bitsandbytes and torch._inductor
    (~3 s), which the rest of the package imports only where it needs them."""
    from peft.tuners.lora import layer as peft_lora  # lazy: ~3 s import (inductor)

    class ParamWrapper(peft_lora.ParamWrapper):
        """peft's `ParamWrapper` on a parameter of 4-bit experts: the factors go to the experts' forward, applied
        split. Named as peft's: peft nests a second target parameter of the same module only inside a class of
        that name."""

        def forward(self, x, *args, **kwargs):
            self._check_forward_args(x, *args, **kwargs)
            adapters = [a for a in self.active_adapters if a in self.lora_A]
            if self.disable_adapters or not adapters:
                return self.base_layer(x, *args, **kwargs)
            if len(adapters) > 1:
                raise HfsplitError(f"{self.parameter_name} of 4-bit experts: one active LoRA adapter at a time "
                                   f"(active: {', '.join(adapters)})")
            with adapting(self.get_base_layer(), self.parameter_name, split_factors(self, adapters[0])):
                return self.base_layer(x, *args, **kwargs)

        def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
            raise HfsplitError(f"{self.parameter_name}: LoRA on 4-bit experts is not merged into them; save the "
                               "adapter and merge it into the 16-bit checkpoint with peft")

    return ParamWrapper


def split_factors(wrapper, adapter: str):
    """(down `[E, r, in]`, up `[E, out, r]`, scaling) of `adapter` of a peft `ParamWrapper`: each expert's
    `ΔW_e = up_e @ down_e` in the orientation of its matmul (`rows @ W_eᵀ`), whatever the parameter's layout."""
    down = wrapper.lora_A[adapter].weight
    up = wrapper.lora_B[adapter].weight
    down = down.reshape(wrapper.num_experts, -1, down.shape[-1])  # A: [r·E, in] → [E, r, in]
    up = up.reshape(up.shape[0], -1, wrapper.num_experts).permute(2, 0, 1)  # B: [out, r·E] → [E, out, r]
    return down, up, wrapper.scaling[adapter]
