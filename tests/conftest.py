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
