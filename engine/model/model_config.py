"""What the engine needs to know about a checkpoint, read from its ``config.json``
(or a GGUF file's metadata, through ``engine.model.gguf_checkpoint``).

Supports the Llama / Qwen2 / Mistral family, Qwen3 (per-head q/k norms), Phi-3 and
Phi-4-mini (fused projections, partial and LongRoPE rotary), Gemma 3 text, and the
mixtures of experts Mixtral and Qwen3-MoE; sliding windows per layer. Anything else is
refused with an error that names the architecture.
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
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma3ForCausalLM": "gemma3_text",
}
# What transformers' Auto classes read when config.json lists no architectures.
MODEL_TYPES = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class MoEConfig:
    """A sparse MLP: ``num_experts`` SwiGLU experts, each token routed to ``top_k`` of
    them by a softmax over a linear router (renormalised over the chosen ones when
    ``normalize``), in the layers ``sparse_layers`` (the others keep a dense MLP)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize: bool
    sparse_layers: tuple[int, ...]

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {self.num_experts}], got {self.top_k}")

    @classmethod
    def from_dict(cls, family: str, cfg: dict) -> MoEConfig | None:
        layers = range(cfg["num_hidden_layers"])
        if family == "mixtral":
            experts = cfg.get("num_local_experts", 8)
            return cls(experts, cfg.get("num_experts_per_tok", 2), cfg["intermediate_size"], True, tuple(layers))
        if family == "qwen3_moe":
            # transformers 5 writes ``num_local_experts``; the published configs ``num_experts``.
            experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
            step = cfg.get("decoder_sparse_step", 1)
            if not experts:
                return None
            dense = set(cfg.get("mlp_only_layers") or ())
            sparse = tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
            return cls(experts, cfg.get("num_experts_per_tok", 8), cfg["moe_intermediate_size"],
                       bool(cfg.get("norm_topk_prob", False)), sparse)
        return None


def _rope(cfg: dict, family: str) -> tuple[float, dict]:
    """The rotary base and the rest of its settings (``rope_type`` among them) of the
    layers that attend to the whole context. Gemma 3 keeps a set per layer type."""
    rope = dict(cfg.get("rope_parameters") or {})
    if family == "gemma3_text" and "full_attention" in rope:
        rope = dict(rope["full_attention"])
    legacy = cfg.get("rope_scaling")
    if legacy:
        rope.update(legacy)
    rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope.setdefault("rope_type", rope.pop("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {list(ROPE_TYPES)}")
    if rope_type == "longrope":  # Phi-3 keeps these at the top level
        rope.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    return rope_theta, rope


def _gemma(cfg: dict) -> dict:
    """Gemma 3's settings: (1 + weight) norms, scaled embeddings, its attention scale,
    norms around both sublayers, and the sliding layers' own rotary base."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(f"unsupported {key} {cfg[key]} (Gemma 2's soft-capping)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("unsupported use_bidirectional_attention: this engine serves causal decoders")
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported rope_type {local['rope_type']!r} for sliding-window layers")
    return dict(
        norm_offset=1.0,
        embed_scale=cfg["hidden_size"] ** 0.5,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256),
        sandwich_norms=True,
        local_rope_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))),
    )


def _layer_windows(family: str, cfg: dict) -> tuple[int, ...]:
    """Each layer's attention window, as transformers decides it: by ``layer_types``
    where the config lists them (transformers 5, Gemma 3); else every layer of
    Mistral, Mixtral and Phi-3 when ``sliding_window`` is set, and Qwen's layers from
    ``max_window_layers`` on when ``use_sliding_window`` says so."""
    layers, window = cfg["num_hidden_layers"], cfg.get("sliding_window") or 0
    types = cfg.get("layer_types")
    if types:
        if len(types) != layers:
            raise ValueError(f"layer_types lists {len(types)} layers of {layers}")
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"unsupported layer_types {sorted(unknown)}")
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    if family in ("mistral", "mixtral", "phi3"):
        return (window,) * layers
    if cfg.get("use_sliding_window"):
        first = cfg.get("max_window_layers", 0)
        return tuple(window if i >= first else 0 for i in range(layers))
    return (0,) * layers


@dataclass(frozen=True)
class ModelConfig:
    """A checkpoint's architecture as the engine reads it (``from_pretrained``): sizes, rotary,
    norms, windows and special tokens, in one shape for every supported family. Read once when the
    engine is built; the model and the KV cache are sized by it."""

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
    layer_windows: tuple[int, ...]  # per layer: attend to this many latest tokens (0: all of them)
    qk_norm: bool = False  # an RMSNorm over each head's q and k before the rotary (Qwen3)
    rotary_dim: int = 0  # leading dims of each head the rotary turns (0: all of them)
    moe: MoEConfig | None = None
    # Gemma 3's departures from the Llama layout:
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight)
    embed_scale: float = 1.0  # the token embeddings are multiplied by this
    query_pre_attn_scalar: float | None = None  # attention scales by its -1/2 power (None: head_dim's)
    sandwich_norms: bool = False  # norms after attention and around the MLP too
    local_rope_theta: float | None = None  # the rotary base of sliding-window layers, when it is their own

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``model_dir/config.json``, or the metadata of a ``.gguf`` file."""
        from engine.model.gguf_checkpoint import is_gguf, open_gguf

        if is_gguf(model_dir):
            return cls.from_dict(open_gguf(model_dir).config_dict())
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
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
        rope_theta, rope = _rope(cfg, family)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        partial = float(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope if rope.get("rope_type") != "default" else None,
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family == "gemma3_text")),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act", "silu"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            layer_windows=_layer_windows(family, cfg),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text"),
            rotary_dim=int(head_dim * partial) if partial < 1.0 else 0,
            moe=MoEConfig.from_dict(family, cfg),
            **(_gemma(cfg) if family == "gemma3_text" else {}),
        )

    @property
    def max_model_len(self) -> int:
        """Longest sequence served."""
        return self.max_position_embeddings

    @property
    def sliding_window(self) -> int:
        """The widest window of any layer (0: every layer attends to the whole context)."""
        return max(self.layer_windows, default=0)

    @property
    def kv_window(self) -> int:
        """How far back any layer reads keys when every layer slides (its widest window),
        so the blocks behind it can be given back; 0 when some layer reads them all."""
        return self.sliding_window if self.layer_windows and all(self.layer_windows) else 0

    @property
    def rotary_dims(self) -> int:
        """How many leading dims of each head the rotary turns."""
        return self.rotary_dim or self.head_dim

    @property
    def rope_type(self) -> str:
        scaling = self.rope_scaling or {}
        return scaling.get("rope_type", scaling.get("type", "default"))

    def rope_inv_freq(self, long: bool = False) -> torch.Tensor:
        """RoPE inverse frequencies, computed exactly as Hugging Face does (``long``:
        LongRoPE's factors for positions past the original context)."""
        dim = self.rotary_dims
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        scaling = self.rope_scaling
        if self.rope_type == "longrope":
            factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
            return 1.0 / (factors * self.rope_theta**exponents)
        inv_freq = 1.0 / (self.rope_theta**exponents)
        if not scaling:
            return inv_freq
        if self.rope_type == "linear":
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

    def rope_attention_factor(self) -> float:
        """What LongRoPE scales cos and sin by (1 for every other type)."""
        if self.rope_type != "longrope":
            return 1.0
        scaling = self.rope_scaling
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        original = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or self.max_position_embeddings / original
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))

    @property
    def rope_original_positions(self) -> int | None:
        """LongRoPE: positions from here on take the long factors (None: no switch)."""
        if self.rope_type != "longrope":
            return None
        return self.rope_scaling["original_max_position_embeddings"]
