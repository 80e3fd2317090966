"""Shared fixtures: small random-weight checkpoints built with transformers."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="session")
def tandem_home(tmp_path_factory) -> Path:
    """A private TANDEM_HOME so tests never touch (or depend on) the user's cache."""
    home = tmp_path_factory.mktemp("tandem-home")
    os.environ["TANDEM_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def default_model(tandem_home) -> Path:
    from engine.default_model import ensure_default_model

    return ensure_default_model()


def build_hf_checkpoint(out_dir: Path, arch: str, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Save a random-weight HF model of the given family, with the default tokenizer.

    Biases and norm weights are random too: transformers starts them at 0 and 1, the
    values a loader that dropped them would also leave.
    """
    import json

    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
    )
    common.update(overrides)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, **common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=1, tie_word_embeddings=True, **common))
    else:
        raise ValueError(arch)
    _randomise_biases_and_norms(model)
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def _randomise_biases_and_norms(model) -> None:
    std = model.config.initializer_range
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, std)
            elif name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)


# HF tensor name pieces -> llama.cpp's, for writing test GGUF files (the inverse of
# engine/gguf_checkpoint.py's table, spelled out again so a mistake there shows here).
_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip
_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# Where each K-quant block keeps its fp16 scales (ggml-common.h): random bytes there could be inf/nan.
_K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _gguf_name(hf: str) -> str:
    stem, kind = hf.rsplit(".", 1)
    if stem in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[stem]}.{kind}"
    _, _, layer, part = stem.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER[part]}.{kind}"


def _llama_cpp_permute(w, n_head: int):
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave each head's rotary halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensor(values, qtype, rng):
    """``values`` stored as ``qtype``: quantized by the gguf package where it can, else
    (K-quants) random blocks with sane scales, since only the file's decoding is tested."""
    import gguf
    import numpy as np

    if qtype.name not in _K_SCALES:
        data = gguf.quants.quantize(values, qtype)
    else:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (values.shape[0], values.shape[1] // block, size), dtype=np.uint8)
        for at in _K_SCALES[qtype.name]:
            scale = rng.uniform(1e-3, 4e-3, data.shape[:2]).astype(np.float16)
            data[..., at : at + 2] = scale[..., None].view(np.uint8)
        data = data.reshape(values.shape[0], -1)
    return data


def build_gguf(path: Path, hf_dir: Path, arch: str = "llama", matrix_type: str = "F32", pre: str = "default") -> Path:
    """Write the HF checkpoint in ``hf_dir`` (with the default model's byte-level BPE
    tokenizer) as one GGUF file as llama.cpp's converter would: llama.cpp names, Q/K rows
    permuted for llama, 2-D weights stored as ``matrix_type``, norms and biases as F32."""
    import json

    import gguf
    import numpy as np
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    w.add_vocab_size(cfg["vocab_size"])
    _add_gguf_tokenizer(w, hf_dir, pre)
    rng = np.random.default_rng(0)
    qtype = gguf.GGMLQuantizationType[matrix_type]
    for name, t in load_file(hf_dir / "model.safetensors").items():
        values = t.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            values = _llama_cpp_permute(values, heads)
        elif arch == "llama" and ".k_proj." in name:
            values = _llama_cpp_permute(values, kv_heads)
        if values.ndim == 2:
            # The writer takes a quantized tensor's shape in bytes, as quantize returns it.
            w.add_tensor(_gguf_name(name), _gguf_tensor(values, qtype, rng), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_gguf_tokenizer(w, hf_dir: Path, pre: str) -> None:
    """The tokenizer.json of ``hf_dir`` as llama.cpp stores a byte-level BPE."""
    import json

    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    for a in tok["added_tokens"]:
        vocab[a["content"]] = a["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[tok_cfg["bos_token"]])
    w.add_eos_token_id(vocab[tok_cfg["eos_token"]])
    w.add_add_bos_token(True)
    w.add_chat_template(tok_cfg["chat_template"])
