"""The lazy reader: exact tensors, TP slices, selective shard access, clear errors."""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hfsplit.checkpoint import reader as reader_module
from hfsplit.checkpoint.reader import CheckpointReader
from hfsplit.checkpoint.synthetic import shard_files, tiny_config, write_hub_cache
from hfsplit.errors import CheckpointError

REPO_ROOT = Path(__file__).resolve().parents[2]


def stored_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in shard_files(folder):
        with safe_open(str(folder / shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def meta_model(folder: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def layer0_names(folder: Path) -> set[str]:
    return {k for k in stored_tensors(folder) if k.startswith("model.layers.0.")}


def run_python(code: str, env_extra: dict | None = None) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", **(env_extra or {})}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("sharded", [True, False])
def test_reads_every_tensor_exactly(tiny_checkpoint, sharded):
    folder = tiny_checkpoint("llama", sharded=sharded)
    expected = stored_tensors(folder)
    with CheckpointReader.open(folder) as reader:
        assert set(expected) <= set(reader.keys())
        for name, tensor in expected.items():
            assert reader.shape(name) == tuple(tensor.shape)
            assert reader.dtype(name) == tensor.dtype
            assert torch.equal(reader.read(name), tensor)


def test_read_casts_in_bounded_chunks(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(reader_module, "CHUNK_BYTES", 1000)  # force many chunks
    folder = tiny_checkpoint("llama")
    expected = stored_tensors(folder)
    with CheckpointReader.open(folder) as reader:
        for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight"):
            assert torch.equal(reader.read(name, dtype=torch.bfloat16), expected[name].to(torch.bfloat16))
            assert torch.equal(reader.read(name, dtype=torch.float64), expected[name].double())


@pytest.mark.parametrize("chunk", [1000, 16 * 2**20])
@pytest.mark.parametrize("dim", [0, 1])
def test_read_slice_matches_chunk(tiny_checkpoint, monkeypatch, dim, chunk):
    monkeypatch.setattr(reader_module, "CHUNK_BYTES", chunk)
    folder = tiny_checkpoint("qwen2")  # has 1-D q/k/v biases
    expected = stored_tensors(folder)
    with CheckpointReader.open(folder) as reader:
        for name, tensor in expected.items():
            if tensor.dim() <= dim:
                continue
            for index, part in enumerate(torch.chunk(tensor, 2, dim=dim)):
                got = reader.read_slice(name, dim=dim, index=index, parts=2, dtype=torch.bfloat16)
                assert torch.equal(got, part.to(torch.bfloat16)), (name, index)


def test_read_slice_of_3d_tensor_middle_dim(tmp_path, monkeypatch):
    monkeypatch.setattr(reader_module, "CHUNK_BYTES", 64)
    tensor = torch.randn(5, 6, 7)
    save_file({"x": tensor}, str(tmp_path / "model.safetensors"))
    with CheckpointReader.open(tmp_path) as reader:
        for dim in range(3):
            size = tensor.shape[dim]
            parts = 2 if size % 2 == 0 else size
            for index in range(parts):
                want = torch.chunk(tensor, parts, dim=dim)[index]
                assert torch.equal(reader.read_slice("x", dim=dim, index=index, parts=parts), want)


def test_read_slice_refuses_uneven_split(tiny_checkpoint):
    with CheckpointReader.open(tiny_checkpoint("llama")) as reader:
        with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*not divisible into 3"):
            reader.read_slice("model.norm.weight", dim=0, index=0, parts=3)


def test_tied_lm_head_reads_the_embedding(tiny_checkpoint):
    folder = tiny_checkpoint("llama", tied=True)
    assert "lm_head.weight" not in stored_tensors(folder)
    for model in (None, meta_model(folder)):
        with CheckpointReader.open(folder, model=model) as reader:
            assert reader.checkpoint_name("lm_head.weight") == "model.embed_tokens.weight"
            assert torch.equal(reader.read("lm_head.weight"), reader.read("model.embed_tokens.weight"))


def test_names_equal_model_parameter_names(tiny_checkpoint):
    folder = tiny_checkpoint("mistral")
    model = meta_model(folder)
    with CheckpointReader.open(folder, model=model) as reader:
        assert set(model.state_dict()) <= set(reader.keys())


def test_needed_subset_opens_with_other_shards_deleted(tiny_checkpoint, tmp_path):
    folder = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "ckpt")
    needed = layer0_names(folder)
    expected = {k: v for k, v in stored_tensors(folder).items() if k in needed}
    with CheckpointReader.open(folder) as reader:
        keep = reader.shards_for(needed)
    others = set(shard_files(folder)) - keep
    assert others, "the tiny checkpoint must have shards without layer 0"
    for shard in others:
        (folder / shard).unlink()
    with CheckpointReader.open(folder, needed=needed, model=meta_model(folder)) as reader:
        for name, tensor in expected.items():
            assert torch.equal(reader.read(name), tensor)
    with pytest.raises(CheckpointError, match=sorted(others)[0].replace(".", r"\.")):
        CheckpointReader.open(folder)


# ---- broken checkpoints ------------------------------------------------------------------


def test_index_naming_a_missing_shard(tiny_checkpoint, tmp_path):
    folder = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "ckpt")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = "model-99-of-99.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-99-of-99\.safetensors.*not found.*'model\.norm\.weight'"):
        CheckpointReader.open(folder)


def test_corrupt_shard_header(tiny_checkpoint, tmp_path):
    folder = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "ckpt")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.2.self_attn.q_proj.weight"]
    data = bytearray((folder / shard).read_bytes())
    data[8:40] = b"{not json at all!!!!!!!!!!!!!!!!"
    (folder / shard).write_bytes(bytes(data))
    first_held = min(k for k, v in index["weight_map"].items() if v == shard)
    with pytest.raises(CheckpointError, match=rf"{re.escape(shard)}: corrupt safetensors header.*{re.escape(first_held)}"):
        CheckpointReader.open(folder)


def test_truncated_shard(tiny_checkpoint, tmp_path):
    folder = copy_checkpoint(tiny_checkpoint("llama", sharded=False), tmp_path / "ckpt")
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        CheckpointReader.open(folder)


def test_tensor_the_model_needs_is_missing(tiny_checkpoint, tmp_path):
    folder = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "ckpt")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json.*lacks.*'model\.layers\.1\.mlp\.up_proj\.weight'.*LlamaForCausalLM"):
        CheckpointReader.open(folder, model=meta_model(folder))


def test_index_lists_a_tensor_its_shard_lacks(tiny_checkpoint, tmp_path):
    folder = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "ckpt")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    wrong = next(s for s in shard_files(folder) if s != index["weight_map"]["model.norm.weight"])
    index["weight_map"]["model.norm.weight"] = wrong
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{wrong.replace('.', '[.]')}.*'model\.norm\.weight'.*lacks it"):
        CheckpointReader.open(folder)


def test_shape_disagreeing_with_config(tiny_checkpoint, tmp_path):
    folder = copy_checkpoint(tiny_checkpoint("llama", sharded=False), tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.down_proj\.weight' has shape \[64, 128\].*\[64, 96\]"):
        CheckpointReader.open(folder, model=meta_model(folder))


def test_integer_tensor_for_a_float_parameter(tmp_path):
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama", num_layers=1)
    model = AutoModelForCausalLM.from_config(config)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.int32)
    save_file(state, str(tmp_path / "model.safetensors"))
    config.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.norm\.weight' has dtype torch\.int32"):
        CheckpointReader.open(tmp_path, model=meta_model(tmp_path))


def test_folder_without_safetensors(tmp_path):
    tiny_config("llama").save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"):
        CheckpointReader.open(tmp_path)


# ---- memory and the hub (subprocesses: a fresh RSS peak; hub env read at import) ----------------


# A child's ru_maxrss starts at its parent's peak (pytest's), so the peak is measured
# with Linux's resettable high-water mark instead.
PEAK_RSS = """
def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

def peak_rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak reset")
@pytest.mark.parametrize("dim", [0, 1])
def test_tp_slice_peak_rss_stays_near_the_slice(tmp_path, dim):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(4096, 4096)}, str(path))  # 64 MiB fp32
    out = run_python(PEAK_RSS + f"""
import torch
from hfsplit.checkpoint.reader import CheckpointReader
reader = CheckpointReader.open({str(tmp_path)!r})
reset_peak()
base = peak_rss()
part = reader.read_slice("w", dim={dim}, index=1, parts=4)
print((peak_rss() - base) / part.nbytes)
""")
    ratio = float(out.split()[-1])
    # the 16 MiB slice plus one 8 MiB chunk; reading columns via the mmap costs ~5x (the whole tensor)
    assert ratio < 2.5, ratio


def test_hub_name_resolves_offline_and_downloads_only_needed_shards(tiny_checkpoint, tmp_path):
    source = tiny_checkpoint("llama")
    cache = tmp_path / "hub"
    snapshot = write_hub_cache(cache, "org/tiny-llama", source)
    needed = sorted(layer0_names(source))
    with CheckpointReader.open(source) as reader:
        keep = reader.shards_for(needed)
    for shard in set(shard_files(source)) - keep:
        (snapshot / shard).resolve().unlink()  # the blob: the hub cache now lacks that file
    out = run_python(f"""
        import torch
        from safetensors import safe_open
        from hfsplit.checkpoint.reader import CheckpointReader
        needed = {needed!r}
        with CheckpointReader.open("org/tiny-llama", needed=needed) as reader:
            for name in needed:
                with safe_open({str(source)!r} + "/" + reader.shard_of(name), framework="pt") as f:
                    assert torch.equal(reader.read(name), f.get_tensor(name)), name
        print("ok", len(needed))
    """, {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    assert out.split()[0] == "ok"


# ---- tensors transformers merges on load (MoE experts) -------------------------------------


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_experts_stored_one_by_one_read_merged_as_transformers_loads_them(tiny_checkpoint, tmp_path, arch):
    """`save_pretrained` writes each expert's matrices apart (as the published checkpoints are); the reader
    merges them with transformers' own conversion operations, and a checkpoint stored fused reads as is."""
    from transformers import AutoModelForCausalLM

    folder = tiny_checkpoint(arch)
    stored = stored_tensors(folder)
    assert any(re.search(r"experts\.3\.", k) for k in stored) and not any(k.endswith("gate_up_proj") for k in stored)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(folder / "config.json", fused / "config.json")
    save_file({k: v.contiguous() for k, v in loaded.items()}, str(fused / "model.safetensors"))
    for source in (folder, fused):
        with CheckpointReader.open(source, model=meta_model(source)) as reader:
            assert set(loaded) <= set(reader.keys())
            for name, tensor in loaded.items():
                assert reader.shape(name) == tuple(tensor.shape), name
                assert torch.equal(reader.read(name), tensor), (source, name)
                assert torch.equal(reader.read(name, dtype=torch.bfloat16), tensor.to(torch.bfloat16)), name
    experts = "model.layers.1.mlp.experts.gate_up_proj"
    from hfsplit.checkpoint.merged import split_checkpoint_names

    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    _, merged = split_checkpoint_names(weight_map, meta_model(folder))
    pieces = {k: tuple(v.shape) for k, v in stored.items()}
    # each expert's gate rows, then its up rows, preads straight into the fused tensor (no second copy)
    placed = merged[experts].placement(pieces.__getitem__)
    assert [(index, start) for _, index, _, start in placed] == [(e, 0) for e in range(4)] + [
        (e, pieces[placed[0][0]][0]) for e in range(4)]
    with CheckpointReader.open(folder, model=meta_model(folder)) as reader:
        assert reader.nbytes(experts) == loaded[experts].nbytes
        assert torch.equal(reader.read_slice(experts, dim=1, index=1, parts=2), loaded[experts].chunk(2, dim=1)[1])
        needed = [n for n in loaded if n.startswith("model.layers.1.")]
        keep = reader.shards_for(needed)  # every shard holding one of layer 1's experts, only those
    assert keep == {shard_of for k, shard_of in json.loads((folder / "model.safetensors.index.json").read_text())[
        "weight_map"].items() if k.startswith("model.layers.1.")}
    copied = copy_checkpoint(folder, tmp_path / "stage")
    for shard in set(shard_files(copied)) - keep:
        (copied / shard).unlink()
    with CheckpointReader.open(copied, needed=needed, model=meta_model(copied)) as reader:
        assert torch.equal(reader.read(experts), loaded[experts])


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_expert_tensor_parallel_slices_read_only_their_rows_in_both_layouts(tiny_checkpoint, tmp_path, arch,
                                                                            monkeypatch):
    """A TP rank's pieces of fused experts (apply/tp_experts.py): `gate_up_proj` [E, 2I, H] packed (rank r: its
    part of the gate half, then of the up half), `down_proj` [E, H, I] split on dim 2, from the experts stored one by
    one and stored fused; the packed pieces are preads of exactly their rows (no expert read whole)."""
    from transformers import AutoModelForCausalLM

    folder = tiny_checkpoint(arch)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(folder / "config.json", fused / "config.json")
    save_file({k: v.contiguous() for k, v in loaded.items()}, str(fused / "model.safetensors"))
    gate_up, down = (loaded[f"model.layers.1.mlp.experts.{n}"] for n in ("gate_up_proj", "down_proj"))
    read = []
    real_pread = reader_module._pread_into
    monkeypatch.setattr(reader_module, "_pread_into", lambda fd, buf, *a: read.append(len(buf)) or real_pread(fd, buf, *a))
    for source in (folder, fused):
        with CheckpointReader.open(source, model=meta_model(source)) as reader:
            for tp in (2, 4):
                for rank in range(tp):
                    gate, up = (half.chunk(tp, dim=1)[rank] for half in gate_up.chunk(2, dim=1))
                    read.clear()
                    got = reader.read_slice("model.layers.1.mlp.experts.gate_up_proj", 1, rank, tp, packed=2)
                    assert torch.equal(got, torch.cat([gate, up], dim=1)), (source, tp, rank)
                    if tp == 2:  # runs of a page or more: straight preads of the slice
                        assert sum(read) == got.nbytes, (source, sum(read), got.nbytes)
                    got = reader.read_slice("model.layers.1.mlp.experts.down_proj", 2, rank, tp, dtype=torch.bfloat16)
                    assert torch.equal(got, down.chunk(tp, dim=2)[rank].to(torch.bfloat16)), (source, tp, rank)
            with pytest.raises(CheckpointError, match=r"not divisible into 2 packed blocks of 3 tensor-parallel parts"):
                reader.read_slice("model.layers.1.mlp.experts.gate_up_proj", 1, 0, 3, packed=2)


def test_a_missing_expert_is_named(tiny_checkpoint, tmp_path):
    folder = copy_checkpoint(tiny_checkpoint("mixtral", sharded=False), tmp_path / "ckpt")
    tensors = {k: v for k, v in stored_tensors(folder).items() if "layers.0.block_sparse_moe.experts.3.w1" not in k}
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj' is merged on load from "
                                              r"3 × experts\.\*\.w1\.weight, 4 × experts\.\*\.w3\.weight.*is the checkpoint complete"):
        CheckpointReader.open(folder, model=meta_model(folder))


def test_a_saved_config_with_an_infinite_value_loads_as_transformers_loads_it(tmp_path):
    """transformers writes floats JSON cannot hold as {"__float__": "Infinity"} (Falcon-H1's time_step_limit): hfsplit
    reads the config.json to what AutoConfig.from_pretrained reads, the multimodal check included."""
    from transformers import AutoConfig

    from hfsplit.checkpoint.multimodal import raw_config
    from hfsplit.checkpoint.resolve import load_config

    tiny_config("falcon_h1").save_pretrained(tmp_path)
    assert "Infinity" in (tmp_path / "config.json").read_text()
    expected = AutoConfig.from_pretrained(tmp_path).time_step_limit
    assert expected[1] == float("inf")
    assert load_config(tmp_path).time_step_limit == expected == raw_config(tmp_path / "config.json").time_step_limit
