"""MXFP4 experts (gpt-oss): the checkpoint's packed blocks and scales in transformers' layout, dequantized as read
by transformers' own dequantizer, expert by expert; a blocks tensor without its scales named."""
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from hfsplit.checkpoint import load_config
from hfsplit.checkpoint import reader as reader_module
from hfsplit.checkpoint.mxfp4 import dequantize_expert, pack_experts
from hfsplit.checkpoint.reader import CheckpointReader
from hfsplit.errors import CheckpointError
from hfsplit.models.layout import meta_model
from tests.checkpoint.test_reader import stored_tensors

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def test_packed_blocks_are_transformers_layout():
    """pack_experts is the inverse of transformers' `convert_moe_packed_tensors` on values MXFP4 holds: the
    transposed weight's rows, 32 input values a block, the even value in the low nibble, exponents biased by 127;
    and an expert dequantized alone equals it within the whole tensor."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    weight = torch.randn(3, 64, 96, generator=torch.Generator().manual_seed(0)) * 0.05
    blocks, scales = pack_experts(weight)
    assert blocks.shape == (3, 96, 2, 16) and scales.shape == (3, 96, 2) and blocks.dtype == scales.dtype == torch.uint8
    held = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert held.shape == weight.shape and (held - weight).abs().max() <= weight.abs().max() / 4  # FP4's coarse steps
    again = pack_experts(held)
    assert torch.equal(again[0], blocks) and torch.equal(again[1], scales)
    assert torch.equal(dequantize_expert(blocks[1], scales[1], dtype=torch.float32), held[1])
    lone = torch.zeros(1, 32, 1)
    lone[0, 3, 0] = 6.0 * 2.0 ** -5  # odd input index: the high nibble of byte 1 holds code 7 (6.0), scale 2**-5
    one = pack_experts(lone)
    assert one[0][0, 0, 0, 1].item() == 7 << 4 and one[1].item() == 127 - 5


def test_mxfp4_experts_read_dequantized_as_transformers_loads_them(tiny_checkpoint, monkeypatch):
    """The published layout (`gate_up_proj_blocks` [E, 2I, H/32, 16] + `_scales`, no `gate_up_proj`): the reader
    gives each expert tensor transformers' own dequantization in the dtype asked for (bf16 when none is), the model's
    shape, and reads it expert by expert (no pread larger than one expert's blocks)."""
    folder = tiny_checkpoint("gpt_oss", mxfp4=True)
    stored = stored_tensors(folder)
    assert not [k for k in stored if k.endswith(EXPERTS)] and "model.layers.0.mlp.experts.gate_up_proj_blocks" in stored
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    assert not hasattr(load_config(folder), "quantization_config")  # dropped, as transformers drops it
    sizes = []
    real_pread = reader_module._pread_into
    monkeypatch.setattr(reader_module, "_pread_into", lambda fd, buf, *a: sizes.append(len(buf)) or real_pread(fd, buf, *a))
    with CheckpointReader.open(folder, model=meta_model(load_config(folder))) as reader:
        assert set(loaded) <= set(reader.keys())
        for layer in range(4):
            for leaf in EXPERTS:
                name = f"model.layers.{layer}.{leaf}"
                blocks = stored[name + "_blocks"]
                assert reader.shape(name) == tuple(loaded[name].shape) and reader.dtype(name) == torch.bfloat16
                assert reader.nbytes(name) == blocks.nbytes + stored[name + "_scales"].nbytes
                assert reader.shards_for([name]) == {reader.shard_of(name + "_blocks"), reader.shard_of(name + "_scales")}
                sizes.clear()
                assert torch.equal(reader.read(name, dtype=torch.float32), loaded[name]), name
                assert sizes and max(sizes) <= blocks[0].nbytes, (name, max(sizes))
                assert torch.equal(reader.read(name), loaded[name].to(torch.bfloat16)), name  # exact: FP4 × 2**k
                out = torch.empty(loaded[name].shape)
                assert torch.equal(reader.read_into(name, out), loaded[name])
        down = "model.layers.1.mlp.experts.down_proj"
        assert torch.equal(reader.read_slice(down, 2, 1, 2, dtype=torch.float32), loaded[down].chunk(2, dim=2)[1])


def test_mxfp4_blocks_without_their_scales_are_named(tiny_checkpoint, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("gpt_oss", mxfp4=True, sharded=False), folder)
    tensors = {k: v for k, v in stored_tensors(folder).items() if k != "model.layers.2.mlp.experts.down_proj_scales"}
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: the checkpoint holds 'model\.layers\.2\.mlp\.experts"
                                              r"\.down_proj_blocks' but not '.*down_proj_scales'.*re-download"):
        CheckpointReader.open(folder, model=meta_model(load_config(folder)))
