"""The tensor-parallel styles hfsplit reads off a model's `base_model_tp_plan` (apply/tp.py `block_styles`); the
sharded runs themselves are compared with transformers on two ranks (tests/parallel/test_tp_sweep.py,
test_families_split.py)."""
import copy

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import GPTNeoXConfig, LlamaConfig, Phi3Config

from hfsplit.apply.tp import RopeGradSummed, RowwiseOwnOutput, block_styles
from hfsplit.apply.tp_experts import ExpertsParallel
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
    config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.self_attn.q_proj": "local_params"}
    with pytest.raises(UnsupportedModelError, match=r"'local_params' of layers\.\*\.self_attn\.q_proj .*use tp=1"):
        block_styles(config)


def test_transposed_experts_and_mla_keys_map_to_their_styles():
    """Llama 4's experts store [E, in, out]: gate_up_proj packed on dim 2, down_proj split on dim 1 (the intermediate
    dim either way); its shared expert's down projection gives an output of its own. MLA's kv_a_proj_with_mqa stays
    whole with its rope part's gradient summed (DeepSeek-V3.2, GLM-4-MoE-Lite)."""
    from transformers import DeepseekV32Config, Glm4MoeLiteConfig, Llama4TextConfig

    llama4 = block_styles(Llama4TextConfig())
    experts = llama4["layers.*.feed_forward.experts"]
    assert isinstance(experts, ExpertsParallel)
    assert (experts.packed, experts.split) == ({"gate_up_proj": 2}, {"down_proj": 1})
    assert isinstance(llama4["layers.*.feed_forward.shared_expert.down_proj"], RowwiseOwnOutput)
    for config in (DeepseekV32Config(qk_rope_head_dim=16), Glm4MoeLiteConfig(qk_rope_head_dim=8)):
        mla = block_styles(config)["layers.*.self_attn.kv_a_proj_with_mqa"]
        assert isinstance(mla, RopeGradSummed) and mla.rope_dim == config.qk_rope_head_dim


@pytest.fixture
def one_rank_mesh():
    """A real one-rank gloo group and its mesh, in this process (the collectives are then identities, so what this
    checks is the styles' wiring, not the sums: two ranks are the sweep's, tests/parallel/test_tp_sweep.py)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tests.parallel.launcher import free_port

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_llama4_moe_under_its_styles_equals_transformers(one_rank_mesh):
    """Llama 4's MoE under its plan's styles: the experts take the hidden states alone (no routing arguments), and
    the MoE adds the experts' sum into the shared expert's output in place, which autograd refuses on torch's
    row-wise output view; output and every gradient equal the unsharded module's."""
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    from hfsplit.apply.tp import full_tensor

    torch.manual_seed(0)
    config = Llama4TextConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=1)
    whole = Llama4TextMoe(config).float()
    torch.nn.init.normal_(whole.experts.gate_up_proj, std=0.2)
    torch.nn.init.normal_(whole.experts.down_proj, std=0.2)
    split = copy.deepcopy(whole)
    prefix = "layers.*.feed_forward."
    names = {name for name, _ in split.named_modules()}
    plan = {k[len(prefix):]: s for k, s in block_styles(config).items() if k.startswith(prefix)
            and k[len(prefix):] in names}
    parallelize_module(split, one_rank_mesh, plan)
    x = torch.randn(2, 5, 16)
    want, got = whole(x)[0], split(x)[0]
    want.square().sum().backward()
    got.square().sum().backward()
    assert (got - want).abs().max() <= 1e-6
    for (name, p), q in zip(whole.named_parameters(), split.parameters()):
        assert (full_tensor(q.grad) - p.grad).abs().max() <= 1e-6, name
