"""What the engine needs to know about a checkpoint, read from its ``config.json``
(or a GGUF file's metadata, through ``engine.gguf_checkpoint``).

Supports the Llama / Qwen2 / Mistral family of Hugging Face checkpoints. Anything
else is refused with an error that names the architecture.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
# What transformers' Auto classes read when config.json lists no architectures.
MODEL_TYPES = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    hidden_act: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        """Read ``model_dir/config.json``, or the metadata of a ``.gguf`` file."""
        from engine.gguf_checkpoint import is_gguf, open_gguf

        if is_gguf(model_dir):
            return cls.from_dict(open_gguf(model_dir).config_dict())
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs:
            arch = MODEL_TYPES.get(cfg.get("model_type"))
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)} (or model_type {sorted(MODEL_TYPES)})"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or {})
        legacy = cfg.get("rope_scaling")
        if legacy:
            rope.update(legacy)
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        use_sw = cfg.get("use_sliding_window", family == "mistral")
        window = cfg.get("sliding_window") if use_sw else None
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope if rope_type != "default" else None,
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            hidden_act=cfg.get("hidden_act", "silu"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=window,
        )

    @property
    def max_model_len(self) -> int:
        """Longest sequence served: a sliding window caps it, since we attend in full."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def rope_inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies, computed exactly as Hugging Face does."""
        dim = self.head_dim
        inv_freq = 1.0 / (
            self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )
        scaling = self.rope_scaling
        if not scaling:
            return inv_freq
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type == "linear":
            return inv_freq / scaling["factor"]
        # llama3: long wavelengths scaled down by `factor`, short ones kept, smooth between.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
