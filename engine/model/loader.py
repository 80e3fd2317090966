"""Loads a Hugging Face checkpoint directory into a ``DecoderModel``.

One loader for every model, the built-in default one included: ``config.json``, then
``model.safetensors`` or the shards named by ``model.safetensors.index.json``; or a
single ``.gguf`` file, whose tensors ``engine.model.gguf_checkpoint`` dequantizes and names
as Hugging Face does.
Separate q/k/v and gate/up weights are fused into the model's single projections
(a checkpoint that has them fused already, as Phi-3's, is taken as it is), and a
mixture's per-expert weights are stacked into one tensor per layer (a GGUF file holds
them stacked already, one tensor per layer and projection).
A checkpoint tensor the model does not use is an error, not something to skip: a
weight silently left out (a bias, a norm) still gives a model that runs, only wrongly.

Tensors are read one parameter at a time, when the model asks for them. Under tensor
parallelism (``tp``) a rank reads only its slices (``engine.model.parallel``): rows of
q/k/v, gate/up and the vocabulary, columns of o and down, each expert's slice of a
mixture; a safetensors file gives just those bytes (``get_slice``). A GGUF tensor is
dequantized whole, one at a time, and cut right after (see ``GGUFTensors``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from engine.model.gguf_checkpoint import GGUFFile, is_gguf, open_gguf
from engine.model.model import DecoderModel, can_pack
from engine.model.model_config import DTYPES, SUPPORTED_ARCHITECTURES, ModelConfig
from engine.model.parallel import SINGLE, Shard, TPGroup, shard_of

_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# A sparse MLP's checkpoint names, by family: (router, expert prefix, gate, up, down).
_EXPERTS = {
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2"),
    "qwen3_moe": ("mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj"),
}
# ``SparseMoE``'s parameters (under ``layers.N.mlp.``).
_MOE_PARAMETERS = ("gate.weight", "experts_gate_up", "experts_down")


# Tensors some checkpoints carry that the model rightly ignores: rotary tables that
# older exports saved (the model computes its own), and the output projection of a
# tied-embedding model (the model uses the embedding itself).
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_TIED_HEAD = "lm_head.weight"


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """The weights' and KV cache's dtype for the ``dtype`` setting on ``device``.

    ``auto`` is bfloat16 on CUDA (fp32 spills the Triton prefill kernel's registers at
    head_dim 128 and its ieee dot products forgo tensor cores) and float32 elsewhere
    (CPU matmuls in bf16 are slow, and float32 is what the parity tests compare).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


class TensorSource(Protocol):
    """A checkpoint's tensors by name, read on demand: ``SafetensorsFiles`` or a GGUF file's
    ``GGUFTensors``."""

    def __iter__(self) -> Iterator[str]: ...

    def __contains__(self, name: object) -> bool: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, index: tuple[slice, ...] = ()) -> torch.Tensor: ...


class SafetensorsFiles:
    """The tensors of a checkpoint's safetensors files, each read when asked, whole or a
    slice (``get_slice`` copies out only the slice's bytes). The files stay open while
    ``stack`` does."""

    def __init__(self, paths: list[Path], stack: ExitStack) -> None:
        self._files = {}
        for path in paths:
            f = stack.enter_context(safe_open(str(path), framework="pt"))
            self._files.update(dict.fromkeys(f.keys(), f))

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __contains__(self, name: object) -> bool:
        return name in self._files

    def shape(self, name: str) -> tuple[int, ...]:
        """The whole tensor's shape, from the file's header."""
        return tuple(self._files[name].get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        """Tensor ``name``, or its ``index`` (a slice per leading dimension)."""
        f = self._files[name]
        return f.get_slice(name)[index] if index else f.get_tensor(name)


@dataclass(frozen=True)
class Part:
    """Items ``[start, stop)`` of a tensor's dimension ``dim``, which must hold ``total``."""

    dim: int
    start: int
    stop: int
    total: int

    @property
    def whole(self) -> bool:
        return (self.start, self.stop) == (0, self.total)


class Checkpoint:
    """What the model's parameters read: tensors by name (with or without the ``model.``
    prefix), whole or a ``Part``, and which names were read (for ``_check_all_used``)."""

    def __init__(self, source: TensorSource, where: object) -> None:
        self.source = source
        self.where = where
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.source or f"model.{name}" in self.source

    def read(self, name: str, part: Part | None = None, total: int | None = None) -> torch.Tensor:
        """Tensor ``name``; with ``part``, only those items (its dimension checked against
        the part's total first: a slice of a tensor of another shape would go unnoticed)."""
        for candidate in (name, f"model.{name}"):
            if candidate in self.source:
                self.used.add(candidate)
                return self._read(candidate, part)
        raise ValueError(f"checkpoint {self.where} is missing weight {name!r}")

    def _read(self, name: str, part: Part | None) -> torch.Tensor:
        if part is None:
            return self.source.read(name)
        shape = self.source.shape(name)
        if len(shape) <= part.dim or shape[part.dim] != part.total:
            raise ValueError(
                f"weight {name!r} has shape {shape}, expected {part.total} along dimension {part.dim}"
            )
        if part.whole:
            return self.source.read(name)
        return self.source.read(name, (slice(None),) * part.dim + (slice(part.start, part.stop),))


def load_model(
    model_dir: str | Path | GGUFFile,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    pack: bool = True,
    tp: TPGroup = SINGLE,
) -> DecoderModel:
    """Build the model from ``model_dir`` (or a ``.gguf`` file, by path or already open)
    with weights in ``dtype`` on ``device``; ``pack``: reorder the layer projections for
    oneDNN where ``can_pack`` allows (``pack=False`` keeps plain ``nn.Linear`` weights).
    With ``tp``, the model of ``tp``'s own rank, from that rank's slices only."""
    if is_gguf(model_dir):
        model_dir = open_gguf(model_dir)
    else:
        model_dir = Path(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    dtype = resolve_dtype(dtype)
    with torch.device("meta"):
        model = DecoderModel(config, tp)
    with ExitStack() as stack:
        if is_gguf(model_dir):
            source = open_gguf(model_dir).tensors(dtype, config.num_heads, config.num_kv_heads)
        else:
            source = SafetensorsFiles(_weight_files(model_dir), stack)
        ckpt = Checkpoint(source, model_dir)
        state = _read_state(model, ckpt, shard_of(tp), device, dtype)
        _check_all_used(model_dir, source, ckpt.used, config.tie_word_embeddings)
    # The meta parameters are replaced by the loaded tensors themselves: no second copy
    # (and no meta-device ``empty_like``, whose reference kernel imports sympy).
    model.load_state_dict(state, strict=False, assign=True)
    # The rotary tables were computed on the CPU (float32, as HF) even under meta.
    for rotary in (model.rotary, model.local_rotary):
        if rotary is not None:
            rotary.to(device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.eval().requires_grad_(False)
    if pack and can_pack(torch.device(device), dtype):
        model.pack_linears()
    return model


def _read_state(model: DecoderModel, ckpt: Checkpoint, shard: Shard, device, dtype) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` read from ``ckpt``, one at a time, on ``device``."""
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        tensor = _assemble(name, ckpt, model.config, shard)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        state[name] = tensor.to(device=device, dtype=dtype).contiguous()
    return state


def _assemble(name: str, ckpt: Checkpoint, config: ModelConfig, shard: Shard) -> torch.Tensor:
    """The checkpoint's tensor(s) for the model's parameter ``name``: the rank's slice of it."""
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return _vocab_rows(name, ckpt, config.vocab_size, shard)
    layer, _, rest = name.partition(".mlp.")
    if rest in _MOE_PARAMETERS and SUPPORTED_ARCHITECTURES[config.architecture] in _EXPERTS:
        return _moe_weight(layer, rest, ckpt, config, shard)
    if ".self_attn.qkv_proj." in name or name.endswith(".self_attn.o_proj.weight"):
        q, kv = _head_rows(config, shard)
        if ".qkv_proj." in name:
            return _fused(name, "self_attn.qkv_proj", ckpt, [q, kv, kv])
        return ckpt.read(name, Part(1, q.start, q.stop, q.total))
    if ".mlp.gate_up_proj." in name or name.endswith(".mlp.down_proj.weight"):
        inter = _rows(shard.split(config.intermediate_size, "intermediate_size"), config.intermediate_size)
        if ".gate_up_proj." in name:
            return _fused(name, "mlp.gate_up_proj", ckpt, [inter, inter])
        return ckpt.read(name, Part(1, inter.start, inter.stop, inter.total))
    return ckpt.read(name)  # norms, o/down biases: whole on every rank


def _rows(span: tuple[int, int], total: int, scale: int = 1) -> Part:
    return Part(0, span[0] * scale, span[1] * scale, total * scale)


def _head_rows(config: ModelConfig, shard: Shard) -> tuple[Part, Part]:
    """The rank's rows of q_proj and of k_proj (and v_proj): its heads' rows."""
    d = config.head_dim
    q = _rows(shard.split(config.num_heads, "num_attention_heads"), config.num_heads, d)
    return q, _rows(shard.kv_heads(config.num_kv_heads), config.num_kv_heads, d)


def _fused(name: str, fused: str, ckpt: Checkpoint, parts: list[Part]) -> torch.Tensor:
    """The rank's rows of each of ``fused``'s projections (q, k, v or gate, up), one after
    the other: from their separate tensors, or from the checkpoint's fused one (Phi-3)."""
    if not ckpt.has(name):
        prefix, suffix = name.split(fused)
        return torch.cat([ckpt.read(f"{prefix}{p}{suffix}", part) for p, part in zip(_FUSED[fused], parts)])
    if all(part.whole for part in parts):
        return ckpt.read(name)
    total = sum(part.total for part in parts)
    pieces, offset = [], 0
    for part in parts:
        pieces.append(ckpt.read(name, Part(0, part.start + offset, part.stop + offset, total)))
        offset += part.total
    return torch.cat(pieces)


def _vocab_rows(name: str, ckpt: Checkpoint, vocab_size: int, shard: Shard) -> torch.Tensor:
    """The rank's rows of the embedding or the LM head, padded with zero rows past the
    vocabulary (the vocabulary padded to a multiple of the ranks)."""
    start, stop = shard.vocab(vocab_size)
    rows = ckpt.read(name, Part(0, min(start, vocab_size), min(stop, vocab_size), vocab_size))
    if rows.shape[0] == stop - start:
        return rows
    return torch.cat([rows, rows.new_zeros(stop - start - rows.shape[0], *rows.shape[1:])])


def _moe_weight(layer: str, rest: str, ckpt: Checkpoint, config: ModelConfig, shard: Shard) -> torch.Tensor:
    """A sparse MLP's router (whole), or the rank's slice of every expert's gate/up rows and
    down columns."""
    router, experts, gate, up, down = _EXPERTS[SUPPORTED_ARCHITECTURES[config.architecture]]
    if rest == "gate.weight":
        return ckpt.read(f"{layer}.{router}.weight")
    moe = config.moe
    span = shard.split(moe.intermediate_size, "moe_intermediate_size")

    def stacked(proj: str, dim: int) -> torch.Tensor:
        part = Part(dim, span[0], span[1], moe.intermediate_size)
        return _experts(f"{layer}.{experts}", proj, ckpt, moe.num_experts, part)

    if rest == "experts_down":
        return stacked(down, 1)
    return torch.cat([stacked(gate, 0), stacked(up, 0)], dim=1)


def _experts(prefix: str, proj: str, ckpt: Checkpoint, num_experts: int, part: Part) -> torch.Tensor:
    """One projection of every expert, ``[experts, out, in]`` (each cut to ``part`` of its
    ``[out, in]``): the stacked tensor a GGUF file holds (named as llama.cpp's converter
    names it before mapping: the per-expert name without the expert's index), or the
    per-expert ones of a HF checkpoint stacked."""
    stacked = f"{prefix}.{proj}.weight"
    if ckpt.has(stacked):
        return ckpt.read(stacked, Part(part.dim + 1, part.start, part.stop, part.total))
    return torch.stack([ckpt.read(f"{prefix}.{e}.{proj}.weight", part) for e in range(num_experts)])


def _check_all_used(model_dir: Path, raw: TensorSource, used: set[str], tied: bool) -> None:
    """Refuse a checkpoint with tensors the model would drop, naming them."""
    unused = sorted(
        name
        for name in raw
        if name not in used and not _IGNORED.search(name) and not (tied and name == _TIED_HEAD)
    )
    if unused:
        shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
        raise ValueError(
            f"checkpoint {model_dir} holds {len(unused)} weight(s) the model would not load: "
            f"{shown}. Its config.json may disagree with its weights (attention_bias, "
            "mlp_bias, tie_word_embeddings), or it is a variant of the architecture this "
            "engine does not support."
        )
