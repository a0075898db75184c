"""The merge's host RAM on a base of about 1.8 GB: its peak stays under the largest tensor + the adapter + 1 GiB
(the interpreter, torch and transformers included), and an interrupted merge leaves no output.

`python -m pytest -q -s tests/ship/test_merge_memory.py` prints the measured figures."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.ship.big_base import write_big_adapter, write_big_base

pytestmark = pytest.mark.slow  # a subprocess merging 1.8 GB

# VmHWM, the peak resident set of this process image (ru_maxrss would carry the forking pytest's over the exec).
MEASURE = """
import sys
import torch, transformers, peft, safetensors
from hfsplit.ship.merge import merge_adapter
def hwm():
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
before = hwm()
merge_adapter(sys.argv[1], sys.argv[2], sys.argv[3])
print(before, hwm())
"""


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    root = tmp_path_factory.mktemp("big-merge")
    base, largest = write_big_base(root / "base")
    adapter, adapter_bytes = write_big_adapter(root / "adapter")
    return base, adapter, largest, adapter_bytes


def test_merge_peak_ram_stays_under_the_largest_tensor_plus_the_adapter_plus_1_gib(big, tmp_path):
    base, adapter, largest, adapter_bytes = big
    done = subprocess.run([sys.executable, "-c", MEASURE, base, adapter, tmp_path / "merged"], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    imported, peak = map(int, done.stdout.split()[-2:])
    bound = largest + adapter_bytes + 2**30
    size = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    print(f"\nmerge of a {size / 2**30:.2f} GiB base: peak RSS {peak / 2**30:.2f} GiB (after imports "
          f"{imported / 2**30:.2f} GiB), bound {bound / 2**30:.2f} GiB = largest tensor {largest / 2**30:.2f} GiB "
          f"+ adapter {adapter_bytes / 2**20:.1f} MiB + 1 GiB")
    assert size > 1.5 * 2**30
    assert peak < bound
    written = sum(p.stat().st_size for p in (tmp_path / "merged").glob("*.safetensors"))
    assert abs(written - size) < 2**20 and (tmp_path / "merged" / "model.safetensors").is_file()  # 5GB: one shard


def test_an_interrupted_merge_leaves_no_output(big, tmp_path):
    """SIGTERM to `hfsplit merge` once its first shard is being written: no OUT, no temporary folder."""
    base, adapter, _, _ = big
    proc = subprocess.Popen([sys.executable, "-m", "hfsplit.cli", "merge", base, adapter, tmp_path / "merged"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not list(tmp_path.glob(".merged.tmp-*/*.safetensors")):
        time.sleep(0.05)
    assert list(tmp_path.glob(".merged.tmp-*/*.safetensors")), "the merge never started writing"
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert list(tmp_path.iterdir()) == []


EXPORT = """
import sys
import torch, transformers, gguf, safetensors
from hfsplit.ship.gguf_export import export_gguf
def hwm():
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
before = hwm()
export_gguf(sys.argv[1], sys.argv[2], tensor_type=sys.argv[3])
print(before, hwm())
"""


def test_gguf_export_peak_ram_stays_under_twice_the_largest_tensor_plus_1_gib(big, tmp_path):
    """f16 export of the bf16 base: one tensor read and its f16 copy at a time."""
    from tests.ship.bpe import write_bpe_tokenizer

    base, _, largest, _ = big
    write_bpe_tokenizer(base)  # 400 trained tokens, padded to the 128256 rows as unused tokens
    done = subprocess.run([sys.executable, "-c", EXPORT, base, tmp_path / "model.gguf", "f16"], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    imported, peak = map(int, done.stdout.split()[-2:])
    bound = 2 * largest + 2**30
    print(f"\nexport-gguf f16: peak RSS {peak / 2**30:.2f} GiB (after imports {imported / 2**30:.2f} GiB), bound "
          f"{bound / 2**30:.2f} GiB = 2 × largest tensor + 1 GiB; file {(tmp_path / 'model.gguf').stat().st_size / 2**30:.2f} GiB")
    assert peak < bound
