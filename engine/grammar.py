"""Structured-output specs as xgrammar grammars, and their validation.

Compiling a grammar against a vocabulary is the engine's part
(``engine.structured_output``); this module only parses specs, without a tokenizer.
xgrammar imports torch, so it is imported inside the functions that need it: the
router imports this module for ``precheck`` and the wording of errors, and runs
``problem`` in a helper process (``router.grammar_check``).

- ``precheck``: the pure part (a JSON schema is JSON and an object); ValueError.
- ``problem``: why xgrammar cannot parse the spec, or None (cached by kind and spec).
- ``check``: both, as a ValueError that names the request field.
"""

from __future__ import annotations

import functools
import json
import re

from engine.optional import optional_import
from engine.sampling_params import StructuredOutput

# The request field each kind comes from, for error messages.
FIELDS = {
    "json": "response_format.json_schema.schema",
    "json_object": "response_format",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
}
WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object format",
    "regex": "regular expression",
    "choice": "list of choices",
    "grammar": "EBNF grammar",
}
_ANY_OBJECT = '{"type": "object"}'
MAX_CACHED_GRAMMARS = 256
# xgrammar 0.2.8 writes a string with minLength/maxLength as characters of this class,
# which lets control characters (a raw tab) through, which JSON forbids in strings;
# its unbounded strings exclude them. The grammar's text is patched and parsed again.
_LENIENT_CHARS = r'[^\"\\\r\n]'
_JSON_CHARS = r'[^\0-\x1f\"\\]'
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[12:00:00] /project/cpp/x.cc:83: "


def _ebnf_literal(text: str) -> str:
    # JSON string escapes (\", \\, \n, \uXXXX) are the ones xgrammar's EBNF reads.
    return json.dumps(text, ensure_ascii=False)


def xgrammar_package():
    """The ``xgrammar`` package; an ImportError that names it where it is not installed."""
    return optional_import("xgrammar", "structured output (JSON schema, regex, grammar)")


def parse_grammar(so: StructuredOutput):
    """The constraint as an ``xgrammar.Grammar``; raises on a spec that does not parse.

    JSON is compact (no whitespace between tokens): small models otherwise tend to fill
    their token budget with blanks, and the JSON means the same.
    """
    xgr = xgrammar_package()
    if so.kind == "json":
        grammar = xgr.Grammar.from_json_schema(so.spec, any_whitespace=False)
        text = str(grammar)
        if _LENIENT_CHARS in text:
            grammar = xgr.Grammar.from_ebnf(text.replace(_LENIENT_CHARS, _JSON_CHARS))
        return grammar
    if so.kind == "json_object":
        return xgr.Grammar.from_json_schema(_ANY_OBJECT, any_whitespace=False)
    if so.kind == "regex":
        return xgr.Grammar.from_regex(so.spec)
    if so.kind == "choice":
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_literal(c) for c in json.loads(so.spec)))
    return xgr.Grammar.from_ebnf(so.spec)


def precheck(so: StructuredOutput, field: str | None = None) -> None:
    """The checks that need no grammar engine; ValueError naming ``field``."""
    field = field or FIELDS[so.kind]
    if so.kind == "json":
        try:
            schema = json.loads(so.spec)
        except ValueError as e:
            raise ValueError(f"{field} is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"{field} must be a JSON object, got {type(schema).__name__}")


@functools.lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def problem(kind: str, spec: str) -> str | None:
    """Why xgrammar cannot parse the spec (its parser's first line), or None."""
    try:
        parse_grammar(StructuredOutput(kind, spec))
    except Exception as e:  # xgrammar raises RuntimeError / ValueError with the parser's words
        text = str(e).strip()
        return _LOG_PREFIX.sub("", text.splitlines()[0]) if text else type(e).__name__
    return None


def message(so: StructuredOutput, field: str | None, why: str) -> str:
    return f"{field or FIELDS[so.kind]} is not a valid {WHAT[so.kind]}: {why}"


def check(so: StructuredOutput, field: str | None = None) -> None:
    """ValueError naming the request field (``field``, or the kind's usual one) when the
    constraint's spec does not parse."""
    precheck(so, field)
    why = problem(so.kind, so.spec)
    if why is not None:
        raise ValueError(message(so, field, why))
