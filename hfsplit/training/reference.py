"""The precomputed DPO reference (issue 23, `--reference precomputed`), as TRL's `precompute_ref_log_probs=True`
computes it: before the first step, one no-grad pass of the starting weights over every row the run will train on
(the sampler's order, each replica its share of each step's rows, the pipeline run as for evaluation, with any
LoRA adapters off); the last stage sums each sequence's response log-prob. The table, keyed by the sequence's
number (2i chosen, 2i+1 rejected of pair i: for padded pairs the row's index in the training rows, for packed ones
the rows' `sequences`), so that a resumed, regrouped or data-parallel run finds its values, is gathered on every rank
and written atomically to `reference_logps.safetensors` in the output folder: a restart with the same rows, model and
precision reads it back instead of a second pass (the weights it would run are the trained ones by then). Each
step's loss then reads the table instead of running a reference forward, so full fine-tuning DPO holds one model.
Above `IN_MEMORY_ROWS` rows the ranks read the table memory-mapped from that file rather than holding it.
With --eval-every the pass also covers every held-out row, whose table (`HELD_OUT`, by the row's index in the
held-out rows, its own fingerprint) sits in the same file: full fine-tuning evaluates against it, as TRL
precomputes its eval dataset's reference log-probs.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from hfsplit.training.packing import TokenRows
from hfsplit.training.preference import (adapters_disabled, local_keys, present_keys, reference_reduce,
                                         sequence_values)
from hfsplit.training.precision import compute_precision

REFERENCE_FILE = "reference_logps.safetensors"  # safetensors: reading it back runs no code
HELD_OUT = "held_out_logps"  # the held-out rows' table (--eval-every), beside the training rows' "logps"
IN_MEMORY_ROWS = 1 << 22  # 16 MiB of fp32 log-probs: beyond, the table is read memory-mapped from its file

__all__ = ["HELD_OUT", "IN_MEMORY_ROWS", "REFERENCE_FILE", "precompute_reference", "reference_fingerprint",
           "visited_rows"]


def precompute_reference(run, *, progress: bool = False,
                         in_memory_rows: int = IN_MEMORY_ROWS) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(the reference log-prob of every training sequence the run visits (NaN for the rest), `(sequences,)` fp32
    (`sequence_count`); with --eval-every that of every held-out sequence, else None), on every rank (collective):
    read from the output folder's `reference_logps.safetensors` when every rank finds there both tables for these
    rows, model and precision, else computed by `reference_pass` from the weights as loaded (call it before a
    resume loads trained ones) and written there. `progress`: a tqdm bar over the pass on this rank."""
    rows, held_out = run.batches.rows, run.held_out
    visited = visited_rows(run.batches, steps=run.total_steps)
    needed = visited_sequences(rows, visited)
    path = Path(run.options.output_dir) / REFERENCE_FILE
    fingerprint = reference_fingerprint(rows, run.model.plan.spec, model_path=run.model_path)
    held_print = reference_fingerprint(held_out, run.model.plan.spec, model_path=run.model_path) \
        if held_out is not None else None
    count = sequence_count(rows)
    table = read_table(path, fingerprint, rows=count)
    held_table = read_table(path, held_print, rows=sequence_count(held_out), name=HELD_OUT) \
        if held_out is not None else None
    found = table is not None and not table[needed].isnan().any() and (held_out is None or held_table is not None)
    covered = torch.tensor([int(found)], device=run.model.device)
    dist.all_reduce(covered, op=dist.ReduceOp.MIN)  # every rank reads the file, or every rank runs the pass
    started = time.perf_counter()
    if not covered.item():
        table, held_table = reference_tables(run, visited, progress=progress)
        if dist.get_rank() == 0:
            write_table(path, table, fingerprint, held_out=held_table, held_out_fingerprint=held_print)
        dist.barrier()  # the file is whole before any rank may map it
    done = "read back" if covered.item() else "computed"
    run.metrics.log.write({"step": 0, "reference_logps": done, "reference_rows": len(needed),
                           "reference_held_out_rows": len(held_out) if held_out is not None else 0,
                           "reference_s": time.perf_counter() - started, "reference_file": str(path),
                           "table_rows": len(rows), "planned_pairs": run.model.plan.spec.reference_pairs})
    if dist.get_rank() == 0:
        print(f"reference log-probs of {len(needed)} sequences {done} ({path})", flush=True)
    if count > in_memory_rows:
        mapped = read_table(path, fingerprint, rows=count, mmap=True)
        table = mapped if mapped is not None else table  # a folder this rank cannot see: it keeps its copy
    return table, held_table


def reference_tables(run, visited: torch.Tensor, *, progress: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`reference_pass` over the training rows `visited`, then over every held-out row (None without them)."""
    passes = [(run.batches.rows, visited)]
    if run.held_out is not None:  # the evaluation's pairs: TRL precomputes its eval dataset's too
        passes.append((run.held_out, torch.arange(len(run.held_out))))
    tables = [reference_pass(run.model, rows, order, rows_per_replica=run.rows_per_replica,
                             lora=run.lora_config is not None, progress=progress) for rows, order in passes]
    return tables[0], tables[1] if len(tables) > 1 else None


def sequence_count(rows: TokenRows) -> int:
    """How many sequences the table keys: the rows (padded pairs), or the highest of the rows' `sequences` + 1."""
    return len(rows) if rows.sequences is None else int(rows.sequences.max()) + 1


def visited_sequences(rows: TokenRows, visited: torch.Tensor) -> torch.Tensor:
    """The sequences of the rows `visited` names (padded pairs: the rows themselves), each once."""
    if rows.sequences is None:
        return visited
    numbers = rows.sequences[visited]
    return torch.unique(numbers[numbers >= 0])


def visited_rows(batches, *, steps: int) -> torch.Tensor:
    """The indices of the rows a run's `steps` steps train on, each once, in the order it first meets them."""
    drawn = batches.rows_of_steps(steps).reshape(-1)
    _, first = np.unique(drawn, return_index=True)
    return torch.from_numpy(drawn[np.sort(first)])


def reference_pass(model, rows: TokenRows, order: torch.Tensor, *, rows_per_replica: int, lora: bool,
                   progress: bool = False) -> torch.Tensor:
    """The reference's summed response log-prob of the sequences of the rows `order` names, `(sequence_count,)`
    fp32 (NaN elsewhere), on every rank: no-grad pipeline forwards in the training step's shape (each
    data-parallel replica its `rows_per_replica` of every `dp * rows_per_replica`, the last chunk filled up with
    repeats, which count for nothing), the last stage's log-probs summed into every rank's copy. `lora`: the
    adapters are off (the reference is the base)."""
    dp, coords = model.plan.dp, model.ctx.coords
    chunk = rows_per_replica * dp
    table, packed = torch.full((sequence_count(rows),), float("nan"), dtype=torch.float32), rows.sequences is not None
    bar = tqdm(total=len(order), desc="reference log-probs", unit="row", disable=not progress, leave=False)
    mine = slice(coords.dp * rows_per_replica, (coords.dp + 1) * rows_per_replica)
    for start in range(0, len(order), chunk):
        real = order[start:start + chunk]
        index = real.repeat(-(-chunk // len(real)))[:chunk]  # a short last chunk: its rows again, not counted
        numbers = row_sequences(rows, index).clone()
        numbers[len(real):] = -1
        present = present_keys(numbers)
        batch = rows.select(index[mine])
        values = torch.zeros(len(present), dtype=torch.float32, device=model.device)
        with torch.no_grad(), compute_precision(model), \
                adapters_disabled(model.stages) if lora else contextlib.nullcontext():
            reduced = model.forward(batch.input_ids, position_ids=batch.positions(), reduce=reference_reduce(packed),
                                    targets=batch.labels)  # each micro-batch's logits reduced as they come
        if reduced is not None and coords.tp == 0:
            ran, keys = local_keys(numbers[mine])
            slots = torch.searchsorted(present, ran).to(values.device)
            values[slots] = sequence_values(reduced, keys.to(reduced.device), packed=packed).to(values.device)
        dist.all_reduce(values)  # each sequence from the one replica's last stage that ran it; zeros elsewhere
        table[present] = values.cpu()
        bar.update(len(real))
    bar.close()
    return table


def row_sequences(rows: TokenRows, index: torch.Tensor) -> torch.Tensor:
    """Each position's sequence number in the rows at `index` (padded pairs: the row's index)."""
    if rows.sequences is not None:
        return rows.sequences[index]
    return index[:, None].expand(len(index), rows.seq_len)


def reference_fingerprint(rows: TokenRows, spec, *, model_path: str) -> str:
    """What the reference log-probs depend on: the rows' tokens and labels, the model (its path and config) and
    the precision and quantization its weights run in."""
    digest = hashlib.sha256()
    kept = tuple(t for t in (rows.position_ids, rows.sequences) if t is not None)
    for tensor in (rows.input_ids, rows.labels) + kept:
        digest.update(tensor.contiguous().numpy().tobytes())
    config = Path(model_path) / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    precision = {k: getattr(spec, k, None) for k in ("method", "dtype", "weights_dtype", "full_autocast_dtype",
                                                     "bnb_4bit_quant_type", "bnb_4bit_use_double_quant",
                                                     "load_in_8bit", "quantize_experts", "autocast")}
    digest.update(json.dumps({"model": str(Path(model_path).resolve()), **precision}, sort_keys=True,
                             default=str).encode())
    return digest.hexdigest()


def write_table(path: Path, table: torch.Tensor, fingerprint: str, *, held_out: Optional[torch.Tensor] = None,
                held_out_fingerprint: Optional[str] = None) -> None:
    """The table at `path` as safetensors, its fingerprint in the header's metadata, atomically (a crash leaves the
    old file or none); `held_out`: the held-out rows' table beside it (`HELD_OUT`), with its own fingerprint."""
    tensors, metadata = {"logps": table.contiguous()}, {"fingerprint": fingerprint}
    if held_out is not None:
        tensors[HELD_OUT], metadata[f"{HELD_OUT}_fingerprint"] = held_out.contiguous(), held_out_fingerprint
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def read_table(path: Path, fingerprint: str, *, rows: int, mmap: bool = False,
               name: str = "logps") -> Optional[torch.Tensor]:
    """The table `name` at `path` (the training rows', or `HELD_OUT`) when it is there and for these rows, model
    and precision; else None. `mmap`: the tensor maps the file's bytes instead of copying them (a table too large
    to hold on every rank)."""
    key = "fingerprint" if name == "logps" else f"{name}_fingerprint"
    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get(key) != fingerprint or name not in f.keys() or \
                    tuple(f.get_slice(name).get_shape()) != (rows,):
                return None
            return _mapped_logps(path, rows=rows, name=name) if mmap else f.get_tensor(name)
    except (OSError, SafetensorError):
        return None


def _mapped_logps(path: Path, *, rows: int, name: str = "logps") -> torch.Tensor:
    """The fp32 tensor `name` of a safetensors file, memory-mapped: the format is an 8-byte little-endian header
    length, the JSON header (each tensor's byte offsets within the data), then the data."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        start, _ = json.loads(f.read(length))[name]["data_offsets"]
    return torch.from_numpy(np.memmap(path, dtype=np.float32, mode="c", offset=8 + length + start, shape=(rows,)))
