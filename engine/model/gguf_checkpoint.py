"""Reads a GGUF file (llama.cpp's one-file checkpoint) as the engine reads a HF directory.

A GGUF holds the hyper-parameters, the tokenizer (vocabulary, merges, special tokens)
and the chat template as metadata, and the weights as tensors under llama.cpp's names,
many of them quantized. This module turns each into the form the rest of the engine
already takes from a Hugging Face checkpoint:

* :meth:`GGUFFile.config_dict` -- a ``config.json``-style dict for ``ModelConfig``;
* :meth:`GGUFFile.tokenizer_parts` -- a ``tokenizers.Tokenizer`` plus the special tokens
  and chat template, for ``engine.tokenizer.Tokenizer``;
* :meth:`GGUFFile.tensors` -- weights under Hugging Face names, dequantized by the
  ``gguf`` package into the serving dtype, with llama.cpp's permutation of the Q and K
  rows undone (its converter interleaves each head's rotary halves) and the 1 its Gemma
  converter adds to every norm weight taken off, for ``engine.model.loader``.

Supported: the architectures ``llama`` (with ``expert_count``: Mixtral, which llama.cpp
stores as a llama with stacked experts), ``qwen2``, ``qwen3``, ``qwen3moe``, ``phi3``
(fused ``attn_qkv`` and gate+up ``ffn_up``, partial rotary, LongRoPE factors as tensors)
and ``gemma3`` (text only; the settings llama.cpp fixes in its code rather than the file,
such as every sixth layer global, taken as it takes them); the tensor types of
``SUPPORTED_TYPES``; byte-level BPE tokenizers (``gpt2``) with the pre-tokenizers of
``PRE_TOKENIZERS``, and SentencePiece ones (``llama``: Mistral, Llama 2, Phi-3, Gemma 3),
rebuilt from the vocabulary and its scores. Anything else is refused with an
error that names it. Importing this module loads neither torch, transformers
nor gguf (the router builds its tokenizer through it, and the GPU image has no gguf):
the ``gguf`` package is imported when a file is opened.

This module opens the file and reads its metadata (``GGUFFile``: the config and the
tokenizer's parts); ``engine/model/gguf_tensors.py`` has llama.cpp's tensor names and types
and ``GGUFTensors``, ``engine/model/gguf_tokenizer.py`` rebuilds the tokenizer. Their public
names are imported from here.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from engine.model.gguf_tensors import (
    FAMILY_TENSORS,
    LAYER_TENSORS,
    MIXTRAL,
    ROPE_FACTORS,
    SUPPORTED_TYPES,
    GGUFTensors,
    gguf_package,
    hf_name,
)
from engine.model.gguf_tokenizer import PRE_TOKENIZERS, build_tokenizer

__all__ = [
    "GGUF_ARCHITECTURES", "PRE_TOKENIZERS", "SUPPORTED_TYPES", "GGUFFile", "GGUFTensors", "fast_reader",
    "gguf_package", "is_gguf", "open_gguf",
]

# llama.cpp's architecture name -> the Hugging Face class it stands for. A ``llama`` file
# with experts is a Mixtral: llama.cpp's converter writes MixtralForCausalLM as a llama.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def is_gguf(path: str | Path | GGUFFile) -> bool:
    """Whether ``path`` is an open GGUF file or names one (by its suffix; the reader
    checks the magic)."""
    if isinstance(path, GGUFFile):
        return True
    return Path(path).suffix.lower() == ".gguf" and Path(path).is_file()


def open_gguf(path: str | Path | GGUFFile) -> GGUFFile:
    """``path`` opened, or as given when already open (reading the metadata takes
    seconds, so an engine opens its file once for config, tokenizer and weights)."""
    return path if isinstance(path, GGUFFile) else GGUFFile(path)


@functools.cache
def fast_reader():
    """gguf's reader over a plain ndarray view of its memory map (a class, built on first
    use because gguf is imported then).

    The reader slices the metadata one value at a time (a 49k-token vocabulary and its
    merges: about 250k slices), and each slice of an ``np.memmap`` runs the subclass's
    ``__array_finalize__``: on SmolLM2's file that was 2.1 of 3.6 s. A plain view of the
    same pages reads the same bytes (tensors stay memory-mapped) in 1.5 s.
    """

    class FastReader(gguf_package().GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._data

        @data.setter
        def data(self, value: np.ndarray) -> None:  # the base class assigns its np.memmap here
            self._data = value.view(np.ndarray)

    return FastReader


class GGUFFile:
    """One GGUF file, its metadata read once; tensors are memory-mapped until dequantized."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._reader = fast_reader()(self.path)
        except (ValueError, OSError) as e:
            raise ValueError(f"cannot read GGUF file {self.path}: {e}") from e
        self.architecture = self._get("general.architecture")
        if self.architecture not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"GGUF file {self.path.name}: unsupported architecture {self.architecture!r}; "
                f"supported: {sorted(GGUF_ARCHITECTURES)}"
            )
        self.hf_architecture = GGUF_ARCHITECTURES[self.architecture]
        if self.architecture == "llama" and self._arch("expert_count"):
            self.hf_architecture = MIXTRAL

    def __str__(self) -> str:
        return str(self.path)

    def _get(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            return default
        value = field.contents()
        return value.item() if isinstance(value, np.generic) else value

    def _arch(self, key: str, default: Any = None) -> Any:
        return self._get(f"{self.architecture}.{key}", default)

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self._reader.tensors]

    def config_dict(self) -> dict[str, Any]:
        """The model's hyper-parameters, spelled as Hugging Face's ``config.json``."""
        heads = self._arch("attention.head_count")
        hidden = self._arch("embedding_length")
        head_dim = self._arch("attention.key_length") or hidden // heads
        rotary = self._arch("rope.dimension_count", head_dim)
        if rotary != head_dim and self.architecture != "phi3":
            raise ValueError(
                f"GGUF file {self.path.name}: partial rotary embeddings (rope.dimension_count "
                f"{rotary} of head dim {head_dim}) are not supported for {self.architecture!r}"
            )
        if "rope_freqs.weight" in self.tensor_names:
            raise ValueError(
                f"GGUF file {self.path.name}: rope frequency factors (tensor rope_freqs.weight, "
                "llama3-style rope scaling) are not supported"
            )
        cfg = {
            "architectures": [self.hf_architecture],
            "vocab_size": self._arch("vocab_size") or self._embedding_rows(),
            "hidden_size": hidden,
            "intermediate_size": self._arch("feed_forward_length"),
            "num_hidden_layers": self._arch("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._arch("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "partial_rotary_factor": rotary / head_dim,
            "max_position_embeddings": self._arch("context_length", 2048),
            "rms_norm_eps": self._arch("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self._arch("rope.freq_base", 10000.0),
            # Phi-3 writes 0 for none (Phi-4-mini); the others write none.
            "sliding_window": self._arch("attention.sliding_window") or None,
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
            "bos_token_id": self._get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._get("tokenizer.ggml.eos_token_id"),
        }
        cfg.update(self._rope_scaling())
        cfg.update(self._experts())
        cfg.update(self._gemma3(head_dim))
        return cfg

    def _embedding_rows(self) -> int:
        # Older files have no <arch>.vocab_size; GGUF shapes list the fastest dimension first.
        embedding = next((t for t in self._reader.tensors if t.name == "token_embd.weight"), None)
        if embedding is None:
            raise ValueError(f"GGUF file {self.path.name}: no vocab_size and no token_embd.weight")
        return int(embedding.shape[-1])

    def _rope_scaling(self) -> dict[str, Any]:
        if self.architecture == "phi3":
            return self._longrope()
        kind = self._arch("rope.scaling.type", "none")
        if kind == "none":
            return {}
        if kind == "linear":
            return {"rope_scaling": {"rope_type": "linear", "factor": self._arch("rope.scaling.factor")}}
        raise ValueError(f"GGUF file {self.path.name}: unsupported rope scaling type {kind!r}")

    def _longrope(self) -> dict[str, Any]:
        """Phi-3's LongRoPE, which its converter writes as two tensors of factors plus the
        original context length and the attention factor (no ``rope.scaling.type``)."""
        tensors = {t.name: t for t in self._reader.tensors if t.name in ROPE_FACTORS.values()}
        if not tensors:
            return {}
        gguf = gguf_package()
        scaling = {
            key: gguf.quants.dequantize(tensors[name].data, tensors[name].tensor_type).tolist()
            for key, name in ROPE_FACTORS.items()
        }
        scaling.update(
            rope_type="longrope",
            original_max_position_embeddings=self._arch("rope.scaling.original_context_length"),
            attention_factor=self._arch("rope.scaling.attn_factor"),
        )
        return {"rope_scaling": scaling}

    def _experts(self) -> dict[str, Any]:
        """A mixture's experts, in every layer. llama.cpp's qwen3moe graph has no dense
        layers (no ``mlp_only_layers``) and always renormalises the top-k weights."""
        count, used = self._arch("expert_count"), self._arch("expert_used_count")
        if self.hf_architecture == MIXTRAL:
            return {"num_local_experts": count, "num_experts_per_tok": used}
        if self.architecture == "qwen3moe":
            return {
                "num_experts": count,
                "num_experts_per_tok": used,
                "moe_intermediate_size": self._arch("expert_feed_forward_length"),
                "norm_topk_prob": True,
            }
        return {}

    def _gemma3(self, head_dim: int) -> dict[str, Any]:
        """Gemma 3's settings that llama.cpp keeps in its code, not in the file
        (llama-model.cpp, LLM_ARCH_GEMMA3): given a sliding window, every sixth layer
        attends to the whole context and the others to the window, turning at a rotary
        base of 10000, unscaled; queries are scaled by head_dim ** -0.5, or by
        (hidden / heads) ** -0.5 in the 27B model (62 layers), as Google's reference code
        and the checkpoints' query_pre_attn_scalar have it."""
        if self.architecture != "gemma3":
            return {}
        layers, window = self._arch("block_count"), self._arch("attention.sliding_window")
        hidden, heads = self._arch("embedding_length"), self._arch("attention.head_count")
        sliding = [bool(window) and i % 6 < 5 for i in range(layers)]
        return {
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
            "hidden_activation": "gelu_pytorch_tanh",
            # llama.cpp applies it if the file has one; the engine refuses it.
            "final_logit_softcapping": self._arch("final_logit_softcapping"),
        }

    def tensors(self, dtype, num_heads: int, num_kv_heads: int) -> GGUFTensors:
        """Every weight under its Hugging Face name, dequantized into torch ``dtype`` as it
        is read (``GGUFTensors``). Unsupported types and names are refused here, before
        any tensor is read."""
        unsupported = sorted({t.tensor_type.name for t in self._reader.tensors} - SUPPORTED_TYPES)
        if unsupported:
            raise ValueError(
                f"GGUF file {self.path.name}: unsupported tensor type(s) {unsupported}; "
                f"supported: {sorted(SUPPORTED_TYPES)}"
            )
        layer_tensors = {**LAYER_TENSORS, **FAMILY_TENSORS[self.hf_architecture]}
        in_config = set(ROPE_FACTORS.values()) if self.architecture == "phi3" else set()
        by_name = {
            hf_name(t.name, layer_tensors, self.path.name): t for t in self._reader.tensors if t.name not in in_config
        }
        return GGUFTensors(self.architecture, by_name, dtype, num_heads, num_kv_heads)

    def tokenizer_parts(self) -> dict[str, Any]:
        """The tokenizer and what ``engine.tokenizer.Tokenizer`` needs besides it."""
        tokens = self._get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError(f"GGUF file {self.path.name} carries no tokenizer (tokenizer.ggml.tokens)")
        types = self._get("tokenizer.ggml.token_type") or [1] * len(tokens)

        def token(key: str) -> str | None:
            i = self._get(f"tokenizer.ggml.{key}")
            return None if i is None or i >= len(tokens) else tokens[i]

        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
        sentencepiece = self._get("tokenizer.ggml.model") == "llama"
        # A chat's end of turn stops generation as EOS does (llama.cpp: eot, eom).
        stop_ids = [self._get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return {
            "tokenizer": build_tokenizer(self._get, self.path.name, tokens, types),
            "chat_template": self._get("tokenizer.chat_template"),
            "bos_token": token("bos_token_id"),
            "eos_token": token("eos_token_id"),
            "add_bos_token": bool(self._get("tokenizer.ggml.add_bos_token", sentencepiece)),
            "eos_token_ids": tuple(i for i in stop_ids if i is not None),
            "bos_token_id": self._get("tokenizer.ggml.bos_token_id"),
        }
