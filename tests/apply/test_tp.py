"""The tensor-parallel styles hfsplit reads off a model's `base_model_tp_plan` (apply/tp.py `block_styles`); the
sharded runs themselves are compared with transformers on two ranks (tests/parallel/test_tp_sweep.py,
test_families_split.py)."""
import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import GPTNeoXConfig, LlamaConfig, Phi3Config

from hfsplit.apply.tp import block_styles
from hfsplit.errors import UnsupportedModelError


def layouts(style) -> tuple:
    """(type, input layouts, output layouts) of a torch ParallelStyle."""
    return type(style), tuple(style.input_layouts), tuple(style.output_layouts)


def test_gathered_outputs_and_whole_inputs_map_to_torch_styles_with_replicated_layouts():
    """Phi-3: its fused projections column-wise with the output gathered whole, the next linear row-wise taking a
    whole input; the embedding (unnamed by its plan) vocabulary-sharded under "embed_tokens"."""
    styles = {k: layouts(s) for k, s in block_styles(Phi3Config()).items()}
    gathered = (ColwiseParallel, (Replicate(),), (Replicate(),))
    whole_in = (RowwiseParallel, (Replicate(),), (Replicate(),))
    assert styles == {"layers.*.self_attn.qkv_proj": gathered, "layers.*.mlp.gate_up_proj": gathered,
                      "layers.*.self_attn.o_proj": whole_in, "layers.*.mlp.down_proj": whole_in,
                      "embed_tokens": whole_in}
    llama = {k: layouts(s) for k, s in block_styles(LlamaConfig()).items()}
    assert llama["layers.*.self_attn.q_proj"] == (ColwiseParallel, (Replicate(),), (Shard(-1),))
    assert llama["layers.*.self_attn.o_proj"] == (RowwiseParallel, (Shard(-1),), (Replicate(),))


def test_the_embedding_is_sharded_under_the_name_the_plan_gives_it():
    styles = block_styles(GPTNeoXConfig())
    assert "embed_in" in styles and "embed_tokens" not in styles
    assert layouts(styles["embed_in"]) == (RowwiseParallel, (Replicate(),), (Replicate(),))


def test_a_style_hfsplit_does_not_shard_is_refused_by_name():
    config = LlamaConfig()
    config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.self_attn.q_proj": "mla_kv_a_proj"}
    with pytest.raises(UnsupportedModelError, match=r"'mla_kv_a_proj' of layers\.\*\.self_attn\.q_proj .*use tp=1"):
        block_styles(config)
