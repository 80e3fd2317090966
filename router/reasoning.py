"""Reasoning output: the thinking of models that think before they answer, apart from the
answer, whole (``ReasoningPlan.split``) or as it streams (``ReasoningStream``).

A parser names a family's format (``REASONING_PARSERS``, by vLLM's ``--reasoning-parser``
names): both read a ``<think>...</think>`` block at the start of the output.

- ``qwen3``: the output thinks when it opens with ``<think>`` (after blanks), or when the
  prompt already opened the block (a template whose generation prompt ends in
  ``<think>``, as Qwen3's thinking-only models' and DeepSeek-R1's newer ones do); with
  ``enable_thinking: false`` Qwen3's template closes an empty block in the prompt, and
  the output is all answer.
- ``deepseek_r1``: the output always starts in its thinking (DeepSeek-R1 writes no
  ``<think>`` of its own); a leading ``<think>`` is read as the block's start.

The router's ``reasoning_parser`` setting picks one (``router.core.ApiConfig``): ``auto``
(the default) takes ``qwen3`` for a chat template that writes ``</think>`` and none
otherwise; ``none`` turns it off. A request whose output a grammar shapes (structured
output, a required or named tool choice) is read from its start, never as thinking the
prompt opened: the grammar governs every token, so only a block the grammar lets the
output write is thinking.

What is thinking: the text between the block's start and ``</think>``, without the
blanks around it (None when that leaves nothing); the answer: what follows
``</think>``, without the blanks before it (None when nothing follows, or the block
never closed: an output cut short in its thinking is all reasoning). An output that
does not think is all answer, as written. A stream sends the same text in pieces: a
piece that may be the start of a tag, and blanks that may turn out to be the
thinking's last, wait for what comes next.

Pure: no Ray, no torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """A family's thinking format: its tags, and whether its output always starts
    inside the thinking (the start tag then optional)."""

    name: str
    always_thinks: bool = False
    start: str = THINK_START
    end: str = THINK_END


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1", always_thinks=True),
}
AUTO, NONE = "auto", "none"
REASONING_SETTINGS = (AUTO, NONE, *REASONING_PARSERS)


def check_reasoning_setting(setting: str) -> None:
    """ValueError naming ``reasoning_parser`` unless ``setting`` is one it takes."""
    if setting not in REASONING_SETTINGS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_SETTINGS)}; got {setting!r}")


def reasoning_parser(setting: str, template: str | None) -> ReasoningParser | None:
    """The parser the router's ``reasoning_parser`` setting names for a model whose chat
    template is ``template``: ``auto`` takes ``qwen3`` for a template that writes
    ``</think>`` (it teaches the model to think), none otherwise."""
    check_reasoning_setting(setting)
    if setting == NONE:
        return None
    if setting == AUTO:
        return REASONING_PARSERS["qwen3"] if template and THINK_END in template else None
    return REASONING_PARSERS[setting]


@dataclass(frozen=True)
class Split:
    """An output as thinking and answer (either None when it has none)."""

    reasoning: str | None
    content: str | None


class Part(enum.IntEnum):
    """Which side of the output a streamed piece belongs to."""

    REASONING = 0
    CONTENT = 1


@dataclass(frozen=True)
class ReasoningPlan:
    """How to read one request's output: the parser, and whether the output starts
    inside the thinking (the prompt opened the block, or the family always thinks)."""

    parser: ReasoningParser
    thinking: bool = False

    @classmethod
    def for_prompt(cls, parser: ReasoningParser | None, prompt: str, constrained: bool) -> ReasoningPlan | None:
        """The plan of a request with rendered prompt ``prompt``; ``constrained``: a
        grammar shapes its output from the first token (read from its start)."""
        if parser is None:
            return None
        opened = prompt.rstrip().endswith(parser.start)
        return cls(parser, not constrained and (parser.always_thinks or opened))

    def split(self, text: str) -> Split:
        """The whole output as thinking and answer."""
        start, end = self.parser.start, self.parser.end
        lead = text.lstrip()
        if lead.startswith(start):
            body = lead[len(start):]
        elif self.thinking:
            body = text
        else:
            return Split(None, text)
        reasoning, found, content = body.partition(end)
        return Split(reasoning.strip() or None, (content.lstrip() or None) if found else None)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class _Phase(enum.IntEnum):
    OPENING = 0  # nothing but blanks and perhaps part of the start tag yet
    REASONING = 1  # inside the block: thinking goes out, the end tag is looked for
    CONTENT = 2  # the answer: it goes out as it comes


def _tag_prefix_len(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a beginning of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """One output's pieces as they come, as (``Part``, text) pieces: ``feed`` each piece
    of text, then ``finish`` once. Together the pieces of each part are the whole
    output's ``split``: the thinking's without its blanks around, the answer's without
    the blanks after ``</think>``.

    Phases: OPENING (the output may yet open a block: blanks and a start tag's beginning
    wait) ─▶ REASONING (the tag came, or the plan starts there) ─▶ CONTENT (after
    ``</think>``); or OPENING ─▶ CONTENT for an output that does not think.
    """

    def __init__(self, plan: ReasoningPlan) -> None:
        self.parser = plan.parser
        self.thinking = plan.thinking
        self.phase = _Phase.OPENING
        self.held = ""  # text come but not sent: a possible tag's start, blanks that may end the thinking
        self.reasoned = False  # some thinking went out (the blanks before it are dropped, those inside kept)
        self.trim = False  # the answer follows </think>: its leading blanks are dropped

    def feed(self, text: str) -> list[tuple[Part, str]]:
        if not text:
            return []
        if self.phase is _Phase.CONTENT and not self.trim:
            return [(Part.CONTENT, text)]
        self.held += text
        if self.phase is _Phase.OPENING:
            self._open()
        if self.phase is _Phase.REASONING:
            return self._reasoning()
        if self.phase is _Phase.CONTENT:
            return self._content()
        return []

    def finish(self) -> list[tuple[Part, str]]:
        """What is left to send once the output ended."""
        held, self.held = self.held, ""
        if self.phase is _Phase.REASONING or (self.phase is _Phase.OPENING and self.thinking):
            piece = held.rstrip() if self.reasoned else held.strip()
            return [(Part.REASONING, piece)] if piece else []
        if self.phase is _Phase.CONTENT and self.trim:
            held = held.lstrip()
        return [(Part.CONTENT, held)] if held else []

    def _open(self) -> None:
        """Leave OPENING once the output's start says whether it opens a block."""
        lead, start = self.held.lstrip(), self.parser.start
        if lead.startswith(start):
            self.phase, self.held = _Phase.REASONING, lead[len(start):]
        elif start.startswith(lead):
            return  # blanks, or the start tag's beginning: wait
        else:
            self.phase = _Phase.REASONING if self.thinking else _Phase.CONTENT

    def _reasoning(self) -> list[tuple[Part, str]]:
        """Thinking up to the end tag, holding a possible tag's beginning and the blanks
        before it; past the tag, the answer."""
        end = self.parser.end
        at = self.held.find(end)
        if at >= 0:
            piece, self.held = self.held[:at], self.held[at + len(end):]
            self.phase, self.trim = _Phase.CONTENT, True
            out = self._thought(piece.rstrip())
            return out + self._content()
        keep = _tag_prefix_len(self.held, end)
        ready = self.held[:len(self.held) - keep]
        piece = ready.rstrip()
        self.held = self.held[len(piece):]
        return self._thought(piece)

    def _thought(self, piece: str) -> list[tuple[Part, str]]:
        if not self.reasoned:
            piece = piece.lstrip()
        if not piece:
            return []
        self.reasoned = True
        return [(Part.REASONING, piece)]

    def _content(self) -> list[tuple[Part, str]]:
        held = self.held
        if self.trim:
            held = held.lstrip()
            if not held:
                self.held = ""
                return []
            self.trim = False
        self.held = ""
        return [(Part.CONTENT, held)] if held else []
