"""A GGUF file's tokenizer rebuilt as a ``tokenizers.Tokenizer`` from its metadata.

``engine/model/gguf_checkpoint.py`` opens the file and calls ``build_tokenizer`` from
``GGUFFile.tokenizer_parts`` with its metadata reader; this module holds what that takes:
llama.cpp's pre-tokenizer table (``PRE_TOKENIZERS``, by ``tokenizer.ggml.pre``), its token
types, byte-level BPE (``gpt2``) and SentencePiece BPE (``llama``), whose merges are
recovered from the vocabulary's scores. It loads neither torch nor gguf.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

# A GGUF file's metadata by key, with a default for a key it lacks (``GGUFFile._get``).
Metadata = Callable[..., Any]

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


def build_tokenizer(get: Metadata, file_name: str, tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    """The ``tokenizers.Tokenizer`` of a GGUF file's vocabulary (``tokens``, their llama.cpp
    ``types``), as its ``tokenizer.ggml.model`` says: byte-level or SentencePiece BPE."""
    kind = get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok = _byte_level_bpe(get, file_name, tokens)
    elif kind == "llama":
        tok = _sentencepiece_bpe(get, file_name, tokens)
    else:
        raise ValueError(
            f"GGUF file {file_name}: unsupported tokenizer model {kind!r}; "
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


def _byte_level_bpe(get: Metadata, file_name: str, tokens: list[str]) -> tokenizers.Tokenizer:
    pre = get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF file {file_name}: unsupported pre-tokenizer {pre!r}; "
            f"supported: {sorted(PRE_TOKENIZERS)}"
        )
    merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(PRE_TOKENIZERS[pre])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(get: Metadata, file_name: str, tokens: list[str]) -> tokenizers.Tokenizer:
    """SentencePiece's BPE as a ``tokenizers`` BPE with byte fallback (``<0x..>``
    tokens), as transformers' GGUF loader builds it: merges recovered from the
    vocabulary's scores, spaces spelled ``▁``.

    The text gets a leading ``▁`` where llama.cpp gives it one (``add_space_prefix``):
    at the start and after every added token. A normalizer does that, as in
    transformers' GGUF Phi-3 tokenizer and the tokenizer.json of Llama 2 and Mistral
    (transformers' other GGUF SentencePiece tokenizers prefix the start only)."""
    scores = get("tokenizer.ggml.scores")
    if scores is None:
        raise ValueError(f"GGUF file {file_name}: a SentencePiece vocabulary without scores")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = _merges_by_score(tokens, scores)
    unk = get("tokenizer.ggml.unknown_token_id")
    tok = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=merges, unk_token=None if unk is None else tokens[unk],
        fuse_unk=True, byte_fallback=True,
    ))  # fmt: skip
    prefix = bool(get("tokenizer.ggml.add_space_prefix", True))
    spaces = [normalizers.Replace(" ", _SPACE)]
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE)] * prefix + spaces)
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    tok.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return tok


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
