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
  rows undone (its converter interleaves each head's rotary halves), for ``engine.loader``.

Architectures, quantization types and tokenizers outside what is listed here are refused
with an error that names them. Importing this module loads neither torch, transformers
nor gguf (the router builds its tokenizer through it, and the GPU image has no gguf):
the ``gguf`` package is imported when a file is opened.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from engine.optional import optional_import

# llama.cpp's architecture name -> the Hugging Face class it stands for.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Types the loader dequantizes, by gguf.GGMLQuantizationType name (every one tested
# against transformers' GGUF loader).
SUPPORTED_TYPES = frozenset(
    ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
)
# Architectures whose converter permuted the Q/K rows (convert_hf_to_gguf.py, LlamaModel).
_PERMUTED_QK = {"llama"}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")

# How text is split before BPE, by llama.cpp's ``tokenizer.ggml.pre``: the split each
# family's tokenizer.json does (llama.cpp's llama-vocab.cpp keeps the same table).
_GPT2 = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(regex: str) -> list:
    return [
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]


PRE_TOKENIZERS = {
    "default": _GPT2,
    "gpt2": _GPT2,
    # SmolLM's tokenizer.json: every digit on its own, then GPT-2's split.
    "smollm": [pre_tokenizers.Digits(individual_digits=True), *_GPT2],
    "llama-bpe": _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": _split_then_bytes(_LLAMA3_SPLIT),
    "smaug-bpe": _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": _split_then_bytes(_QWEN2_SPLIT),
    "deepseek-r1-qwen": _split_then_bytes(_QWEN2_SPLIT),
}
_CONTROL = 3  # llama.cpp's token type of a special token (BOS, <|im_end|>, ...)


def is_gguf(path: "str | Path | GGUFFile") -> bool:
    """Whether ``path`` is an open GGUF file or names one (by its suffix; the reader
    checks the magic)."""
    if isinstance(path, GGUFFile):
        return True
    return Path(path).suffix.lower() == ".gguf" and Path(path).is_file()


def open_gguf(path: "str | Path | GGUFFile") -> "GGUFFile":
    """``path`` opened, or as given when already open (reading the metadata takes
    seconds, so an engine opens its file once for config, tokenizer and weights)."""
    return path if isinstance(path, GGUFFile) else GGUFFile(path)


def gguf_package():
    """The ``gguf`` package; an ImportError that names it where it is not installed."""
    return optional_import("gguf", "reading GGUF files")


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
        if rotary != head_dim:
            raise ValueError(
                f"GGUF file {self.path.name}: partial rotary embeddings (rope.dimension_count "
                f"{rotary} of head dim {head_dim}) are not supported"
            )
        if "rope_freqs.weight" in self.tensor_names:
            raise ValueError(
                f"GGUF file {self.path.name}: rope frequency factors (tensor rope_freqs.weight, "
                "llama3-style rope scaling) are not supported"
            )
        cfg = {
            "architectures": [GGUF_ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self._arch("vocab_size") or self._embedding_rows(),
            "hidden_size": hidden,
            "intermediate_size": self._arch("feed_forward_length"),
            "num_hidden_layers": self._arch("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._arch("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "max_position_embeddings": self._arch("context_length", 2048),
            "rms_norm_eps": self._arch("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self._arch("rope.freq_base", 10000.0),
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
            "bos_token_id": self._get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._get("tokenizer.ggml.eos_token_id"),
        }
        cfg.update(self._rope_scaling())
        return cfg

    def _embedding_rows(self) -> int:
        # Older files have no <arch>.vocab_size; GGUF shapes list the fastest dimension first.
        embedding = next((t for t in self._reader.tensors if t.name == "token_embd.weight"), None)
        if embedding is None:
            raise ValueError(f"GGUF file {self.path.name}: no vocab_size and no token_embd.weight")
        return int(embedding.shape[-1])

    def _rope_scaling(self) -> dict[str, Any]:
        kind = self._arch("rope.scaling.type", "none")
        if kind == "none":
            return {}
        if kind == "linear":
            return {"rope_scaling": {"rope_type": "linear", "factor": self._arch("rope.scaling.factor")}}
        raise ValueError(f"GGUF file {self.path.name}: unsupported rope scaling type {kind!r}")

    def tensors(self, dtype, num_heads: int, num_kv_heads: int) -> dict:
        """Every weight under its Hugging Face name, dequantized into torch ``dtype``."""
        import torch

        unsupported = sorted({t.tensor_type.name for t in self._reader.tensors} - SUPPORTED_TYPES)
        if unsupported:
            raise ValueError(
                f"GGUF file {self.path.name}: unsupported tensor type(s) {unsupported}; "
                f"supported: {sorted(SUPPORTED_TYPES)}"
            )
        gguf = gguf_package()
        out: dict[str, torch.Tensor] = {}
        for t in self._reader.tensors:
            name = _hf_name(t.name, self.path.name)
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            values = values.reshape(tuple(int(d) for d in reversed(t.shape)))
            if self.architecture in _PERMUTED_QK and ".q_proj." in name:
                values = _unpermute(values, num_heads)
            elif self.architecture in _PERMUTED_QK and ".k_proj." in name:
                values = _unpermute(values, num_kv_heads)
            # F32 comes back as a view of the read-only memory map: copy it out.
            out[name] = torch.from_numpy(np.array(values, copy=not values.flags.writeable)).to(dtype)
        return out

    def tokenizer_parts(self) -> dict[str, Any]:
        """The tokenizer and what ``engine.tokenizer.Tokenizer`` needs besides it."""
        tokens = self._get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError(f"GGUF file {self.path.name} carries no tokenizer (tokenizer.ggml.tokens)")
        types = self._get("tokenizer.ggml.token_type") or [1] * len(tokens)

        def token(key: str) -> str | None:
            i = self._get(f"tokenizer.ggml.{key}")
            return None if i is None or i >= len(tokens) else tokens[i]

        # A chat's end of turn stops generation as EOS does (llama.cpp: eot, eom).
        stop_ids = [self._get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return {
            "tokenizer": self._build_tokenizer(tokens, types),
            "chat_template": self._get("tokenizer.chat_template"),
            "bos_token": token("bos_token_id"),
            "eos_token": token("eos_token_id"),
            "add_bos_token": bool(self._get("tokenizer.ggml.add_bos_token", False)),
            "eos_token_ids": tuple(i for i in stop_ids if i is not None),
            "bos_token_id": self._get("tokenizer.ggml.bos_token_id"),
        }

    def _build_tokenizer(self, tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
        kind = self._get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF file {self.path.name}: unsupported tokenizer model {kind!r}; "
                "supported: 'gpt2' (byte-level BPE)"
            )
        pre = self._get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise ValueError(
                f"GGUF file {self.path.name}: unsupported pre-tokenizer {pre!r}; "
                f"supported: {sorted(PRE_TOKENIZERS)}"
            )
        merges = [tuple(m.split(" ", 1)) for m in self._get("tokenizer.ggml.merges", [])]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence(PRE_TOKENIZERS[pre])
        tok.decoder = decoders.ByteLevel()
        alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        # Control tokens are matched whole in the text and skipped when decoding; one
        # spelled outside the byte alphabet would be a new id past the model's vocabulary.
        specials = [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types)
            if kind == _CONTROL and set(t) <= alphabet
        ]
        tok.add_special_tokens(specials)
        return tok


def _hf_name(name: str, file_name: str) -> str:
    m = _LAYER_NAME.match(name)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"
    stem, _, kind = name.rpartition(".")
    if stem in _GLOBAL_TENSORS and kind in ("weight", "bias"):
        return f"{_GLOBAL_TENSORS[stem]}.{kind}"
    raise ValueError(f"GGUF file {file_name}: tensor {name!r} has no place in the model")


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's ``permute``: back to HF's rotate-half row order."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
