"""The loader takes every tensor of a checkpoint or refuses it, naming what it would drop.

A dropped bias or norm weight leaves a model that runs and answers wrongly, so a
checkpoint tensor the model has no place for is an error. Only tensors known to be
harmless are let through: rotary tables some exports carry, and the output projection
of a tied-embedding model.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.model.loader import load_model, resolve_dtype
from tests.helpers import build_hf_checkpoint

SMALL = dict(num_hidden_layers=1)


def _add_tensors(model_dir, **extra: torch.Tensor) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    tensors.update(extra)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_a_checkpoint_with_weights_the_model_does_not_use_is_refused_naming_them(tmp_path, default_model):
    # A Llama config without attention_bias, over weights that have q and o biases:
    # loading it anyway would serve a different model from the one trained.
    ckpt = build_hf_checkpoint(tmp_path, "llama", default_model, **SMALL)
    _add_tensors(
        ckpt,
        **{
            "model.layers.0.self_attn.q_proj.bias": torch.randn(64),
            "model.layers.0.self_attn.o_proj.bias": torch.randn(64),
        },
    )
    with pytest.raises(ValueError, match="2 weight") as e:
        load_model(ckpt)
    for name in ("model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.o_proj.bias"):
        assert name in str(e.value), f"the error should name {name}: {e.value}"


def test_an_untied_output_projection_is_refused_when_the_config_ties_embeddings(tmp_path, default_model):
    ckpt = build_hf_checkpoint(tmp_path, "llama", default_model, tie_word_embeddings=True, **SMALL)
    _add_tensors(ckpt, **{"model.extra_head.weight": torch.randn(4, 64)})
    with pytest.raises(ValueError, match="model.extra_head.weight"):
        load_model(ckpt)


def test_a_tied_head_copy_and_saved_rotary_tables_are_accepted(tmp_path, default_model):
    ckpt = build_hf_checkpoint(tmp_path, "qwen2", default_model, **SMALL)
    tensors = load_file(ckpt / "model.safetensors")
    _add_tensors(
        ckpt,
        **{
            "lm_head.weight": tensors["model.embed_tokens.weight"].clone(),
            "model.layers.0.self_attn.rotary_emb.inv_freq": torch.rand(8),
        },
    )
    model = load_model(ckpt, pack=False)  # packed, the head is a reordered copy (test_packed_linear)
    assert model.lm_head.weight is model.embed_tokens.weight, "a tied model's head is its embedding"


# Qwen2 has q/k/v biases of its own; Llama has them (and o, MLP biases) when its config says.
BIASED = {"llama": dict(attention_bias=True, mlp_bias=True), "qwen2": {}}


@pytest.mark.parametrize("arch", list(BIASED))
def test_biases_and_norm_weights_are_loaded_as_saved(tmp_path, default_model, arch):
    """The test checkpoints hold random biases and norms, not transformers' 0 and 1."""
    ckpt = build_hf_checkpoint(tmp_path, arch, default_model, **BIASED[arch], **SMALL)
    saved = load_file(ckpt / "model.safetensors")
    model = load_model(ckpt)
    layer = model.layers[0]
    prefix = "model.layers.0"
    q, k, v = (saved[f"{prefix}.self_attn.{p}_proj.bias"] for p in "qkv")
    expected = {
        "q/k/v biases": (layer.self_attn.qkv_proj.bias, torch.cat([q, k, v])),
        "input norm": (layer.input_layernorm.weight, saved[f"{prefix}.input_layernorm.weight"]),
        "post-attention norm": (
            layer.post_attention_layernorm.weight, saved[f"{prefix}.post_attention_layernorm.weight"]
        ),
        "final norm": (model.norm.weight, saved["model.norm.weight"]),
    }
    if arch == "llama":
        g, u = (saved[f"{prefix}.mlp.{p}_proj.bias"] for p in ("gate", "up"))
        expected["o bias"] = (layer.self_attn.o_proj.bias, saved[f"{prefix}.self_attn.o_proj.bias"])
        expected["gate/up biases"] = (layer.mlp.gate_up_proj.bias, torch.cat([g, u]))
        expected["down bias"] = (layer.mlp.down_proj.bias, saved[f"{prefix}.mlp.down_proj.bias"])
    for what, (got, want) in expected.items():
        assert want.unique().numel() > 1, f"the checkpoint's {what} should be random, not constant"
        assert torch.equal(got, want), f"{what}: the model should hold the checkpoint's values"


def test_a_config_without_architectures_falls_back_on_model_type_as_transformers_does(tmp_path, default_model):
    import json

    from engine.model.model_config import ModelConfig

    ckpt = build_hf_checkpoint(tmp_path, "qwen2", default_model, **SMALL)
    path = ckpt / "config.json"
    cfg = json.loads(path.read_text())
    del cfg["architectures"]
    path.write_text(json.dumps(cfg))
    assert ModelConfig.from_pretrained(ckpt).architecture == "Qwen2ForCausalLM"
    assert load_model(ckpt).config.qkv_bias, "model_type qwen2 should give the Qwen2 layout (q/k/v bias)"


def test_an_unsupported_architecture_is_refused_naming_it():
    from engine.model.model_config import ModelConfig

    with pytest.raises(ValueError, match="'gpt2'"):
        ModelConfig.from_dict({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"], "model_type": "llama"})


@pytest.mark.parametrize(
    "setting, device, want",
    [
        ("auto", "cuda", torch.bfloat16),
        ("auto", "cuda:1", torch.bfloat16),
        ("auto", "cpu", torch.float32),
        ("float32", "cuda", torch.float32),
        ("float16", "cpu", torch.float16),
        (torch.bfloat16, "cpu", torch.bfloat16),
    ],
)
def test_auto_dtype_is_bfloat16_on_cuda_and_float32_elsewhere(setting, device, want):
    assert resolve_dtype(setting, device) == want, f"{setting!r} on {device} should be {want}"


def test_engine_default_dtype_is_auto():
    assert EngineConfig().dtype == "auto", "the engine should pick its dtype from the device"


def test_unknown_dtype_names_the_choices():
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        resolve_dtype("fp8", "cpu")


def test_loading_imports_neither_dynamo_nor_sympy(tmp_path, default_model):
    """Built on the meta device, the model must not reach torch's reference kernels there:
    their first call imports torch._dynamo and sympy, seconds in every worker process."""
    import subprocess
    import sys

    ckpt = build_hf_checkpoint(tmp_path, "llama", default_model, **SMALL)
    code = (
        "import sys; from engine.model.loader import load_model; "
        f"m = load_model({str(ckpt)!r}); "
        "assert m.embed_tokens.weight.device.type == 'cpu' and m.rotary.cos.device.type == 'cpu'; "
        "print(sorted(k for k in ('torch._dynamo', 'sympy') if k in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_longrope_tables_are_transformers_short_and_long_ones_by_position(tmp_path, default_model):
    """Phi-3's LongRoPE over 3/4 of each head: positions under the original context take
    the short factors, the others the long ones, both scaled by the attention factor,
    as transformers computes them for a sequence under / over that length."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from engine.model.model_config import ModelConfig

    ckpt = build_hf_checkpoint(tmp_path, "phi3", default_model, **SMALL)
    model = load_model(ckpt, pack=False)
    config = ModelConfig.from_pretrained(ckpt)
    assert config.rotary_dims == 3 * config.head_dim // 4 and config.rope_original_positions == 512
    hf = Phi3RotaryEmbedding(AutoConfig.from_pretrained(ckpt))
    x = torch.zeros(1, 1, config.head_dim)
    for seq_len in (300, 700):  # under the switch: short factors; over it: long ones
        positions = torch.arange(seq_len).unsqueeze(0)
        cos, sin = hf(x, positions)
        rows = slice(0, seq_len) if seq_len < 512 else slice(512, seq_len)
        assert torch.allclose(model.rotary.cos[rows], cos[0, rows], atol=1e-6), f"cos at {rows}"
        assert torch.allclose(model.rotary.sin[rows], sin[0, rows], atol=1e-6), f"sin at {rows}"
    assert hf.attention_scaling != 1.0, "the checkpoint should scale its rotary (max 1024 over 512 original)"
