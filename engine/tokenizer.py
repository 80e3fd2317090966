"""Text <-> token id conversion for the engine.

This module owns everything the engine needs to know about tokenization:

* :class:`Tokenizer` -- a thin wrapper over the Rust ``tokenizers`` library that
  loads a Hugging Face style model directory (``tokenizer.json`` plus the
  optional ``tokenizer_config.json``, ``generation_config.json`` and
  ``config.json``) or a GGUF file's tokenizer metadata, and renders chat templates with a sandboxed Jinja
  environment configured the way ``transformers`` configures it. Its ``encode``
  lets go of the GIL while it works, and ``max_chars_per_token`` bounds how much
  text one token stands for (the router refuses a text far over the context with it).
* :class:`IncrementalDetokenizer` (``engine.detokenizer``, importable from here too) --
  turns a growing stream of generated token ids into text deltas suitable for
  streaming, handling multi-byte characters that are split across tokens and stop
  strings that span token boundaries; it decodes through a :class:`Tokenizer`.

``transformers`` is deliberately not imported here: it is slow to import and
heavy at runtime, and everything the engine needs is available from
``tokenizers`` and ``jinja2`` directly.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import datetime
from fractions import Fraction
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from engine.detokenizer import IncrementalDetokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]

def _token_content(value: Any) -> str | None:
    """Return the text of a special token as stored in tokenizer_config.json.

    HF writes special tokens either as plain strings or as serialized
    ``AddedToken`` dicts (``{"content": "</s>", ...}``).
    """
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    """Normalise an ``eos_token_id``-style field (int, list or null) to a tuple."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object from ``path``, or ``{}`` if the file does not exist."""
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _raise_exception(message: str) -> None:
    # Chat templates call this to reject malformed conversations.
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's builtin ``tojson`` HTML-escapes its output, which corrupts
    # prompts; templates written for HF expect plain json.dumps.
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_jinja_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """Build the Jinja environment used for chat templates.

    Mirrors ``transformers``' settings (trim_blocks, lstrip_blocks,
    loopcontrols and the same helpers) so that templates published for HF
    models render identically here.
    """
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# -- how many characters one token can stand for -----------------------------------

# The most code points NFC or NFKC composes into one (U+1F82, an alpha with three marks,
# decomposes into four): the most a Unicode normalizer divides a text's length by.
_MAX_COMPOSED = 4
# Pre-tokenizers that split text and drop none of it (Split and Punctuation unless their
# behavior is "Removed"); Whitespace, WhitespaceSplit and BERT's drop the whitespace.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"})


def _parts(section: dict | None, key: str) -> list[dict]:
    """A tokenizer.json normalizer or pre-tokenizer as the list of its steps."""
    if section is None:
        return []
    return [p for part in section[key] for p in _parts(part, key)] if section["type"] == "Sequence" else [section]


def _shrink(normalizer: dict | None) -> Fraction | None:
    """The most ``normalizer`` divides a text's length by; None for one that can drop any
    amount of it (Strip, StripAccents, a regex Replace, BERT's, SentencePiece's Precompiled)."""
    factor = Fraction(1)
    for step in _parts(normalizer, "normalizers"):
        kind, pattern = step["type"], step.get("pattern") or {}
        if kind in ("NFC", "NFKC"):
            factor *= _MAX_COMPOSED
        elif kind == "Replace" and pattern.get("String") and step["content"]:
            factor *= max(Fraction(1), Fraction(len(pattern["String"]), len(step["content"])))
        elif kind not in ("NFD", "NFKD", "Lowercase", "Prepend"):  # those give a character or more for each
            return None
    return factor


def _model_keeps_text(model: dict, byte_level: bool) -> bool:
    """Whether a BPE model gives every character a token of its own or a share of one: a
    byte-level vocabulary has all 256 bytes, byte fallback all 256 ``<0x..>`` tokens, or an
    unknown character gets an unknown token each. Other models, and BPE without these,
    drop or merge unknown text (WordPiece makes a whole word one [UNK])."""
    if model["type"] != "BPE":
        return False
    vocab = model["vocab"]
    if byte_level and all(c in vocab for c in tokenizers.pre_tokenizers.ByteLevel.alphabet()):
        return True
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return True
    return model.get("unk_token") is not None and not model.get("fuse_unk")


def _max_chars_per_token(spec: dict) -> int | None:
    """``Tokenizer.max_chars_per_token`` of the tokenizer ``spec`` (its tokenizer.json)."""
    shrink = _shrink(spec.get("normalizer"))
    pre = _parts(spec.get("pre_tokenizer"), "pretokenizers")
    added = spec.get("added_tokens") or []
    if (shrink is None or spec.get("truncation") is not None
            or any(p["type"] not in _KEEPING_PRE_TOKENIZERS or p.get("behavior") == "Removed" for p in pre)
            or not _model_keeps_text(spec["model"], any(p["type"] == "ByteLevel" for p in pre))
            or any(t["lstrip"] or t["rstrip"] for t in added)):  # such a token swallows whitespace
        return None
    longest = max([len(t) for t in spec["model"]["vocab"]] + [len(t["content"]) for t in added])
    return math.ceil(longest * shrink)


class Tokenizer:
    """A model's tokenizer: encoding, decoding, special tokens and chat template.

    Construct it with :meth:`from_pretrained`. Attributes:

    * ``eos_token_ids`` -- every id that ends generation, in priority order
      (``generation_config.json``, then ``config.json``, then the tokenizer's
      ``eos_token``); ``eos_token_id`` is the first of them.
    * ``bos_token_id`` -- id of the beginning-of-sequence token, if any.
    * ``vocab_size`` -- number of ids, including added tokens.
    * ``all_special_ids`` -- ids of all special tokens (skipped on decode).
    * ``chat_template`` -- the Jinja chat template source, or ``None``.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool | None = None,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self._template_cache: tuple[str, jinja2.Template] | None = None
        self.bos_token = bos_token
        self.eos_token = eos_token
        # None means "whatever the tokenizer.json post-processor does".
        self.add_bos_token = add_bos_token

        if bos_token is not None and tokenizer.token_to_id(bos_token) is not None:
            bos_token_id = tokenizer.token_to_id(bos_token)
        self.bos_token_id: int | None = bos_token_id

        eos_ids = list(eos_token_ids)
        if eos_token is not None:
            tok_eos = tokenizer.token_to_id(eos_token)
            if tok_eos is not None:
                eos_ids.append(tok_eos)
        # Deduplicate while keeping the priority order.
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None

        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        special = {
            token_id
            for token_id, added in tokenizer.get_added_tokens_decoder().items()
            if added.special
        }
        special.update(self.eos_token_ids)
        if self.bos_token_id is not None:
            special.add(self.bos_token_id)
        self.all_special_ids: frozenset[int] = frozenset(special)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Load the tokenizer of the Hugging Face style model in ``model_dir``, or the
        one a ``.gguf`` file describes in its metadata.

        Raises FileNotFoundError if ``model_dir/tokenizer.json`` is missing.
        """
        from engine.model.gguf_checkpoint import is_gguf, open_gguf

        if is_gguf(model_dir):
            return cls(**open_gguf(model_dir).tokenizer_parts())
        model_dir = Path(model_dir)
        tokenizer_path = model_dir / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {tokenizer_path}")
        tok = tokenizers.Tokenizer.from_file(str(tokenizer_path))

        tok_config = _read_json(model_dir / "tokenizer_config.json")
        gen_config = _read_json(model_dir / "generation_config.json")
        model_config = _read_json(model_dir / "config.json")

        chat_template = tok_config.get("chat_template")
        if isinstance(chat_template, list):
            # HF allows several named templates; "default" is the chat one.
            named = {t.get("name"): t.get("template") for t in chat_template}
            chat_template = named.get("default")
        if chat_template is None and (model_dir / "chat_template.jinja").is_file():
            # Newer transformers versions save the template as its own file.
            chat_template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")

        # generation_config.json is what HF's generate() uses to stop, and
        # often lists more ids (e.g. end-of-turn) than config.json does.
        eos_ids = _as_id_tuple(gen_config.get("eos_token_id")) + _as_id_tuple(
            model_config.get("eos_token_id")
        )
        bos_id = gen_config.get("bos_token_id", model_config.get("bos_token_id"))

        add_bos = tok_config.get("add_bos_token")
        return cls(
            tok,
            chat_template=chat_template,
            bos_token=_token_content(tok_config.get("bos_token")),
            eos_token=_token_content(tok_config.get("eos_token")),
            add_bos_token=None if add_bos is None else bool(add_bos),
            eos_token_ids=eos_ids,
            bos_token_id=None if bos_id is None else int(bos_id),
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Encode ``text`` to token ids.

        With ``add_special_tokens`` the tokenizer's post-processor runs (e.g.
        prepending BOS). Special-token text inside ``text`` (such as
        ``<|user|>``) is always encoded as the special token.
        """
        # encode_batch lets go of the GIL while it works (encode holds it): a prompt
        # tokenized on another thread (the router's) leaves the event loop running.
        encoding = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        ids = encoding.ids
        if not add_special_tokens or self.add_bos_token is None or self.bos_token_id is None:
            return ids
        bos = self.bos_token_id
        if self.add_bos_token:
            if not ids or ids[0] != bos:
                ids = [bos, *ids]
        elif ids and ids[0] == bos and encoding.special_tokens_mask[0]:
            # The post-processor added a BOS the config says not to add; a
            # BOS the text spelled out itself has mask 0 and is kept.
            ids = ids[1:]
        return ids

    def max_chars_per_token(self) -> int | None:
        """The most characters of text one token can stand for: a text of ``c`` characters
        encodes to at least ``c / max_chars_per_token()`` tokens, so one far over a context
        can be refused without encoding it. None where the tokenizer can drop text (see
        ``_max_chars_per_token``'s helpers): then no text is too long to fit.

        Why it holds: a token stands for at most as many characters as its vocabulary
        entry has (a byte-level entry has a character per byte, and a character is a byte
        or more; a ``<0x..>`` or unknown token stands for one), an added token for its
        content; the normalizer divides the text's length by at most ``_shrink``.
        """
        return _max_chars_per_token(json.loads(self._tok.to_str()))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decode token ids to text, optionally dropping special tokens."""
        # int() accepts numpy / torch scalars, which the Rust binding rejects.
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def backend(self) -> tokenizers.Tokenizer:
        """The ``tokenizers`` object itself (grammar engines read its vocabulary)."""
        return self._tok

    def id_to_token(self, token_id: int) -> str | None:
        """Return the vocabulary string of ``token_id`` (None if out of range)."""
        return self._tok.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        """Return the id of vocabulary string ``token`` (None if unknown)."""
        return self._tok.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """Map each id to its vocabulary string."""
        return [self.id_to_token(i) for i in ids]

    def _compiled_chat_template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template (tokenizer_config.json has no "
                "'chat_template' and there is no chat_template.jinja)"
            )
        # Compiling costs far more than rendering; keyed on the source so that
        # assigning a different chat_template takes effect.
        cached = self._template_cache
        if cached is None or cached[0] != self.chat_template:
            cached = (self.chat_template, _make_jinja_env().from_string(self.chat_template))
            self._template_cache = cached
        return cached[1]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template_vars: Any,
    ) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) to a prompt.

        With ``add_generation_prompt`` the text that opens an assistant turn is
        appended. Extra keyword arguments are passed to the template (e.g.
        ``tools``). Raises ValueError if the tokenizer has no chat template,
        and jinja2.TemplateError if the template rejects the conversation.
        The result is text; encode it with ``encode``.
        """
        return self._compiled_chat_template().render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **template_vars,
        )
