"""Tests for engine.model.default_model: the built-in tandem-tiny-llama checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import engine.model.default_model as dm
from engine.model.default_model import DEFAULT_MODEL_NAME, default_model_dir, ensure_default_model, make_model
from engine.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tandem-tiny-llama"))


@pytest.fixture(scope="session")
def hf_model(model_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM.from_pretrained(model_dir)


@pytest.fixture
def fresh_tandem_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty TANDEM_HOME private to one test (unlike conftest's shared one)."""
    home = tmp_path / "tandem-home"
    monkeypatch.setenv("TANDEM_HOME", str(home))
    return home


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------ make_model


def test_make_model_writes_every_checkpoint_file(model_dir: Path) -> None:
    missing = [name for name in CHECKPOINT_FILES if not (model_dir / name).is_file()]
    assert not missing, f"make_model should write {CHECKPOINT_FILES}; missing {missing}"


def test_make_model_is_byte_for_byte_deterministic(model_dir: Path, tmp_path: Path) -> None:
    again = make_model(tmp_path / "again")
    for name in CHECKPOINT_FILES:
        assert _sha256(again / name) == _sha256(model_dir / name), (
            f"{name} should be identical across builds"
        )


def test_tokenizer_training_is_deterministic_across_processes(model_dir: Path) -> None:
    # A fresh interpreter gets fresh hash seeds, and a different thread count
    # changes how the trainer splits work; neither may change the result.
    code = (
        "import sys; from engine.model.default_model import train_tokenizer; "
        "sys.stdout.write(train_tokenizer().to_str())"
    )
    env = {**os.environ, "RAYON_NUM_THREADS": "3", "PYTHONHASHSEED": "random"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout
    assert json.loads(out) == json.loads(
        (model_dir / "tokenizer.json").read_text(encoding="utf-8")
    ), "a tokenizer trained in another process should equal the one make_model saved"
    assert dm.train_tokenizer().to_str() == out.decode("utf-8"), (
        "tokenizer JSON should be the same text in every process"
    )


def test_seed_changes_the_weights_but_not_the_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    other = make_model(tmp_path / "seed1", seed=1)
    assert _sha256(other / "model.safetensors") != _sha256(model_dir / "model.safetensors"), (
        "a different seed should give different weights"
    )
    assert _sha256(other / "tokenizer.json") == _sha256(model_dir / "tokenizer.json"), (
        "the tokenizer should not depend on the seed"
    )


def test_config_describes_the_tiny_llama_architecture(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 6,
        # grouped-query attention: 6 query heads share 2 KV heads
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64,
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    wrong = {k: config.get(k) for k, v in expected.items() if config.get(k) != v}
    assert not wrong, f"config.json fields differ from {expected}: {wrong}"


def test_vocab_size_and_special_ids_agree_with_the_tokenizer(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    gen = json.loads((model_dir / "generation_config.json").read_text())
    tok = Tokenizer.from_pretrained(model_dir)
    assert config["vocab_size"] == tok.vocab_size, (
        "config vocab_size should be the tokenizer's exact size"
    )
    assert 3500 <= tok.vocab_size <= 4096, (
        f"vocab should be about 4096 tokens, got {tok.vocab_size}"
    )
    assert config["bos_token_id"] == tok.token_to_id("<s>"), "config bos_token_id should be <s>"
    assert config["eos_token_id"] == tok.token_to_id("</s>"), "config eos_token_id should be </s>"
    assert gen["eos_token_id"] == [tok.token_to_id("</s>"), tok.token_to_id("<|end|>")], (
        "generation should stop at </s> and at the end-of-turn token <|end|>"
    )


def test_weights_have_hf_names_shapes_and_initialisation(model_dir: Path) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    expected_shapes = {
        "model.embed_tokens.weight": (vocab, 384),
        "lm_head.weight": (vocab, 384),
        "model.norm.weight": (384,),
    }
    for i in range(6):
        p = f"model.layers.{i}"
        expected_shapes |= {
            f"{p}.self_attn.q_proj.weight": (384, 384),
            f"{p}.self_attn.k_proj.weight": (128, 384),
            f"{p}.self_attn.v_proj.weight": (128, 384),
            f"{p}.self_attn.o_proj.weight": (384, 384),
            f"{p}.mlp.gate_proj.weight": (1024, 384),
            f"{p}.mlp.up_proj.weight": (1024, 384),
            f"{p}.mlp.down_proj.weight": (384, 1024),
            f"{p}.input_layernorm.weight": (384,),
            f"{p}.post_attention_layernorm.weight": (384,),
        }
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    assert shapes == expected_shapes, "tensor names/shapes should follow the HF Llama layout"
    for name, t in tensors.items():
        assert t.dtype == torch.float32, f"{name} should be float32"
        if t.ndim == 1:
            assert torch.equal(t, torch.ones_like(t)), f"norm weight {name} should be all ones"
        else:
            assert abs(t.std().item() - 0.02) < 0.002, f"{name} should be drawn with std 0.02"
            assert abs(t.mean().item()) < 0.002, f"{name} should be drawn with mean 0"


def test_transformers_loads_the_checkpoint_with_10_to_30m_parameters(
    hf_model, model_dir: Path
) -> None:
    n_params = sum(p.numel() for p in hf_model.parameters())
    assert 10_000_000 <= n_params <= 30_000_000, f"expected 10-30M parameters, got {n_params:,}"
    saved = load_file(model_dir / "model.safetensors")
    loaded = hf_model.state_dict()
    assert set(saved) == set(loaded), (
        "every saved tensor should map onto a model parameter and vice versa"
    )
    assert torch.equal(loaded["lm_head.weight"], saved["lm_head.weight"]), (
        "lm_head should be loaded from the file, not tied to the embeddings"
    )


def test_transformers_model_runs_on_our_token_ids(hf_model, model_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(model_dir)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi there"}]))
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), tok.vocab_size), "logits should cover the whole vocabulary"
    assert torch.isfinite(logits).all(), "logits of the random model should be finite"


def test_transformers_auto_tokenizer_loads_the_checkpoint(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    tok = Tokenizer.from_pretrained(model_dir)
    text = "The river runs slowly 🌊 through the valley."
    assert hf_tok(text)["input_ids"] == tok.encode(text), (
        "AutoTokenizer should tokenize like our Tokenizer"
    )


# --------------------------------------------------- default_model_dir / ensure


def test_default_model_dir_lives_under_tandem_home(fresh_tandem_home: Path) -> None:
    assert default_model_dir() == fresh_tandem_home / "models" / f"{DEFAULT_MODEL_NAME}-v1", (
        "the default model should live in $TANDEM_HOME/models/tandem-tiny-llama-v1"
    )


def test_tandem_home_defaults_to_the_user_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TANDEM_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert (
        default_model_dir() == tmp_path / ".cache" / "tandem" / "models" / "tandem-tiny-llama-v1"
    ), "without TANDEM_HOME the model should live under ~/.cache/tandem"


def test_ensure_default_model_builds_once_then_reuses_the_directory(
    fresh_tandem_home: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = ensure_default_model()
    assert first == default_model_dir(), "ensure_default_model should return default_model_dir()"
    for name in CHECKPOINT_FILES:
        assert _sha256(first / name) == _sha256(model_dir / name), (
            f"the built {name} should be make_model's"
        )
    mtimes = {name: (first / name).stat().st_mtime_ns for name in CHECKPOINT_FILES}

    def fail(*args, **kwargs):
        raise AssertionError("ensure_default_model must not rebuild an existing model")

    monkeypatch.setattr(dm, "make_model", fail)
    assert ensure_default_model() == first, "a second call should return the same directory"
    assert {name: (first / name).stat().st_mtime_ns for name in CHECKPOINT_FILES} == mtimes, (
        "a second call should leave the files untouched"
    )
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name], (
        "no temporary build directories should be left behind"
    )


def test_ensure_default_model_keeps_the_winner_when_it_loses_a_race(
    fresh_tandem_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = default_model_dir()
    real_make_model = dm.make_model

    def make_model_while_another_process_finishes_first(out_dir, **kwargs):
        out = real_make_model(out_dir, **kwargs)
        # The other process publishes its build while ours is still running.
        winner = real_make_model(target.parent / "winner", **kwargs)
        (winner / "WINNER").write_text("other process")
        os.rename(winner, target)
        return out

    monkeypatch.setattr(dm, "make_model", make_model_while_another_process_finishes_first)
    assert ensure_default_model() == target, "the loser should still return the model directory"
    assert (target / "WINNER").is_file(), "the build that landed first should be kept, not replaced"
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name], (
        "the losing build should be discarded"
    )


def test_ensure_default_model_cleans_up_after_a_failed_build(
    fresh_tandem_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(out_dir, **kwargs):
        (Path(out_dir) / "partial").write_text("half written")
        raise OSError("disk full")

    monkeypatch.setattr(dm, "make_model", broken)
    with pytest.raises(OSError, match="disk full"):
        ensure_default_model()
    assert not default_model_dir().exists(), "a failed build should not publish a model directory"
    assert list(default_model_dir().parent.iterdir()) == [], (
        "a failed build should remove its temp dir"
    )


def test_ensure_default_model_refuses_to_replace_an_unrelated_directory(
    fresh_tandem_home: Path,
) -> None:
    target = default_model_dir()
    target.mkdir(parents=True)
    (target / "notes.txt").write_text("not a model")
    with pytest.raises(RuntimeError, match="not a complete model directory"):
        ensure_default_model()
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name], (
        "the temporary build should be removed when it cannot be installed"
    )
    assert (target / "notes.txt").read_text() == "not a model", (
        "the existing directory should be left alone"
    )
