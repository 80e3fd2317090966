"""LoRA adapters in PEFT's format over the base model's projections, many adapters in one step.

An adapter is a directory with ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``) and ``adapter_model.safetensors``: per layer and
target, ``lora_A.weight`` ([r, in]) and ``lora_B.weight`` ([out, r]). It adds
``scaling * B @ A`` to each target's weight, ``scaling = lora_alpha / r`` (``/ sqrt(r)``
under rsLoRA). Targets are the attention and MLP projections PEFT names (q, k, v, o,
gate, up, down); the model fuses q/k/v and gate/up, so an adapter's q, k and v land in
their columns of the fused product. What this cannot apply is refused at load, naming it:
other modules (embeddings, the LM head, a mixture's experts), DoRA, biases, saved
modules, a rank above ``max_lora_rank``, shapes that are not the base model's.

Resident adapters sit in ``max_loras`` slots on the model's device (``LoRASlots``,
least recently used out first; a step's own adapters are never evicted for each other).
Each of a layer's four projections has a ``LoRAStack``: every slot's A, its sub-products
(q, k and v of the fused q/k/v) side by side, ``[slots, in, subs * R]``, and every slot's B,
scaled, each sub-product's rows in its output columns, ``[slots, subs * R, out]``; an
adapter of rank r < R fills r of its R (zeros elsewhere add nothing). A step's rows carry their request's slot
(``LoRAStep``), and each projection adds its adapters' products to its output:

    h = x[slot's rows] @ A[slot];  y[slot's rows] += h @ B[slot]   (each sub-product's
    columns of h into its columns of y)

for all slots at once, the rows of each gathered into a block padded to the busiest
slot's (two ``bmm``: the grouped shrink and expand of vLLM's punica kernels, as batched
GEMMs), or slot by slot where one adapter has the whole step or the padding would more
than double the rows (one long prefill chunk beside a few decodes). Each row computes only its own
adapter; rows without one are untouched; a step without adapter rows skips it all.
Under tensor parallelism each rank holds its cut of every adapter, as of its base layer:
B's rows of its heads or intermediate rows for q/k/v and gate/up (A whole), A's columns
of its input for o and down (B whole), whose partial products join the rank's before the
ranks' sum (``engine.model.model.project_out``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from engine.model.model import MLP, DecoderModel
from engine.model.parallel import shard_of

# PEFT's module names -> (the model's projection, which of its sub-products).
TARGETS = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
GROUP_PADDING = 2  # a step's slots are batched while padding their rows at most doubles them
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter this model cannot take, and why."""


@dataclass(frozen=True)
class Adapter:
    """One adapter read from disk, on the CPU: its rank, scaling and per (layer, target)
    A and B."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, PEFT target) -> (A, B)
    # "name@digest" of its files: what requests carry and prefix-cache keys include, so KV
    # computed under one load never serves another adapter loaded later under the name.
    key: str = ""

    @property
    def targets(self) -> set[str]:
        return {target for _, target in self.weights}


def _adapter_config(path: Path) -> dict:
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path} has no adapter_config.json (a PEFT LoRA adapter directory)") from None
    except json.JSONDecodeError as e:
        raise AdapterError(f"{path}/adapter_config.json is not JSON: {e}") from None
    refusals = {
        "peft_type": (config.get("peft_type", "LORA") != "LORA", "only LoRA adapters are served"),
        "use_dora": (bool(config.get("use_dora")), "DoRA adapters are not supported"),
        "bias": (config.get("bias", "none") != "none", "adapters that train biases are not supported"),
        "modules_to_save": (bool(config.get("modules_to_save")), "adapters with saved modules are not supported"),
        "fan_in_fan_out": (bool(config.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D) weights are not supported"),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise AdapterError(f"{path}: {why} ({key}: {config.get(key)!r})")
    return config


def load_adapter(name: str, path: str | Path, num_layers: int, shapes: dict[str, tuple[int, int]],
                 max_rank: int) -> Adapter:
    """The adapter at ``path``, checked against a model of ``num_layers`` whose PEFT targets
    have ``shapes`` ((in, out) by target name; the targets this model has); raises
    ``AdapterError`` naming what does not fit, having changed nothing."""
    path = Path(path)
    config = _adapter_config(path)
    rank, alpha = int(config.get("r", 0)), float(config.get("lora_alpha", config.get("r", 0)))
    if not 0 < rank <= max_rank:
        raise AdapterError(f"{path}: rank {rank} is outside 1..max_lora_rank ({max_rank})")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path / "adapter_model.safetensors"), framework="pt") as f:
            for key in f.keys():
                layer, target, side = _parse_key(path, key, num_layers, shapes)
                weights.setdefault((layer, target), {})[side] = f.get_tensor(key).float()
    except (OSError, SafetensorError) as e:  # a missing or corrupt file
        raise AdapterError(f"{path}: cannot read adapter_model.safetensors: {e}") from None
    if not weights:
        raise AdapterError(f"{path}: adapter_model.safetensors holds no LoRA weights")
    checked = {}
    for (layer, target), pair in weights.items():
        checked[layer, target] = _checked_pair(path, layer, target, pair, rank, shapes[target])
    digest = hashlib.sha256()
    for part in ("adapter_config.json", "adapter_model.safetensors"):
        digest.update((path / part).read_bytes())
    return Adapter(name, str(path), rank, scaling, checked, f"{name}@{digest.hexdigest()[:16]}")


def _parse_key(path: Path, key: str, num_layers: int, shapes: dict) -> tuple[int, str, str]:
    m = _KEY.match(key)
    if m is None:
        raise AdapterError(f"{path}: {key!r} is not a LoRA weight of a layer's attention or MLP projection")
    layer, target = int(m.group(1)), m.group(3)
    if target not in shapes:
        raise AdapterError(f"{path}: {key!r} targets {target!r}, which this model cannot adapt "
                           f"(adaptable: {sorted(shapes)})")
    if layer >= num_layers:
        raise AdapterError(f"{path}: {key!r} names layer {layer}; the model has {num_layers}")
    return layer, target, m.group(4)


def _checked_pair(path: Path, layer: int, target: str, pair: dict[str, torch.Tensor], rank: int,
                  shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"{path}: layer {layer}'s {target} has lora_{next(iter(pair))} without its pair")
    a, b = pair["A"], pair["B"]
    if a.shape != (rank, shape[0]) or b.shape != (shape[1], rank):
        raise AdapterError(f"{path}: layer {layer}'s {target} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                           f"the model needs A ({rank}, {shape[0]}) and B ({shape[1]}, {rank})")
    return a, b


class LoRAStep:
    """The step's rows by adapter slot, shared by every stack: set by the runner before the
    forward (``begin``), as index tensors every projection reuses.

    Two ways to apply a step's adapters, chosen per step by its shape: batched, each slot's
    rows gathered into a ``[slots, rows, in]`` block padded to the busiest slot's rows (while
    ``GROUP_PADDING`` bounds the padding), one ``bmm`` for the shrink and one for the expand;
    or slot by slot over each one's own rows (one adapter for the whole step, or a long
    prefill chunk beside a few decodes, which the padding would multiply).
    """

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.grouped = True  # False: always slot by slot (a benchmark's baseline)
        self.active = False
        self.batched = False
        self.by_slot: list[tuple[int, torch.Tensor | None]] = []  # (slot, its rows; None: every row)
        self.gather: torch.Tensor | None = None  # [slots * widest]: the rows of each slot, padded with row 0
        self.rows: torch.Tensor | None = None  # the rows the gathered entries that are not padding are
        self.real: torch.Tensor | None = None  # where those entries are among the gathered (None: all)

    def begin(self, slots: Sequence[int], device: torch.device) -> None:
        """A step whose row ``i`` uses slot ``slots[i]`` (-1: the base model alone)."""
        rows_of: dict[int, list[int]] = {}
        for row, slot in enumerate(slots):
            if slot >= 0:
                rows_of.setdefault(slot, []).append(row)
        self.active = bool(rows_of)
        if not self.active:
            return
        every = len(rows_of) == 1 and len(next(iter(rows_of.values()))) == len(slots)
        self.by_slot = [(slot, None if every else torch.tensor(rows, device=device))
                        for slot, rows in sorted(rows_of.items())]
        widest = max(len(rows) for rows in rows_of.values())
        used = sum(len(rows) for rows in rows_of.values())
        self.batched = self.grouped and len(rows_of) > 1 and self.max_loras * widest <= GROUP_PADDING * used
        if self.batched:
            gather, rows, real = [], [], []
            for slot in range(self.max_loras):
                mine = rows_of.get(slot, [])
                real += range(len(gather), len(gather) + len(mine))
                rows += mine
                gather += mine + [0] * (widest - len(mine))
            self.gather, self.rows = torch.tensor(gather, device=device), torch.tensor(rows, device=device)
            self.real = None if len(real) == len(gather) else torch.tensor(real, device=device)


class LoRAStack(nn.Module):
    """One projection's resident adapters: ``a`` ``[slots, in, subs * R]`` (every sub-product's A
    side by side) and ``b`` ``[slots, subs * R, out]`` (each sub-product's B, scaled, in its rows
    and its output columns, zeros elsewhere); ``slices``: the output columns of each
    sub-product (q, k, v of a fused q/k/v)."""

    def __init__(self, in_features: int, slices: list[tuple[int, int]], step: LoRAStep, rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.step, self.rank, self.slices = step, rank, slices
        width, slots = len(slices) * rank, step.max_loras
        self.register_buffer("a", torch.zeros(slots, in_features, width, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("b", torch.zeros(slots, width, slices[-1][1], dtype=dtype, device=device),
                             persistent=False)

    def put(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None], scaling: float) -> None:
        """Slot ``slot`` takes these sub-products' (A, B) (None: the adapter leaves it be)."""
        r = self.rank
        self.a[slot] = 0
        self.b[slot] = 0
        for sub, (part, (first, last)) in enumerate(zip(parts, self.slices)):
            if part is not None:
                a, b = part
                self.a[slot, :, sub * r : sub * r + a.shape[0]] = a.t().to(self.a.dtype)
                self.b[slot, sub * r : sub * r + a.shape[0], first:last] = (b * scaling).t().to(self.b.dtype)

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y`` (the projection of ``x``, added to in place) plus this step's adapters' products."""
        step = self.step
        if not step.active:
            return y
        if not step.batched:
            for slot, rows in step.by_slot:
                if rows is None:
                    y += (x @ self.a[slot]) @ self.b[slot]
                else:
                    y.index_add_(0, rows, (x.index_select(0, rows) @ self.a[slot]) @ self.b[slot])
            return y
        assert step.gather is not None and step.rows is not None
        gathered = x.index_select(0, step.gather).view(step.max_loras, -1, x.shape[-1])
        delta = torch.bmm(torch.bmm(gathered, self.a), self.b).flatten(0, 1)
        if step.real is not None:
            delta = delta.index_select(0, step.real)
        return y.index_add_(0, step.rows, delta)


class LoRASlots:
    """The model's LoRA: the adapters loaded (on the CPU), ``max_loras`` of them resident in
    the stacks (LRU), and the step's rows. ``attach`` gives every layer its stacks."""

    def __init__(self, model: DecoderModel, max_loras: int, max_rank: int) -> None:
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.shard = shard_of(model.tp)
        self.step = LoRAStep(max_loras)
        self.loaded: dict[str, Adapter] = {}  # by name
        self.resident: OrderedDict[str, int] = OrderedDict()  # key -> slot, least recently used first
        self.loads = self.evictions = 0
        self._attach()

    def _attach(self) -> None:
        config = self.model.config
        weight = self.model.embed_tokens.weight
        make = lambda n, slices: LoRAStack(n, slices, self.step, self.max_rank, weight.dtype, weight.device)  # noqa: E731
        for layer in self.model.layers:
            attn = layer.self_attn
            q, kv = attn.q_size, attn.kv_size
            attn.qkv_lora = make(config.hidden_size, [(0, q), (q, q + kv), (q + kv, q + 2 * kv)])
            attn.o_lora = make(q, [(0, config.hidden_size)])
            mlp = layer.mlp
            if isinstance(mlp, MLP):  # a mixture's experts take no adapter
                mlp.gate_up_lora = make(config.hidden_size, [(0, mlp.inter), (mlp.inter, 2 * mlp.inter)])
                mlp.down_lora = make(mlp.inter, [(0, config.hidden_size)])

    def target_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each PEFT target this model can adapt, whole (as the adapter's files)."""
        c = self.model.config
        q, kv, hidden = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size
        shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
        if all(isinstance(each.mlp, MLP) for each in self.model.layers):
            inter = c.intermediate_size
            shapes |= {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
        return shapes

    def _rank_parts(self) -> dict[str, tuple[str, slice]]:
        """Each target's cut for this rank, as its base layer's (Megatron's split): "B" rows
        (column-parallel: the rank's heads or intermediate rows) or "A" columns (row-parallel
        o and down: the rank's input columns)."""
        c, shard = self.model.config, self.shard
        heads = slice(*(h * c.head_dim for h in shard.split(c.num_heads, "num_attention_heads")))
        kv = slice(*(h * c.head_dim for h in shard.kv_heads(c.num_kv_heads)))
        inter = slice(*shard.split(c.intermediate_size, "intermediate_size")) if c.moe is None else slice(None)
        return {"q_proj": ("B", heads), "k_proj": ("B", kv), "v_proj": ("B", kv), "o_proj": ("A", heads),
                "gate_proj": ("B", inter), "up_proj": ("B", inter), "down_proj": ("A", inter)}

    def load(self, name: str, path: str | Path) -> Adapter:
        """Read and check the adapter (``AdapterError`` names what does not fit; nothing
        changes then). A name already loaded is refused: unload it first."""
        if name in self.loaded:
            raise AdapterError(f"an adapter named {name!r} is loaded already (from {self.loaded[name].path})")
        adapter = load_adapter(name, path, len(self.model.layers), self.target_shapes(), self.max_rank)
        self.loaded[name] = adapter
        return adapter

    def unload(self, name: str) -> bool:
        """Forget the adapter; its slot frees. False if it was not loaded."""
        adapter = self.loaded.pop(name, None)
        if adapter is not None:
            self.resident.pop(adapter.key, None)
        return adapter is not None

    def begin_step(self, keys: Sequence[str | None]) -> None:
        """Row ``i`` of the coming forward uses the adapter whose ``key`` is ``keys[i]`` (None:
        the base model): each one made resident (the least recently used others evicted),
        then the rows' slots set."""
        wanted = list(dict.fromkeys(k for k in keys if k is not None))
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} adapters; at most max_loras ({self.max_loras}) fit")
        for key in wanted:
            self._make_resident(key, keep=wanted)
        slots = [-1 if k is None else self.resident[k] for k in keys]
        self.step.begin(slots, self.model.embed_tokens.weight.device)

    def _make_resident(self, key: str, keep: list[str]) -> None:
        if key in self.resident:
            self.resident.move_to_end(key)
            return
        adapter = next((a for a in self.loaded.values() if a.key == key), None)
        if adapter is None:
            raise KeyError(f"adapter {key!r} is not loaded")
        free = set(range(self.max_loras)) - set(self.resident.values())
        if not free:
            victim = next(k for k in self.resident if k not in keep)
            free = {self.resident.pop(victim)}
            self.evictions += 1
        slot = min(free)
        self._write(slot, adapter)
        self.resident[key] = slot
        self.loads += 1

    def _write(self, slot: int, adapter: Adapter) -> None:
        w = self._rank_weights(adapter)
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            attn.qkv_lora.put(slot, [w.get((i, t)) for t in ("q_proj", "k_proj", "v_proj")], adapter.scaling)
            attn.o_lora.put(slot, [w.get((i, "o_proj"))], adapter.scaling)
            if isinstance(layer.mlp, MLP):
                layer.mlp.gate_up_lora.put(slot, [w.get((i, "gate_proj")), w.get((i, "up_proj"))], adapter.scaling)
                layer.mlp.down_lora.put(slot, [w.get((i, "down_proj"))], adapter.scaling)

    def _rank_weights(self, adapter: Adapter) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """The adapter's A and B as this rank holds them (whole at one rank)."""
        if self.shard.size == 1:
            return adapter.weights
        parts = self._rank_parts()
        out = {}
        for (layer, target), (a, b) in adapter.weights.items():
            side, cut = parts[target]
            out[layer, target] = (a[:, cut], b) if side == "A" else (a, b[cut])
        return out
