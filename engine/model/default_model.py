"""The project's built-in default model, ``tandem-tiny-llama``.

This module owns the recipe for the default model and its on-disk cache:

* :func:`make_model` writes a complete Hugging Face format Llama checkpoint
  (config, generation config, safetensors weights, tokenizer and chat
  template) into a directory. The weights are random but deterministic, so the
  model produces gibberish but is the same for everyone, which is what tests,
  demos and benchmarks of the serving machinery need. Nothing is downloaded.
* :func:`default_model_dir` / :func:`ensure_default_model` locate the model
  under ``$TANDEM_HOME/models`` and build it there on first use.

The tokenizer is a genuine byte-level BPE trained on ``engine/model/data/corpus.txt``
(shipped as package data), so tokenization behaves like a real model's:
multi-byte characters split across tokens, leading-space tokens, and special
tokens for the chat format.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import tokenizers
import torch
from safetensors.torch import save_file
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

__all__ = [
    "DEFAULT_MODEL_NAME",
    "default_model_dir",
    "ensure_default_model",
    "make_model",
    "train_tokenizer",
]

DEFAULT_MODEL_NAME = "tandem-tiny-llama"  # engine.model.model_registry spells it too

# Bump whenever make_model's output changes, so an old cached build under
# $TANDEM_HOME is never mistaken for the current one.
_RECIPE_VERSION = 1

_CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
END_OF_TURN_TOKEN = "<|end|>"
# Order fixes the ids: <s>=0, </s>=1, <|system|>=2, <|user|>=3,
# <|assistant|>=4, <|end|>=5.
SPECIAL_TOKENS = (
    BOS_TOKEN,
    EOS_TOKEN,
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    END_OF_TURN_TOKEN,
)

_TARGET_VOCAB_SIZE = 4096

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ('system', 'user', 'assistant') %}"
    "{{ raise_exception('unsupported chat role: ' ~ message['role']) }}"
    "{% endif %}"
    "{{ '<|' ~ message['role'] ~ '|>\\n' ~ message['content'] ~ '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Architecture of the default model (about 12.6M parameters with the 4096
# token vocabulary): small enough to run on a CPU in tests, but with grouped
# query attention (6 query heads sharing 2 KV heads) so the serving code's
# GQA paths are exercised.
_ARCH: dict[str, Any] = {
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
}

_INIT_STD = 0.02


def default_model_dir() -> Path:
    """Where the default model lives: ``$TANDEM_HOME/models/tandem-tiny-llama-v1``.

    ``TANDEM_HOME`` defaults to ``~/.cache/tandem``.
    """
    from engine.model.model_registry import tandem_home

    return tandem_home() / "models" / f"{DEFAULT_MODEL_NAME}-v{_RECIPE_VERSION}"


def _is_complete(model_dir: Path) -> bool:
    # Builds are published with an atomic rename, so a directory holding the
    # weights is a finished build, not one still being written.
    return (model_dir / "model.safetensors").is_file() and (model_dir / "config.json").is_file()


def ensure_default_model() -> Path:
    """Return the default model's directory, building it first if it is missing.

    Safe if several processes race: each builds into its own temporary
    directory next to the target and renames it into place; a process whose
    rename loses because another build landed first discards its copy.
    """
    target = default_model_dir()
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Same parent directory so the rename stays on one filesystem (atomic).
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        make_model(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # POSIX refuses to rename over a non-empty directory (Windows over
            # any existing one), which is how a lost race shows up.
            if not _is_complete(target):
                raise RuntimeError(
                    f"cannot install the default model: {target} exists but is not a "
                    "complete model directory; remove it and try again"
                ) from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def train_tokenizer() -> tokenizers.Tokenizer:
    """Train the default model's byte-level BPE tokenizer on the bundled corpus.

    Deterministic: the same corpus always yields the same tokenizer.json bytes
    (BPE merges are picked by count with a fixed tie-break, independent of
    thread count).
    """
    tok = tokenizers.Tokenizer(models.BPE())
    # GPT-2 style: no prefix space, so "Hello" at the start of a prompt and
    # " Hello" mid-sentence are different tokens, as in most byte-level models.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TARGET_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so any string (including bytes never seen in
        # the corpus) can be encoded without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = _CORPUS_PATH.read_text(encoding="utf-8")
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)

    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _weight_shapes(vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """HF Llama tensor names and shapes, in the fixed order weights are drawn."""
    h = _ARCH["hidden_size"]
    ffn = _ARCH["intermediate_size"]
    q_dim = _ARCH["num_attention_heads"] * _ARCH["head_dim"]
    kv_dim = _ARCH["num_key_value_heads"] * _ARCH["head_dim"]
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab_size, h))]
    for i in range(_ARCH["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (q_dim, h)),
            (f"{p}.self_attn.k_proj.weight", (kv_dim, h)),
            (f"{p}.self_attn.v_proj.weight", (kv_dim, h)),
            (f"{p}.self_attn.o_proj.weight", (h, q_dim)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.gate_proj.weight", (ffn, h)),
            (f"{p}.mlp.up_proj.weight", (ffn, h)),
            (f"{p}.mlp.down_proj.weight", (h, ffn)),
        ]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab_size, h))]
    return shapes


def _write_weights(path: Path, vocab_size: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in _weight_shapes(vocab_size):
        if len(shape) == 1:
            # RMSNorm scales start at one, as in a freshly initialised model.
            tensors[name] = torch.ones(shape, dtype=torch.float32)
        else:
            t = torch.empty(shape, dtype=torch.float32)
            tensors[name] = t.normal_(0.0, _INIT_STD, generator=gen).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def make_model(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write the default model's Hugging Face checkpoint into ``out_dir``.

    Produces config.json, generation_config.json, model.safetensors,
    tokenizer.json and tokenizer_config.json. The output depends only on
    ``seed`` (and the recipe), byte for byte. Returns ``out_dir``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = train_tokenizer()
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    bos_id = tok.token_to_id(BOS_TOKEN)
    eos_id = tok.token_to_id(EOS_TOKEN)
    end_id = tok.token_to_id(END_OF_TURN_TOKEN)

    tok.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json",
        {
            # Load tokenizer.json as is; the "llama" model type would otherwise
            # make AutoTokenizer pick a SentencePiece-style Llama tokenizer.
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "model_max_length": _ARCH["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        out / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **_ARCH,
            "vocab_size": vocab_size,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "initializer_range": _INIT_STD,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "use_cache": True,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
        },
    )
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": bos_id,
            # A chat reply ends with <|end|>, plain text with </s>.
            "eos_token_id": [eos_id, end_id],
        },
    )
    _write_weights(out / "model.safetensors", vocab_size, seed)
    return out
