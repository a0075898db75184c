"""Families outside the distributed split: single-process `from_pretrained` equals transformers for any
causal LM (the model's own forward runs over whole placed modules); the distributed split refuses them by name."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hfsplit.checkpoint.synthetic import FAMILY_OVERRIDES, nonzero_biases
from hfsplit.errors import UnsupportedModelError
from hfsplit.load.materialize import from_pretrained
from hfsplit.models.families import FAMILIES as FAMILIES_DECLARED, check_supported, family_of
from hfsplit.models.layout import DecoderLayout, decoder_layout, meta_model
from hfsplit.parallel.stage import StageModule
from hfsplit.plan import Stage, StageMemory
from hfsplit.models import varlen
from hfsplit.training.packing import pack_row

VOCAB = 256
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
# What makes each family differ from Llama outside its blocks, with non-default values so a skipped step shows.
FAMILIES = {
    "gpt2": dict(vocab_size=VOCAB, n_layer=3, n_embd=32, n_head=2, n_positions=64, bos_token_id=1, eos_token_id=2),
    "gemma": dict(TINY),  # embedding × sqrt(hidden)
    "gemma2": dict(TINY, final_logit_softcapping=3.0, attn_logit_softcapping=5.0, sliding_window=4),
    "gemma3_text": dict(TINY, sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        final_logit_softcapping=3.0),
    "granite": dict(TINY, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
                    logits_scaling=4.0),
    "cohere": dict(TINY, logit_scale=0.25, tie_word_embeddings=True),
    "cohere2": dict(TINY, logit_scale=0.25, sliding_window=4, tie_word_embeddings=True,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    # Experts stored one by one: hfsplit's reader merges them with transformers' own conversion operations.
    "mixtral": dict(TINY, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen3_moe": dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
    # sinks, sliding and full layers, biased router and experts, a clamp that bites, YaRN rope (synthetic.py's)
    "gpt_oss": dict(TINY, **{k: v for k, v in FAMILY_OVERRIDES["gpt_oss"].items() if k != "layer_types"},
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
}


def write_family(folder, arch: str):
    config = AutoConfig.for_model(arch, **FAMILIES[arch])
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    nonzero_biases(model)  # gpt-oss's expert biases start at zero
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_single_process_equals_transformers(tmp_path, arch):
    folder = write_family(tmp_path / arch, arch)
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    ours = from_pretrained(folder, max_memory={"cpu": "3GiB"})  # planned by the planner, not a given map
    layout = decoder_layout(ours)
    assert set(ours.hf_device_map) == {*layout.before, *layout.after, *layout.outside,
                                       *(f"{layout.layers}.{i}" for i in range(3))}
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
    greedy = dict(max_new_tokens=5, do_sample=False)
    assert torch.equal(ours.generate(ids, **greedy), reference.generate(ids, **greedy))


def test_layout_of_a_model_without_pp_plan():
    config = AutoConfig.for_model("gpt2", **FAMILIES["gpt2"])
    assert decoder_layout(meta_model(config)) == DecoderLayout(
        base="transformer", before=("transformer.wte", "transformer.wpe", "transformer.drop"), layers="transformer.h",
        after=("transformer.ln_f",), outside=("lm_head",))


def test_an_undeclared_family_splits_by_its_own_forward():
    """GPT-2 declares no family: the split runs its own forward (FollowedStage), proven on its config
    (tests/models/test_any_model.py); the declared-family stage refuses it by name."""
    from hfsplit.parallel.followed_stage import FollowedStage
    from hfsplit.parallel.stage import build_stage_module

    config = AutoConfig.for_model("gpt2", **FAMILIES["gpt2"])
    check_supported(config)
    stage = Stage(index=0, pp_rank=0, devices=(("cpu",),), layers=(0, 3), has_embed=True, has_head=True,
                  memory=StageMemory(0, 0, 0, 0, 0), budget=0, time_s=0.0)
    with pytest.raises(UnsupportedModelError, match=r"model_type 'gpt2'.*not declared"):
        StageModule(config=config, stage=stage, tied=False)
    assert isinstance(build_stage_module(config=config, stage=stage, tied=False), FollowedStage)


def test_distributed_split_refuses_a_bidirectional_gemma3_by_name():
    config = AutoConfig.for_model("gemma3_text", **FAMILIES["gemma3_text"], use_bidirectional_attention=True)
    with pytest.raises(UnsupportedModelError, match=r"model_type 'gemma3_text'.*use_bidirectional_attention=True"):
        family_of(config)


@pytest.mark.parametrize("arch", ["llama", "gemma", "gemma2", "granite", "cohere", "gemma3_text", "cohere2", "mixtral", "qwen3_moe",
                                  "gpt_oss"])
def test_one_stage_holding_both_ends_equals_transformers(tiny_checkpoint, arch):
    """The stage builder redoes what the family declares outside its blocks (fast, in-process; the
    multi-process splits are in tests/parallel/test_families_split.py)."""
    folder = str(tiny_checkpoint(arch, tied=arch.startswith("cohere")))
    module, reference = one_stage_and_reference(folder)
    ids = torch.randint(3, module.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(module(ids), reference(ids).logits, rtol=0, atol=1e-5)
    # a packed row [A B C] (examples longer than the sliding windows of 4): each example's logits as alone, under
    # sdpa example by example (models/varlen.py) and with transformers' block-diagonal mask
    ids, positions, alone = packed_row_and_alone(reference, module.config.vocab_size)
    before = varlen.calls()
    with torch.no_grad():
        torch.testing.assert_close(module(ids, position_ids=positions)[0], alone, rtol=0, atol=1e-5)
        assert (varlen.calls() > before) == (module.config._attn_implementation == "sdpa")
        with varlen.block_masks():
            torch.testing.assert_close(module(ids, position_ids=positions)[0], alone, rtol=0, atol=1e-5)


def packed_row_and_alone(reference, vocab_size: int):
    """(ids, position ids) of one packed row of 16 holding examples of 6, 5 and 5 tokens; their logits alone."""
    gen = torch.Generator().manual_seed(3)
    examples = [torch.randint(3, vocab_size, (n,), generator=gen) for n in (6, 5, 5)]
    ids, _, positions = (torch.tensor([x]) for x in pack_row([(e.tolist(), e.tolist()) for e in examples],
                                                             seq_len=16, pad=0))
    with torch.no_grad():
        return ids, positions, torch.cat([reference(e[None]).logits[0] for e in examples])


def one_stage_and_reference(folder: str):
    """One stage holding every block and both ends, loaded by hfsplit's reader; the transformers model."""
    from hfsplit.checkpoint import load_config
    from hfsplit.apply.load import load_stage_weights
    from hfsplit.apply.load import open_reader

    config = load_config(folder)
    stage = Stage(index=0, pp_rank=0, devices=(("cpu",),), layers=(0, config.num_hidden_layers), has_embed=True,
                  has_head=True, memory=StageMemory(0, 0, 0, 0, 0), budget=0, time_s=0.0)
    module = StageModule(config=config, stage=stage, tied=config.tie_word_embeddings)
    needed = [name for name, _ in module.named_parameters()]
    with open_reader(folder, needed=needed, model=meta_model(config)) as reader:
        load_stage_weights(module, reader=reader, device=torch.device("cpu"), dtype=torch.float32)
    return module, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_one_stage_router_loss_equals_transformers(tiny_checkpoint, arch):
    """While carrying (a training step), the stage returns its logits and transformers' router auxiliary loss of
    the forward; otherwise (inference, generation) the logits alone."""
    from hfsplit.parallel.router import carrying

    module, reference = one_stage_and_reference(str(tiny_checkpoint(arch, output_router_logits=True)))
    ids = torch.randint(3, module.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = reference(ids)
        with carrying([module]):
            logits, aux = module(ids)
        assert torch.is_tensor(module(ids))
    torch.testing.assert_close(logits, want.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(aux, want.aux_loss, rtol=1e-6, atol=0)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_tensor_parallel_plans_and_packed_styles_elsewhere_are_refused(arch):
    """Their TP plans shard the fused experts (packed_colwise gate_up_proj, rowwise down_proj under a
    moe_tp_experts module): tp=2 plans, each rank holding half of every expert. packed_colwise anywhere else (a
    fused nn.Linear) is refused by name before anything is built."""
    from hfsplit.errors import PlanError
    from hfsplit.planning.planner import make_plan
    from hfsplit.plan import TrainingSpec

    config = AutoConfig.for_model(arch, **FAMILIES[arch])
    spec = TrainingSpec(method="lora", seq_len=8, dtype="float32")
    one, two = make_plan(config, "64GiB", spec=spec, tp=1), make_plan(config, "2x64GiB", spec=spec, tp=2)
    assert two.tp == 2 and two.stages[0].memory.weights < 0.6 * one.stages[0].memory.weights
    plan = dict(config.base_model_tp_plan)
    plan["layers.*.self_attn.q_proj"] = "packed_colwise"
    config.base_model_tp_plan = plan
    with pytest.raises(PlanError, match=rf"tp=2: {arch}'s tensor-parallel plan uses packed_colwise on "
                                        r"layers\.\*\.self_attn\.q_proj outside fused experts.*use tp=1"):
        make_plan(config, "2x64GiB", spec=spec, tp=2)


def test_tensor_parallel_is_refused_where_the_family_tp_plan_is_wrong(tiny_checkpoint):
    """Cohere with q/k norms (Command R+): a weight per head that transformers' TP plan leaves whole while the
    heads are sharded. The planner keeps it at tp=1 and refuses tp=2 with one line, and so does a hand-made
    tp=2 plan before any weight is read (its pp=2 split is in tests/parallel/test_families_split.py)."""
    from hfsplit.checkpoint import load_config
    from hfsplit.plan import TrainingSpec
    from hfsplit.errors import PlanError
    from hfsplit.parallel.split_model import build_split_model
    from hfsplit.planning.planner import make_plan
    from tests.parallel.cases import hand_plan

    folder = str(tiny_checkpoint("cohere", use_qk_norm=True))
    config = load_config(folder)
    spec = TrainingSpec(method="lora", seq_len=64, dtype="float32", reserve_bytes=0)
    assert make_plan(config, "2x1GiB", spec=spec).tp == 1
    assert make_plan(load_config(str(tiny_checkpoint("cohere"))), "2x1GiB", spec=spec, tp=2).tp == 2
    message = r"tp=2: cohere with use_qk_norm=True .* use tp=1"
    with pytest.raises(PlanError, match=message):
        make_plan(config, "2x1GiB", spec=spec, tp=2)
    with pytest.raises(PlanError, match=message):
        build_split_model(hand_plan(config, tp=2, pp=1, layers=[(0, 4)], schedule="GPipe"), folder, ctx=None)


def test_tensor_parallel_of_an_undeclared_family_is_what_the_tp2_sweep_proved(monkeypatch):
    """A family no one declared (its stages run its own forward) shards only where the tp=2 sweep
    (hfsplit/load/tp_proof.py, its findings in hfsplit/models/tp_proven.json) proved it on the installed
    transformers: StarCoder2 plans at tp=2; Doge, whose plan shards a module the sweep cannot place, is refused in one
    line naming the type, the version and the reason, and so is every type on a transformers the sweep never ran on."""
    import re

    import transformers

    from hfsplit.errors import PlanError
    from hfsplit.models.families import tp_degree_error, tp_findings, valid_tp_degrees
    from hfsplit.models.shrink import shrunk_config
    from hfsplit.plan import TrainingSpec
    from hfsplit.planning.planner import make_plan

    version = transformers.__version__
    spec = TrainingSpec(method="lora", seq_len=64, dtype="float32", reserve_bytes=0)
    proven = shrunk_config(AutoConfig.for_model("starcoder2"))
    assert "starcoder2" in tp_findings(version)["proven"] and "starcoder2" not in FAMILIES_DECLARED
    assert tp_degree_error(proven, 2) is None and 2 in valid_tp_degrees(proven, 2)
    assert make_plan(proven, "2x1GiB", spec=spec, tp=2).tp == 2
    refused = shrunk_config(AutoConfig.for_model("doge"))
    with pytest.raises(PlanError, match=rf"tp=2: doge's split follows the model's own forward, and its "
                                        rf"tensor-parallel split is not proven at tp=2 on transformers "
                                        rf"{re.escape(version)}: its tp=2 stages could not be built "
                                        r"\(UnsupportedModelError: DogeConfig: .*\); use tp=1"):
        make_plan(refused, "2x1GiB", spec=spec, tp=2)
    assert make_plan(refused, "2x1GiB", spec=spec).tp == 1
    monkeypatch.setattr(transformers, "__version__", "99.0.0")
    assert tp_degree_error(proven, 2) == ("tp=2: starcoder2's split follows the model's own forward, and its "
                                          "tensor-parallel split is not proven at tp=2 on transformers 99.0.0; use "
                                          "tp=1 (pipeline stages split it)")


@pytest.mark.parametrize("arch, whole", [("phi3", {"attention", "mlp"}), ("olmo2", {"attention"}), ("llama", set())])
def test_a_rank_runs_whole_what_its_plan_gathers_and_the_cost_model_traces_it_so(arch, whole):
    """Phi-3 gathers its fused qkv and gate_up outputs, OLMo 2 its q/k/v (its q/k norms span every head): each rank
    then runs every head (and Phi-3 the whole MLP width), so the block the cost model traces at tp=2 keeps those."""
    from hfsplit.checkpoint.synthetic import tiny_config
    from hfsplit.models.families import tp_whole_parts
    from hfsplit.planning.costs.layout import rank_layer_config

    config = tiny_config(arch)
    assert tp_whole_parts(config) == whole
    rank = rank_layer_config(config, tp=2)
    assert rank.num_attention_heads == config.num_attention_heads // (1 if "attention" in whole else 2)
    assert rank.intermediate_size == config.intermediate_size // (1 if "mlp" in whole else 2)
