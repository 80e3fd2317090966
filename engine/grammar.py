"""Structured-output specs as xgrammar grammars, their bounds, and their validation.

Compiling a grammar against a vocabulary is the engine's part
(``engine.structured_output``); this module only parses specs, without a tokenizer.
xgrammar imports torch, so it is imported inside the functions that need it: the
router imports this module for ``precheck`` and the wording of errors, and runs
``problem`` in a helper process (``router.grammar_check``).

- ``precheck``: the pure part, in milliseconds: a JSON schema is JSON (however deeply
  nested the text: a ValueError, never a RecursionError) and an object; given
  ``GrammarLimits``, the spec is inside their bounds too (below).
- ``problem``: why xgrammar cannot parse the spec, or None (cached by kind and spec).
- ``check``: both, as a ValueError that names the request field.

Bounds (``GrammarLimits``), checked by walking the spec before anything parses it: some
specs of a few bytes cost xgrammar minutes, and neither its parse nor its compile can
be stopped once begun. Measured with xgrammar 0.2.9 on a 2-core machine:

- A regular expression in a JSON schema (``pattern``, ``propertyNames``' too, a
  ``patternProperties`` key) is built into an automaton whose cost grows with about the
  cube of the regex written out: ``{"type": "string", "pattern": "[a-z]{1,20000}"}`` took
  36 s to parse, 4000 repeats 0.7 s, 2000 0.17 s, 1000 0.05 s. ``regex_size`` counts a
  regex's characters and classes with each repetition written out (nested ones
  multiply); one regex may hold ``max_regex_size`` (1000), all those of a schema
  ``max_total_regex_size`` (10000: ten regexes at the bound parse in about 0.5 s).
  ``guided_regex`` is held to ``max_regex_size`` too (xgrammar 0.2.9 keeps its
  repetitions as repetitions, but the same measure bounds what any version unrolls).
- Nesting: a schema 500 levels deep (12 KB) took 14 to 25 s; ``max_schema_depth`` (64 JSON
  levels, an object or an array each) takes milliseconds.
- ``minLength``, ``maxLength``, ``minItems``, ``maxItems``, ``minProperties``,
  ``maxProperties``, ``minContains`` and ``maxContains`` cost nothing in xgrammar 0.2.9
  (a repetition it does not unroll, even at a million), but cost time in grammar engines
  that unroll them: each is at most ``max_schema_bound`` (100000).
- Values under ``enum``, ``const``, ``default`` and ``examples`` are data: only their depth
  counts. An EBNF grammar is not walked: its repetitions cost xgrammar 0.2.9 seconds at
  most (a wide class repeated, against a large vocabulary), which the time limit covers.

``compile_timeout_s`` (10 s; a legitimate schema of 50 properties compiles in 20 ms) is the
wall-clock limit on one spec's parse in the router's helper process (killed past it: a
400, ``router.grammar_check``) and on its parse and compile in an engine (the request ends
with an error naming the limit, ``engine.structured_output``); ``too_slow`` words it.
xgrammar has no time limit of its own (its ``max_recursion_depth`` bounds the matcher's
stack, not a compile).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, fields

from engine.core.optional import optional_import
from engine.wire.sampling_params import StructuredOutput

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
# JSON schema keywords that bound a count of characters, items or properties.
_SIZE_KEYWORDS = frozenset({
    "minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains", "maxContains",
})
# Keywords whose values are data, not schemas: their keys are not keywords (nested too).
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
_CHECKED_KEYWORDS = _SIZE_KEYWORDS | {"pattern", "patternProperties"}
_QUANTIFIER = re.compile(r"\{(\d+)(,(\d*))?\}")
_SPECIAL = frozenset("\\[](){}|*+?")
_OPERATORS = re.compile(r"[|*+?]+")
_PLAIN = re.compile(r"[^\\\[\](){}|*+?]+")  # literal characters, up to the next special one
# A character class, as xgrammar reads one ("[]" is empty, "[^]" any character); unrolled,
# so a class never closed costs linear time.
_CLASS = re.compile(r"\[\^?[^\]\\]*(?:\\.[^\]\\]*)*\]", re.DOTALL)
_HUGE = 1 << 62  # counts above this are all "too many": no arithmetic on numbers of 4000 digits


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on a structured-output spec, checked before it is parsed (``precheck``), and
    the wall-clock limit on its parse and compile; why each, in the module docstring.
    ``RouterConfig.grammar`` and ``EngineConfig.grammar`` each hold one."""

    max_regex_size: int = 1000  # one regex's characters and classes with its repetitions written out
    max_total_regex_size: int = 10_000  # all the regexes of one JSON schema together
    max_schema_bound: int = 100_000  # minLength, maxLength, minItems, maxItems, ...
    max_schema_depth: int = 64  # JSON levels (an object or an array each) of a schema
    compile_timeout_s: float = 10.0  # one spec's parse (router) or parse and compile (engine)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"grammar.{f.name} must be a number > 0, got {value!r}")


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


# -- bounds, before any parse ----------------------------------------------------------


def _count(match: re.Match) -> int:
    """How many copies of its part a quantifier writes out: n of {m,n}, m of {m} and {m,}."""
    digits = match[3] if match[3] else match[1]
    return _HUGE if len(digits) > 18 else max(int(digits), 1)


def _atom_end(regex: str, i: int) -> int:
    """The index after the atom at ``regex[i]``: an escape, a class, or one character."""
    if regex[i] == "\\":
        return i + 2
    if regex[i] == "[":
        m = _CLASS.match(regex, i)
        return m.end() if m else len(regex)
    return i + 1


def regex_size(regex: str, stop_above: int = _HUGE) -> int:
    """The characters and classes of ``regex`` with each ``{m,n}`` repetition written out
    (n copies; m for ``{m}`` and ``{m,}``), nested ones multiplied: ``a{3}`` is 3,
    ``(ab){1,5}`` 10, ``(a{1,10}){1,10}`` 100; ``*``, ``+`` and ``?`` keep their part once.
    A class or an escape counts one. The count only grows as the regex is read, so it stops
    once past ``stop_above`` (a long regex costs only as much as its bound). Malformed
    regexes get a size too (xgrammar refuses them later)."""
    groups = [0]  # the size so far of each group still open, the whole regex first
    total = 0  # the sum of ``groups``
    last = 0  # the size of the atom or group just read: what a quantifier repeats
    i = 0
    while i < len(regex) and total <= stop_above:
        c = regex[i]
        if c == "{" and (m := _QUANTIFIER.match(regex, i)):
            more = min(last * _count(m), _HUGE) - last
            groups[-1] += more
            total, last, i = min(total + more, _HUGE), last + more, m.end()
        elif c == "(":
            groups.append(0)
            last, i = 0, i + 1
        elif c in "|*+?":  # a run of them at once: they add nothing, and "|" starts afresh
            end = _OPERATORS.match(regex, i).end()
            last, i = (0 if "|" in regex[i:end] else last), end
        elif c == ")" and len(groups) > 1:  # the group's size moves to its parent: the total stays
            last = groups.pop()
            groups[-1] += last
            i += 1
        elif c in _SPECIAL:  # an escape, a class, or a special character standing for itself
            groups[-1] += 1
            total, last, i = total + 1, 1, _atom_end(regex, i)
        else:  # a run of literal characters, one atom each
            end = _PLAIN.match(regex, i).end()
            groups[-1] += end - i
            total, last, i = total + end - i, 1, end
    return min(total, _HUGE)


def _regex_problem(regex: str, path: str, limits: GrammarLimits) -> tuple[str | None, int]:
    """(why ``regex`` at ``path`` is over ``max_regex_size`` or None, its size)."""
    size = regex_size(regex, stop_above=limits.max_regex_size)
    if size <= limits.max_regex_size:
        return None, size
    shown = regex if len(regex) <= 60 else regex[:57] + "..."
    return (f"{path} ({shown!r}) is at least {size} characters and classes long with its repetitions "
            f"written out, over the limit of {limits.max_regex_size} (max_regex_size)"), size


def _keyword_problem(key: str, value, path: str, limits: GrammarLimits) -> tuple[str | None, int]:
    """(why the schema keyword ``key`` = ``value`` is out of bounds or None, the regex size it adds)."""
    if key in _SIZE_KEYWORDS and isinstance(value, (int, float)) and not isinstance(value, bool):
        if value > limits.max_schema_bound:
            return f"{path} is {value}, over the limit of {limits.max_schema_bound} (max_schema_bound)", 0
    elif key == "pattern" and isinstance(value, str):
        return _regex_problem(value, path, limits)
    elif key == "patternProperties" and isinstance(value, dict):
        total = 0
        for regex in value:
            why, size = _regex_problem(regex, f"{path}.{regex}", limits)
            if why is not None:
                return why, size
            total += size
        return None, total
    return None, 0


def schema_problem(schema: object, field: str, limits: GrammarLimits) -> str | None:
    """Why a parsed JSON schema is out of ``limits``' bounds (naming its path from ``field``
    and the limit), or None. Iterative: a schema of any depth costs no Python stack."""
    todo: list[tuple[object, str, int, bool]] = [(schema, field, 1, False)]  # (node, path, depth, is data)
    total = 0
    while todo:
        node, path, depth, data = todo.pop()
        if depth > limits.max_schema_depth:
            limit = limits.max_schema_depth
            return f"{path} is nested {depth} levels deep, over the limit of {limit} (max_schema_depth)"
        keywords = isinstance(node, dict) and not data
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            if keywords and key in _CHECKED_KEYWORDS:
                why, size = _keyword_problem(key, value, f"{path}.{key}", limits)
                total += size
                if why is not None:
                    return why
            if isinstance(value, (dict, list)):
                todo.append((value, f"{path}.{key}", depth + 1, data or (keywords and key in _DATA_KEYWORDS)))
    if total > limits.max_total_regex_size:
        return (f"{field}'s regular expressions are {total} characters and classes long together with their "
                f"repetitions written out, over the limit of {limits.max_total_regex_size} (max_total_regex_size)")
    return None


def precheck(so: StructuredOutput, field: str | None = None, limits: GrammarLimits | None = None) -> None:
    """The checks that need no grammar engine (milliseconds); ValueError naming ``field``.
    With ``limits``, the spec must be inside their bounds too (see the module docstring)."""
    field = field or FIELDS[so.kind]
    if so.kind == "json":
        try:
            schema = json.loads(so.spec)
        except ValueError as e:
            raise ValueError(f"{field} is not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError(f"{field} is not valid JSON: nested too deeply") from None
        if not isinstance(schema, dict):
            raise ValueError(f"{field} must be a JSON object, got {type(schema).__name__}")
        why = None if limits is None else schema_problem(schema, field, limits)
    elif so.kind == "regex" and limits is not None:
        why = _regex_problem(so.spec, field, limits)[0]
    else:
        why = None
    if why is not None:
        raise ValueError(why)


def reason(error: Exception) -> str:
    """xgrammar's error as a ``why``: its first line, without the log prefix."""
    text = str(error).strip()
    return _LOG_PREFIX.sub("", text.splitlines()[0]) if text else type(error).__name__


@functools.lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def problem(kind: str, spec: str) -> str | None:
    """Why xgrammar cannot parse the spec (its parser's first line), or None."""
    try:
        parse_grammar(StructuredOutput(kind, spec))
    except Exception as e:  # xgrammar raises RuntimeError / ValueError with the parser's words
        return reason(e)
    return None


def message(so: StructuredOutput, field: str | None, why: str) -> str:
    return f"{field or FIELDS[so.kind]} is not a valid {WHAT[so.kind]}: {why}"


def too_slow(work: str, limits: GrammarLimits) -> str:
    """The ``why`` of a spec whose ``work`` ("parsing", "compiling") ran past the limit."""
    return f"{work} it took longer than {limits.compile_timeout_s:g} s, the limit (compile_timeout_s)"


def check(so: StructuredOutput, field: str | None = None, limits: GrammarLimits | None = None) -> None:
    """ValueError naming the request field (``field``, or the kind's usual one) when the
    constraint's spec is out of ``limits``' bounds or does not parse. Synchronous, in
    this thread, with no time limit: for tools and tests, not for a serving path."""
    precheck(so, field, limits)
    why = problem(so.kind, so.spec)
    if why is not None:
        raise ValueError(message(so, field, why))
