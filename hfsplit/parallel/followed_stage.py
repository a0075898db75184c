"""A pipeline stage that runs the model's own forward: any decoder-only causal LM, no family declared.

The whole causal LM is built on the meta device and kept as it is, except that what this stage does not hold is
swapped for stand-ins without parameters: the blocks of other stages for `SkippedBlock`, and the modules before or
after the blocks (embeddings, final norm, lm_head, GPT-2's positional embeddings, Gemma 3n's AltUp projections) for
`AbsentModule`, which gives zeros of the shape the real module would give. Then the model's own `forward` runs on
every stage: whatever it computes around and between its blocks (embedding and logit scales, soft-capping, rotary
tables per layer type, masks per layer type, packed rows found from the position ids) is the model's own code, so
nothing is re-implemented per family. Two of the stand-in blocks make it a stage, both outside the real blocks (so an
activation-checkpointing recompute sees the real inputs):

- on a stage after the first, the block just before its own hands the first of them the hidden state the previous
  stage sent (the forward is given zero embeddings of the right shape, so its masks and rotary tables are built as
  usual);
- on a stage before the last, the block just after its own ends the forward (`_StageEnd`) with the hidden state the
  model's loop passes it, skipping the rest.

Per-layer inputs the decoder computes before its blocks (Gemma 3n, Gemma 4) cross the boundary with the hidden state,
in one tensor (`packed_boundary`). What this cannot carry is other state one block hands a later block (Gemma 3n's
keys/values reused by its last blocks: refused where a boundary falls between them; Zaya's router states): such a
model computes differently split, which the proof on the user's config (`hfsplit.load.proof`) finds and refuses by
name. Parameter names stay the checkpoint keys.
"""
from __future__ import annotations

import inspect
import re
from typing import Optional

import torch
import torch.utils._pytree as pytree
from torch import nn

from hfsplit.errors import UnsupportedModelError
from hfsplit.models.boundary import streams_first, text_hidden_size
from hfsplit.models.layout import decoder_layout, meta_model
from hfsplit.models.packed_masks import builds_masks_blind, packed_inputs
from hfsplit.models.packed_recurrence import run_examples_alone
from hfsplit.models.varlen import is_packed
from hfsplit.plan import Stage


class _Relay:
    """What crosses this stage's edges during its forward: the hidden state received, and the per-layer inputs
    received or computed here (None outside a forward)."""

    def __init__(self):
        self.received = None
        self.carried = None
        self.running = False


class SkippedBlock(nn.Module):
    """A block another stage holds. The one just before this stage's blocks hands the first of them the hidden
    state the previous stage sent (shaped as the block's own output: a tensor, or a tuple with it first); the one just
    after ends the forward with its input, the output of this stage's last block as the model's loop passed it on.
    Both act outside the real blocks, so an activation-checkpointing recompute sees the real inputs. Others pass
    their input on, unused."""

    def __init__(self, index: int, *, relay: _Relay, role: Optional[str] = None, arity: int = 0,
                 like: Optional[nn.Module] = None):
        super().__init__()
        self.layer_idx = index
        # the plain attributes a decoder's loop may read off its blocks (Nemotron-H's `block_type`)
        for key, value in vars(like or {}).items():
            if not key.startswith("_") and key != "training" and isinstance(value, (str, int, float, bool)):
                setattr(self, key, value)
        self._relay, self._role, self._arity = relay, role, arity

    def forward(self, hidden_states=None, *args, **kwargs):
        if self._role == "after" and self._relay.running:
            raise _StageEnd(hidden_states)
        if self._role == "before" and self._relay.running:
            hidden_states = self._relay.received
        return (hidden_states, *([None] * (self._arity - 1))) if self._arity else hidden_states


def _output_arity(decoder: nn.Module) -> int:
    """How the decoder's loop takes a block's output, read from its forward's source: 0 when it keeps it as the
    hidden state (`hidden_states = decoder_layer(...)`), 1 when it indexes it (`hidden_states = layer_outputs[0]`),
    k when it unpacks k items. (The blocks' return annotations are not reliable: Gemma 3 declares a tuple and returns
    a tensor.)"""
    try:
        source = inspect.getsource(type(decoder).forward)
    except (OSError, TypeError):
        return 0
    found = _LOOP_CALL.search(source)
    if found is None:
        return 0
    target = found.group(1).strip()
    if "," in target:
        return len([t for t in target.split(",") if t.strip()])
    return 0 if target == "hidden_states" else 1


_LOOP_CALL = re.compile(r"\n\s+([\w, ]+?)\s*=\s*(?:decoder_layer|layer|block|layer_module|mixer_block)\(")


class AbsentModule(nn.Module):
    """A module outside the blocks that another stage holds: zeros of the shape and dtype the real one gives
    (computed on the meta device), on the input's device; the forward's result of it is never used here."""

    def __init__(self, meta: nn.Module):
        super().__init__()
        self._meta = [meta]  # a list: not a submodule, so no parameters of it are this stage's

    def __getitem__(self, index):  # one of a ModuleList's modules (Gemma 3n's AltUp projections)
        return AbsentModule(self._meta[0][index])

    def forward(self, *args, **kwargs):
        device = next((t.device for t in pytree.tree_leaves((args, kwargs)) if torch.is_tensor(t)), None)
        on_meta = pytree.tree_map(lambda t: t.to("meta") if torch.is_tensor(t) else t, (args, kwargs))
        out = self._meta[0](*on_meta[0], **on_meta[1])
        return pytree.tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device)
                               if torch.is_tensor(t) else t, out)


class _StageEnd(Exception):
    def __init__(self, output):
        super().__init__("stage end")
        self.output = output


class _Body:
    """The stage's decoder parts as the rest of hfsplit reads them (`embed_tokens`, `layers` by index, `norm`)."""

    def __init__(self, stage: "FollowedStage"):
        self._stage = stage

    @property
    def layers(self) -> dict:
        blocks = self._stage.model_blocks()
        return {str(i): blocks[i] for i in range(*self._stage.layer_range)}

    @property
    def embed_tokens(self):
        return self._stage.input_embeddings() if self._stage.has_embed else None

    @property
    def norm(self):
        return self._stage if self._stage.has_head else None  # only tested for presence


class FollowedStage(nn.Module):
    """One pipeline stage running the model's own forward: `forward(input_ids or hidden_states) -> hidden_states or
    logits`, the interface of `hfsplit.parallel.stage.StageModule`.

    Args:
        config: the transformers config of the model.
        stage: the plan's stage (layer range, embed / head flags).
        tied: lm_head shares the embedding matrix (a last stage without the embeddings keeps its own copy).
    """

    def __init__(self, *, config, stage: Stage, tied: bool):
        super().__init__()
        self.config = config
        self.stage_index = stage.index
        self.has_embed, self.has_head = stage.has_embed, stage.has_head
        self.layer_range = tuple(stage.layers)
        self.head_in_loss = False
        self.router = None
        full = meta_model(config)
        layout = decoder_layout(full)
        self._init_weights = getattr(full.get_submodule(layout.base), "_init_weights", full._init_weights)
        blocks = full.get_submodule(layout.layers)
        self._relay = _Relay()
        start, stop = stage.layers
        refuse_split_kv_sharing(config, range(start, stop))
        self.carries = carries_per_layer_inputs(full.get_submodule(layout.base))
        if self.carries:
            _carry_per_layer_inputs(full.get_submodule(layout.base), self._relay, first=stage.has_embed)
        arity = _output_arity(full.get_submodule(layout.base))
        for i in range(len(blocks)):
            if not start <= i < stop:
                role = "before" if i == start - 1 else "after" if i == stop else None
                blocks[i] = SkippedBlock(i, relay=self._relay, role=role, arity=arity, like=blocks[i])
            else:
                run_examples_alone(blocks[i])  # a recurrent mixer's state restarts at each packed example
        self._blind = builds_masks_blind(full.get_submodule(layout.base))  # packed rows: masks and seq_idx given
        absent = (() if stage.has_embed else layout.before) + (() if stage.has_head else (*layout.after,
                                                                                           *layout.outside))
        for path in absent:
            module = full.get_submodule(path)
            if any(True for _ in module.parameters()):
                _replace(full, path, AbsentModule(module))
        # the model's own children, adopted so that parameter names are the checkpoint keys
        for name, child in full.named_children():
            setattr(self, name, child)
        object.__setattr__(self, "_model", full)  # not a submodule: its children are this module's already
        self.body_name = layout.base
        self.base_model_prefix = layout.base  # read by transformers' conversion mapping (peft's MoE targets)
        self._layers_path = layout.layers
        self.shares_embedding = tied and stage.has_embed and stage.has_head
        if stage.has_head and tied and not self.shares_embedding:
            head = full.get_output_embeddings()
            head.weight = nn.Parameter(torch.empty_like(head.weight))

    # --- the parts others read -----------------------------------------------------------------------------------

    @property
    def body(self) -> _Body:
        return _Body(self)

    @property
    def lm_head(self) -> Optional[nn.Module]:
        return self._model.get_output_embeddings() if self.has_head else None

    @property
    def rotary_emb(self):
        return getattr(getattr(self._model, self.body_name), "rotary_emb", None)

    @rotary_emb.setter
    def rotary_emb(self, value) -> None:
        setattr(getattr(self._model, self.body_name), "rotary_emb", value)

    def model_blocks(self) -> nn.ModuleList:
        return self._model.get_submodule(self._layers_path)

    def input_embeddings(self) -> nn.Module:
        return self._model.get_input_embeddings()

    def init_decoder_buffers(self, fresh: list[torch.Tensor]) -> None:
        """Run the decoder's own init on the decoder itself, as transformers' loading does, for the buffers it sets
        on its blocks (Falcon-H1's Mamba mixers' `mup_vector`): over this stage's blocks only, every tensor but the
        buffers just made (`fresh`) a meta stand-in, so that nothing loaded is written."""
        decoder = getattr(self._model, self.body_name)
        owner_path, _, leaf = self._layers_path.rpartition(".")
        owner = self._model.get_submodule(owner_path) if owner_path else self._model
        blocks = owner._modules[leaf]
        keep = {id(t) for t in fresh}
        saved = []
        owner._modules[leaf] = nn.ModuleList(blocks[i] for i in range(*self.layer_range))
        try:
            for module in decoder.modules():
                for table in (module._parameters, module._buffers):
                    saved.append((table, dict(table)))
                    table.update({k: t.new_empty(t.shape, device="meta") if not isinstance(t, nn.Parameter) else
                                  nn.Parameter(t.new_empty(t.shape, device="meta"), t.requires_grad)
                                  for k, t in table.items() if t is not None and id(t) not in keep})
            with torch.no_grad():
                self._init_weights(decoder)
        finally:
            for table, before in saved:
                table.update(before)
            owner._modules[leaf] = blocks

    # --- running -------------------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, router_sums: Optional[torch.Tensor] = None, cache=None,
                position_ids: Optional[torch.Tensor] = None, router_mask: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, logits_to_keep: int = 0):
        """As `StageModule.forward`: `position_ids` `(batch, seq)` each token's position in its example (packed rows
        restart at 0), None for one sequence per row; `cache`, a transformers Cache for generation (this stage's
        layers' part), `attention_mask` its 2-D padding mask, `logits_to_keep` the last positions the head runs on."""
        kwargs = dict(position_ids=position_ids, use_cache=cache is not None)
        if cache is not None:
            kwargs["cache"] = stage_cache(cache, range(*self.layer_range))
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if self._blind and cache is None and position_ids is not None and is_packed(position_ids):
            dtype = self.input_embeddings().weight.dtype if self.has_embed else x.dtype
            kwargs.update(packed_inputs(self.config, position_ids, dtype=dtype, attention_mask=attention_mask))
        if self.has_embed:
            kwargs["input_ids"] = x
        else:
            kwargs["inputs_embeds"] = x.new_zeros(*x.shape[-3:-1], text_hidden_size(self.config))
            self._relay.received, self._relay.carried = unpacked_boundary(x, self.config, carries=self.carries)
        self._relay.running = True
        try:
            if self.has_head and self.head_in_loss:
                return _last_hidden(getattr(self._model, self.body_name)(**kwargs))
            if self.has_head:
                return self._model(**kwargs, logits_to_keep=logits_to_keep).logits
            out = getattr(self._model, self.body_name)(**kwargs)
        except _StageEnd as end:
            return packed_boundary(end.output, self._relay.carried, self.config)
        finally:
            self._relay.received, self._relay.carried, self._relay.running = None, None, False
        raise RuntimeError(f"stage {self.stage_index}: the model's forward ran past its last block "
                           f"{self.layer_range[1] - 1} without handing its output on ({type(out).__name__})")

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits the model's own forward makes from its final hidden states `hidden` (lm_head, then whatever
        scaling or soft-capping its causal-LM forward applies): its forward, with the decoder handing back `hidden`."""
        decoder = getattr(self._model, self.body_name)
        setattr(self._model, self.body_name, _Returns(hidden))
        try:
            return self._model(inputs_embeds=hidden, use_cache=False).logits
        finally:
            setattr(self._model, self.body_name, decoder)


class _StageCacheView:
    """A cache as one stage sees it: the model's forward asks the cache for the sizes of layer 0 (or of its first
    sliding layer), which another stage holds; it is answered from this stage's first layer of the same kind."""

    _stage_layers: range

    def _held(self, layer_idx: int) -> int:
        if layer_idx in self._stage_layers or layer_idx >= len(self.layers):
            return layer_idx
        kind = _cache_kind(self, layer_idx)
        return next((i for i in self._stage_layers if i < len(self.layers) and _cache_kind(self, i) == kind), layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(self._held(layer_idx))

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return super().get_mask_sizes(query_length, self._held(layer_idx))


def _cache_kind(cache, index: int) -> tuple:
    return type(cache.layers[index]), cache.is_sliding[index]


_VIEWS: dict[type, type] = {}


def stage_cache(cache, layers: range):
    """`cache` seen by the stage holding `layers` (the same storage: a view of its own class)."""
    if not hasattr(cache, "layers") or 0 in layers:
        return cache
    cls = type(cache) if isinstance(cache, _StageCacheView) else \
        _VIEWS.setdefault(type(cache), type(f"Stage{type(cache).__name__}", (_StageCacheView, type(cache)), {}))
    view = object.__new__(cls)
    view.__dict__ = cache.__dict__  # shared: what the stage's layers write is the cache's
    view._stage_layers = layers
    return view


class _Returns(nn.Module):
    """Stands in for the decoder in `logits_of`: hands back the given final hidden states."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self._hidden = hidden

    def forward(self, *args, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPast
        return BaseModelOutputWithPast(last_hidden_state=self._hidden)


# --- what crosses a stage boundary besides the hidden state ---------------------------------------------------------

def carries_per_layer_inputs(decoder: nn.Module) -> bool:
    """Whether the decoder computes per-layer inputs before its blocks (Gemma 3n's and Gemma 4's per-layer
    embeddings: from `input_ids` and the embeddings, one slice handed to each block beside the hidden state)."""
    return bool(getattr(decoder, "hidden_size_per_layer_input", 0)) and hasattr(decoder, "project_per_layer_inputs")


def _carry_per_layer_inputs(decoder: nn.Module, relay: _Relay, *, first: bool) -> None:
    """The first stage keeps the per-layer inputs its decoder computes (sent on with the hidden state); a later
    stage's decoder takes the ones received instead of computing them from embeddings it does not hold."""
    project = decoder.project_per_layer_inputs

    def kept(*args, **kwargs):
        relay.carried = project(*args, **kwargs)
        return relay.carried

    if first:
        decoder.project_per_layer_inputs = kept
    else:
        decoder.project_per_layer_inputs = lambda *args, **kwargs: relay.carried
        decoder.get_per_layer_inputs = lambda *args, **kwargs: None


def packed_boundary(hidden: torch.Tensor, carried: Optional[torch.Tensor], config) -> torch.Tensor:
    """What a stage sends on: one `(batch, seq, width)` tensor, the hidden state (its streams side by side where
    the loop keeps several: Gemma 3n's `(streams, batch, seq, hidden)`, hyper-connections' `(batch, seq, streams,
    hidden)`), then the per-layer inputs, flattened."""
    if hidden.dim() == 4:
        hidden = (hidden.permute(1, 2, 0, 3) if streams_first(config) else hidden).flatten(2)
    return hidden if carried is None else torch.cat([hidden, carried.flatten(2)], dim=-1)


def unpacked_boundary(x: torch.Tensor, config, *, carries: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(hidden state as the model's loop holds it, per-layer inputs or None) from what `packed_boundary` sent."""
    size, layers = text_hidden_size(config), config.num_hidden_layers
    per_layer = config.hidden_size_per_layer_input if carries else 0
    hidden, carried = x.split([x.shape[-1] - layers * per_layer, layers * per_layer], dim=-1)
    if hidden.shape[-1] > size:
        hidden = hidden.unflatten(-1, (hidden.shape[-1] // size, size))
        hidden = hidden.permute(2, 0, 1, 3) if streams_first(config) else hidden
    return hidden, carried.unflatten(-1, (layers, per_layer)) if carries else None


def refuse_split_kv_sharing(config, layers: range) -> None:
    """Refuse a stage holding a block that reuses the keys and values of a block another stage holds (Gemma 3n's
    and Gemma 4's `kv_sharing_modes`): they are state outside the hidden state, which no stage sends."""
    modes = getattr(config, "kv_sharing_modes", None) or []
    reusing = [i for i in layers if i < len(modes) and modes[i] == "reuse"]
    elsewhere = [i for i, mode in enumerate(modes) if mode == "store" and i not in layers]
    if reusing and elsewhere:
        raise UnsupportedModelError(
            f"{config.model_type}: block {reusing[0]} reuses the keys and values that block {elsewhere[0]} stores, "
            f"which another stage holds: put a stage boundary before block {min(elsewhere + reusing)} or after the "
            "last block")


def _last_hidden(output) -> torch.Tensor:
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]


def _replace(root: nn.Module, path: str, module: nn.Module) -> None:
    owner, _, leaf = path.rpartition(".")
    setattr(root.get_submodule(owner) if owner else root, leaf, module)
