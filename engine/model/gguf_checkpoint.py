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
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from engine.core.optional import optional_import

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
_MIXTRAL = "MixtralForCausalLM"
# Types the loader dequantizes, by gguf.GGMLQuantizationType name (every one tested
# against transformers' GGUF loader).
SUPPORTED_TYPES = frozenset(
    ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
)
# Architectures whose converter permuted the Q/K rows (convert_hf_to_gguf.py, LlamaModel).
_PERMUTED_QK = {"llama"}
# Architectures whose converter stored every norm's weight plus 1 (Gemma3Model): Gemma's
# RMSNorm scales by 1 + weight, llama.cpp's by the weight. The loader takes the 1 off.
_NORMS_PLUS_ONE = {"gemma3"}

# llama.cpp's names for a layer's tensors -> Hugging Face's (under ``model.layers.N.``).
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
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Each family's names on top of those (convert_hf_to_gguf.py and gguf-py's tensor map).
# A mixture's experts come stacked, one tensor per layer and projection, under the name
# the converter gives the stack before mapping it: the per-expert name less the index.
_FAMILY_TENSORS = {
    "LlamaForCausalLM": {},
    "Qwen2ForCausalLM": {},
    "Qwen3ForCausalLM": _QK_NORMS,
    # Phi-3's checkpoints keep q/k/v fused, and gate and up (in that order) in ffn_up.
    "Phi3ForCausalLM": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    _MIXTRAL: {
        "ffn_gate_inp": "block_sparse_moe.gate",
        "ffn_gate_exps": "block_sparse_moe.experts.w1",
        "ffn_up_exps": "block_sparse_moe.experts.w3",
        "ffn_down_exps": "block_sparse_moe.experts.w2",
    },
    "Qwen3MoeForCausalLM": {
        **_QK_NORMS,
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.experts.gate_proj",
        "ffn_up_exps": "mlp.experts.up_proj",
        "ffn_down_exps": "mlp.experts.down_proj",
    },
    # Gemma 3's norms on both sides of each sublayer: ffn_norm is the one before the MLP.
    "Gemma3ForCausalLM": {
        **_QK_NORMS,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Phi-3's LongRoPE factors, which the converter stores as tensors: read into the config.
_ROPE_FACTORS = {
    "long_factor": "rope_factors_long.weight",
    "short_factor": "rope_factors_short.weight",
}
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
# llama.cpp's token types that it matches whole in the text: the unknown token, special
# ones (BOS, <|im_end|>, ...), and ones added to the vocabulary unspecial (Qwen3's <think>).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4
_SPACE = "\u2581"  # SentencePiece's spelling of a space


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
        self.hf_architecture = GGUF_ARCHITECTURES[self.architecture]
        if self.architecture == "llama" and self._arch("expert_count"):
            self.hf_architecture = _MIXTRAL

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
        tensors = {t.name: t for t in self._reader.tensors if t.name in _ROPE_FACTORS.values()}
        if not tensors:
            return {}
        gguf = gguf_package()
        scaling = {
            key: gguf.quants.dequantize(tensors[name].data, tensors[name].tensor_type).tolist()
            for key, name in _ROPE_FACTORS.items()
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
        if self.hf_architecture == _MIXTRAL:
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
        layer_tensors = {**_LAYER_TENSORS, **_FAMILY_TENSORS[self.hf_architecture]}
        in_config = set(_ROPE_FACTORS.values()) if self.architecture == "phi3" else set()
        by_name = {
            _hf_name(t.name, layer_tensors, self.path.name): t for t in self._reader.tensors if t.name not in in_config
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
            "tokenizer": self._build_tokenizer(tokens, types),
            "chat_template": self._get("tokenizer.chat_template"),
            "bos_token": token("bos_token_id"),
            "eos_token": token("eos_token_id"),
            "add_bos_token": bool(self._get("tokenizer.ggml.add_bos_token", sentencepiece)),
            "eos_token_ids": tuple(i for i in stop_ids if i is not None),
            "bos_token_id": self._get("tokenizer.ggml.bos_token_id"),
        }

    def _build_tokenizer(self, tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
        kind = self._get("tokenizer.ggml.model")
        if kind == "gpt2":
            tok = self._byte_level_bpe(tokens)
        elif kind == "llama":
            tok = self._sentencepiece_bpe(tokens)
        else:
            raise ValueError(
                f"GGUF file {self.path.name}: unsupported tokenizer model {kind!r}; "
                "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)"
            )
        # Matched whole in the text, as llama.cpp does; all but the user-defined ones are
        # special, skipped when decoding. In a byte-level vocabulary, one spelled outside
        # the byte alphabet would be a new id past the model's vocabulary.
        alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if kind == "gpt2" else None

        def added(token_types: tuple[int, ...], special: bool) -> list[AddedToken]:
            return [
                AddedToken(t, special=special, normalized=False)
                for t, k in zip(tokens, types)
                if k in token_types and (alphabet is None or set(t) <= alphabet)
            ]

        tok.add_special_tokens(added((_UNKNOWN, _CONTROL), special=True))
        tok.add_tokens(added((_USER_DEFINED,), special=False))
        return tok

    def _byte_level_bpe(self, tokens: list[str]) -> tokenizers.Tokenizer:
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
        return tok

    def _sentencepiece_bpe(self, tokens: list[str]) -> tokenizers.Tokenizer:
        """SentencePiece's BPE as a ``tokenizers`` BPE with byte fallback (``<0x..>``
        tokens), as transformers' GGUF loader builds it: merges recovered from the
        vocabulary's scores, spaces spelled ``▁``.

        The text gets a leading ``▁`` where llama.cpp gives it one (``add_space_prefix``):
        at the start and after every added token. A normalizer does that, as in
        transformers' GGUF Phi-3 tokenizer and the tokenizer.json of Llama 2 and Mistral
        (transformers' other GGUF SentencePiece tokenizers prefix the start only)."""
        scores = self._get("tokenizer.ggml.scores")
        if scores is None:
            raise ValueError(f"GGUF file {self.path.name}: a SentencePiece vocabulary without scores")
        vocab = {tok: i for i, tok in enumerate(tokens)}
        merges = _merges_by_score(tokens, scores)
        unk = self._get("tokenizer.ggml.unknown_token_id")
        tok = tokenizers.Tokenizer(models.BPE(
            vocab=vocab, merges=merges, unk_token=None if unk is None else tokens[unk],
            fuse_unk=True, byte_fallback=True,
        ))  # fmt: skip
        prefix = bool(self._get("tokenizer.ggml.add_space_prefix", True))
        spaces = [normalizers.Replace(" ", _SPACE)]
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE)] * prefix + spaces)
        strip = [decoders.Strip(" ", 1, 0)] if prefix else []
        tok.decoder = decoders.Sequence(
            [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
        )
        return tok


class GGUFTensors(Mapping):
    """A GGUF file's weights under Hugging Face names, each dequantized when it is read.

    The ``gguf`` package dequantizes a tensor whole (a quantized block spans many values
    of a row), so a part of one (``read`` with an index: a tensor-parallel rank's slice)
    is cut right after its tensor is dequantized, in float32, and copied out: a rank
    holds at most one whole dequantized matrix beyond its own slices at any time, never
    the whole model. The last tensor read is kept, so the three parts a rank reads of a
    fused q/k/v matrix dequantize it once. Any part of any tensor can be cut this way;
    what cannot split (heads, intermediate rows) is refused by ``Shard``, naming the limit.
    """

    def __init__(self, architecture: str, tensors: dict, dtype, num_heads: int, num_kv_heads: int) -> None:
        self._architecture = architecture
        self._tensors = tensors  # Hugging Face name -> gguf's ReaderTensor
        self._dtype = dtype
        self._heads = {".q_proj.": num_heads, ".k_proj.": num_kv_heads}
        self._last: tuple[str, np.ndarray] | None = None

    def __getitem__(self, name: str):
        return self.read(name)

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor ``name``'s shape, slowest dimension first (as torch has it)."""
        return tuple(int(d) for d in reversed(self._tensors[name].shape))

    def read(self, name: str, index: tuple[slice, ...] = ()):
        """Tensor ``name`` in the serving dtype, or its ``index`` (a slice per leading
        dimension), copied out of the whole dequantized tensor."""
        import torch

        values = self._dequantized(name)
        if index:
            values = np.array(values[index])
        # F32 comes back as a view of the read-only memory map: copy it out.
        return torch.from_numpy(np.array(values, copy=not values.flags.writeable)).to(self._dtype)

    def _dequantized(self, name: str) -> np.ndarray:
        """The whole of tensor ``name`` in float32, in Hugging Face's layout."""
        if self._last is not None and self._last[0] == name:
            return self._last[1]
        t = self._tensors[name]
        values = gguf_package().quants.dequantize(t.data, t.tensor_type).reshape(self.shape(name))
        heads = next((n for key, n in self._heads.items() if key in name), None)
        if self._architecture in _PERMUTED_QK and heads is not None:
            values = _unpermute(values, heads)
        elif self._architecture in _NORMS_PLUS_ONE and name.endswith("norm.weight"):
            values = values - 1  # in float32, before the cast to dtype
        self._last = (name, values)
        return values


def _merges_by_score(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a token into two
    tokens, best-scored first (transformers' ``generate_merges``, which its GGUF loader
    runs: SentencePiece merges the pair whose result scores highest, as BPE's ranks do)."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = []
    for token, score in dict(zip(tokens, scores)).items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token))]
        found = [(a, b) for a, b in pairs if a in vocab and b in vocab]
        found.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend((a, b, score) for a, b in found)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _hf_name(name: str, layer_tensors: dict[str, str], file_name: str) -> str:
    m = _LAYER_NAME.match(name)
    if m and m.group(2) in layer_tensors:
        return f"model.layers.{m.group(1)}.{layer_tensors[m.group(2)]}.{m.group(3)}"
    stem, _, kind = name.rpartition(".")
    if stem in _GLOBAL_TENSORS and kind in ("weight", "bias"):
        return f"{_GLOBAL_TENSORS[stem]}.{kind}"
    raise ValueError(f"GGUF file {file_name}: tensor {name!r} has no place in the model")


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's ``permute``: back to HF's rotate-half row order."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
