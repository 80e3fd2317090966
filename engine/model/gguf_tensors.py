"""A GGUF file's weights under Hugging Face names: llama.cpp's tensor names and types, and
``GGUFTensors``, which dequantizes each weight as it is read.

``engine/model/gguf_checkpoint.py``'s ``GGUFFile.tensors`` names the file's tensors with
this module's tables (``hf_name``) and hands them to ``GGUFTensors``, which the loader
(``engine.model.loader``) reads. Importing it loads neither torch nor gguf: ``gguf_package``
imports gguf when a tensor is dequantized, and ``GGUFTensors.read`` imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from engine.core.optional import optional_import

# The class of a ``llama`` file with experts: llama.cpp's converter writes a Mixtral as a llama.
MIXTRAL = "MixtralForCausalLM"
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
LAYER_TENSORS = {
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
FAMILY_TENSORS = {
    "LlamaForCausalLM": {},
    "Qwen2ForCausalLM": {},
    "Qwen3ForCausalLM": _QK_NORMS,
    # Phi-3's checkpoints keep q/k/v fused, and gate and up (in that order) in ffn_up.
    "Phi3ForCausalLM": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    MIXTRAL: {
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
ROPE_FACTORS = {
    "long_factor": "rope_factors_long.weight",
    "short_factor": "rope_factors_short.weight",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_package():
    """The ``gguf`` package; an ImportError that names it where it is not installed."""
    return optional_import("gguf", "reading GGUF files")


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


def hf_name(name: str, layer_tensors: dict[str, str], file_name: str) -> str:
    """The Hugging Face name of llama.cpp's tensor ``name``; a ValueError naming the file and
    the tensor when the model has no place for it."""
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
