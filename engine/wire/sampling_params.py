"""Per-request sampling settings, validated once when a request is made.

Every out-of-range value raises ``ValueError`` naming the field and the limit, so the
router can turn it into a 400 without knowing the rules itself. The stop conditions'
limits (``check_stop_conditions``) the router also checks early, before tokenizing.

The token controls (vLLM's, applied by the sampler in this order, after the structured
output mask and before penalties): ``allowed_token_ids`` (only these may be drawn),
``bad_words_token_ids`` (token sequences that must never be completed: a word's last
token is banned while the output ends with the rest of it), and ``logit_bias`` (token
id -> a bias in [-100, 100] added to its logit). Whether the ids are inside the
vocabulary is ``check_vocab``'s to say: only the engine knows its size.

A structured-output constraint travels as ``StructuredOutput``: its kind and its spec as
text, so it pickles across processes and imports nothing. Whether the spec compiles is
checked by ``engine.grammar`` (the router does it before a request is queued).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
# Stop conditions. Each step of a request reads its new text once whatever its stop
# strings (``engine.stop_strings``), but their total length is paid once per request to
# build the automaton (and its memory kept): 16 x 128 characters, about 1 ms and 0.5 MB.
# vLLM allows 4 strings by default (VLLM_MAX_STOP_STRINGS; OpenAI documents 4), of any
# length; evaluation harnesses send more than 4. A stop string of n characters holds back
# the last n - 1 characters of a stream, so long ones are of little use anyway.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 128  # characters
MAX_STOP_TOKEN_IDS = 128  # vLLM's proposed VLLM_MAX_STOP_TOKEN_IDS; the scheduler scans them each token
# Words to ban (vLLM's cap): the router tokenizes each twice (bare and after a space), and
# the sampler checks every sequence against each step's tail.
MAX_BAD_WORDS = 128

# json: a JSON schema; json_object: any JSON object (spec unused); regex; choice: a JSON
# list of the allowed strings; grammar: EBNF (GBNF dialect, start symbol ``root``).
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """The output must match this: ``kind`` (one of ``STRUCTURED_KINDS``) and ``spec``."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured_output kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured_output spec must be a string, got {type(self.spec).__name__}")
        if self.kind == "choice":
            choices = json.loads(self.spec)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("guided_choice must be a non-empty list of non-empty strings")

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def json_schema(cls, schema: dict | str) -> StructuredOutput:
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy decoding. ``seed`` makes sampling reproducible and
    independent of the other requests in the batch. ``adapter``: the LoRA adapter (by the
    name it is served under) the request runs under, None for the base model: it travels
    with the request to every worker that computes it.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    # The prompt's logprobs (vLLM's): the model's own, with this many top tokens each.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    structured_output: StructuredOutput | None = None
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()  # kept as (id, bias) pairs
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    adapter: str | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Accept any iterable for the tuple fields (lists come in from JSON).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(_pair("logit_bias", p) for p in bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids))
        if self.adapter is not None and not (isinstance(self.adapter, str) and self.adapter):
            raise ValueError(f"adapter must be a non-empty name or None, got {self.adapter!r}")
        self._validate()
        self._validate_token_controls()

    def _validate(self) -> None:
        _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0)
        _check_int("top_k", self.top_k, lo=0)
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None:
            _check_int("seed", self.seed, lo=0)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, lo=0)
                if value > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be <= {MAX_LOGPROBS}, got {value}")
        check_stop_conditions(self.stop, self.stop_token_ids)
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, lo=0)

    def _validate_token_controls(self) -> None:
        for t, bias in self.logit_bias:
            _check_int("logit_bias", t, lo=0)
            _check_float("logit_bias", bias)
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                 f"got {bias} for token {t}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (leave it out to allow every token)")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t, lo=0)
        if len(self.bad_words_token_ids) > 2 * MAX_BAD_WORDS:  # a word as written and after a space
            raise ValueError(f"bad_words_token_ids has {len(self.bad_words_token_ids)} sequences, "
                             f"over the limit of {2 * MAX_BAD_WORDS}")
        for word in self.bad_words_token_ids:
            if not word:
                raise ValueError("bad_words_token_ids must hold non-empty token sequences")
            for t in word:
                _check_int("bad_words_token_ids", t, lo=0)

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError naming the field for a token control's id outside [0, vocab_size)."""
        for name, ids in (
            ("logit_bias", [t for t, _ in self.logit_bias]),
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("bad_words_token_ids", [t for word in self.bad_words_token_ids for t in word]),
        ):
            for t in ids:
                if t >= vocab_size:
                    raise ValueError(f"{name} has token id {t}, outside the vocabulary [0, {vocab_size})")

    def banned_tokens(self, output_token_ids: Sequence[int]) -> list[int]:
        """The tokens that would complete a bad word now: the last tokens of the words whose
        other tokens the output ends with (vLLM's rule; a one-token word is always banned)."""
        banned: list[int] = []
        n = len(output_token_ids)
        for length, last_tokens in self._bad_word_prefixes:
            if length > n:
                break
            banned += last_tokens.get(tuple(output_token_ids[n - length:]) if length else (), ())
        return banned

    @cached_property
    def _bad_word_prefixes(self) -> tuple[tuple[int, dict[tuple[int, ...], tuple[int, ...]]], ...]:
        """(prefix length, {prefix: last tokens}), shortest first: a step looks up one
        tail per distinct length, however many words there are."""
        by_length: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for word in self.bad_words_token_ids:
            by_length.setdefault(len(word) - 1, {}).setdefault(word[:-1], []).append(word[-1])
        return tuple(
            (length, {prefix: tuple(last) for prefix, last in prefixes.items()})
            for length, prefixes in sorted(by_length.items())
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_token_controls(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids)

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def check_stop_conditions(stop: Sequence[object], stop_token_ids: Sequence[object]) -> None:
    """ValueError naming the field and the limit for more than ``MAX_STOP_STRINGS`` stop
    strings, one that is empty, not a string or over ``MAX_STOP_STRING_LEN`` characters, or
    more than ``MAX_STOP_TOKEN_IDS`` stop token ids. The router calls it before any costly
    work on a request; ``SamplingParams`` calls it for the engine's own API."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(stop)} strings, over the limit of {MAX_STOP_STRINGS}")
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must be a list of non-empty strings, got {s!r}")
        if len(s) > MAX_STOP_STRING_LEN:
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_LEN} characters, got {len(s)} (stop[{i}])")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids has {len(stop_token_ids)} ids, over the limit of {MAX_STOP_TOKEN_IDS}")


def _pair(name: str, pair: object) -> tuple:
    """(token id, value) from an item of a mapping or a pair given as a sequence."""
    if not isinstance(pair, Sequence) or isinstance(pair, str) or len(pair) != 2:
        raise ValueError(f"{name} must map token ids to numbers, got {pair!r}")
    return tuple(pair)


def _check_int(name: str, value: object, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")
