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
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model.gguf_checkpoint import GGUFFile, is_gguf, open_gguf
from engine.model.model import DecoderModel, can_pack
from engine.model.model_config import DTYPES, SUPPORTED_ARCHITECTURES, ModelConfig

_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# A sparse MLP's checkpoint names, by family: (router, expert prefix, gate, up, down).
_EXPERTS = {
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2"),
    "qwen3_moe": ("mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj"),
}


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


def _read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def load_model(
    model_dir: str | Path | GGUFFile,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    pack: bool = True,
) -> DecoderModel:
    """Build the model from ``model_dir`` (or a ``.gguf`` file, by path or already open)
    with weights in ``dtype`` on ``device``; ``pack``: reorder the layer projections for
    oneDNN where ``can_pack`` allows (``pack=False`` keeps plain ``nn.Linear`` weights)."""
    if is_gguf(model_dir):
        model_dir = open_gguf(model_dir)
    else:
        model_dir = Path(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    dtype = resolve_dtype(dtype)
    with torch.device("meta"):
        model = DecoderModel(config)
    if is_gguf(model_dir):
        raw = open_gguf(model_dir).tensors(dtype, config.num_heads, config.num_kv_heads)
    else:
        raw = _read_tensors(model_dir)

    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        for candidate in (name, f"model.{name}"):
            if candidate in raw:
                used.add(candidate)
                return raw[candidate]
        raise ValueError(f"checkpoint {model_dir} is missing weight {name!r}")

    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        state[name] = _assemble(name, take, raw, config)
        if tuple(state[name].shape) != tuple(param.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(state[name].shape)}, expected {tuple(param.shape)}"
            )
        state[name] = state[name].to(device=device, dtype=dtype).contiguous()
    _check_all_used(model_dir, raw, used, config.tie_word_embeddings)
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


def _assemble(name: str, take, raw: dict, config: ModelConfig) -> torch.Tensor:
    """The checkpoint's tensor(s) for the model's parameter ``name``."""
    layer, _, rest = name.partition(".mlp.") if ".mlp." in name else ("", "", "")
    family = SUPPORTED_ARCHITECTURES[config.architecture]
    if rest and config.moe is not None and family in _EXPERTS:
        router, experts, gate, up, down = _EXPERTS[family]
        if rest == "gate.weight":
            return take(f"{layer}.{router}.weight")

        def stacked(proj: str) -> torch.Tensor:
            return _experts(f"{layer}.{experts}", proj, take, raw, config.moe.num_experts)

        if rest == "experts_down":
            return stacked(down)
        if rest == "experts_gate_up":
            return torch.cat([stacked(gate), stacked(up)], dim=1)
    fused = next((k for k in _FUSED if f".{k}." in f".{name}"), None)
    if fused is None or _has(raw, name):  # Phi-3 keeps them fused
        return take(name)
    prefix, suffix = name.split(fused)
    return torch.cat([take(f"{prefix}{p}{suffix}") for p in _FUSED[fused]], dim=0)


def _has(raw: dict, name: str) -> bool:
    return name in raw or f"model.{name}" in raw


def _experts(prefix: str, proj: str, take, raw: dict, num_experts: int) -> torch.Tensor:
    """One projection of every expert, ``[experts, out, in]``: the stacked tensor a GGUF
    file holds (named as llama.cpp's converter names it before mapping: the per-expert
    name without the expert's index), or the per-expert ones of a HF checkpoint stacked."""
    stacked = f"{prefix}.{proj}.weight"
    if _has(raw, stacked):
        return take(stacked)
    return torch.stack([take(f"{prefix}.{e}.{proj}.weight") for e in range(num_experts)])


def _check_all_used(
    model_dir: Path, raw: dict[str, torch.Tensor], used: set[str], tied: bool
) -> None:
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
