"""A chat output as the assistant message's parts: its thinking (``router.reasoning``),
its answer, and the tool calls in the answer (``router.tool_calls``), whole
(``read_message``) or as it streams (``MessageStream``). The tool calls, like
structured output, are read from the answer alone: what follows the thinking.

Both endpoints that answer chats read their outputs here: chat completions (a message,
or ``delta`` chunks) and the Responses API (output items, or typed events).
Pure: no Ray, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.reasoning import Part, ReasoningPlan, Split
from router.tool_calls import ToolPlan, ToolStream
from router.tool_parsers import Parsed, ToolCall


@dataclass(frozen=True)
class Message:
    """An output read whole: thinking, answer and calls (``reasoning`` and ``content``
    None when there are none), and the finish reason the calls make of the engine's."""

    reasoning: str | None
    content: str | None
    calls: list[ToolCall]
    finish_reason: str | None


def read_message(text: str, reason: str | None, tools: ToolPlan | None = None,
                 reasoning: ReasoningPlan | None = None) -> Message:
    """The whole output ``text`` (finished for ``reason``) as its message's parts."""
    split = reasoning.split(text) if reasoning is not None else Split(None, text)
    if tools is None:
        return Message(split.reasoning, split.content, [], reason)
    parsed = tools.parse(split.content or "")
    content = parsed.content if split.content is not None else None
    return Message(split.reasoning, content, parsed.calls, tools.finish_reason(parsed, reason))


def chat_message(message: Message, tools: bool, reasoning: bool) -> dict:
    """The chat completion's ``message``: ``tool_calls`` for a request that may call
    tools, ``reasoning_content`` for one whose reasoning is read."""
    out: dict = {"role": "assistant", "content": message.content}
    if reasoning:
        out["reasoning_content"] = message.reasoning
    if tools:
        out["tool_calls"] = [call.as_dict() for call in message.calls]
    return out


class MessageStream:
    """An output's deltas as OpenAI's streamed message parts: ``{"reasoning_content": ...}``
    while it thinks, then the answer as ``{"content": ...}`` or, for a request that may
    call tools, as its ``ToolStream`` sends it (content and ``{"tool_calls": [...]}``).

    ``feed`` each piece of text, then ``finish`` once; ``finish_reason`` turns the
    engine's into the message's (``"tool_calls"`` when it called tools).
    """

    def __init__(self, reasoning: ReasoningPlan | None, tools: ToolPlan | None) -> None:
        self.reasoning = reasoning.stream() if reasoning is not None else None
        self.plan = tools
        self.tools = ToolStream(tools) if tools is not None else None

    def feed(self, text: str) -> list[dict]:
        if self.reasoning is None:
            return self._answer(text)
        return self._parts(self.reasoning.feed(text))

    def finish(self) -> tuple[list[dict], Parsed | None]:
        """The deltas left to send, and the calls' parse (None without tools)."""
        deltas = self._parts(self.reasoning.finish()) if self.reasoning is not None else []
        if self.tools is None:
            return deltas, None
        rest, parsed = self.tools.finish()
        return deltas + rest, parsed

    def finish_reason(self, parsed: Parsed | None, reason: str | None) -> str | None:
        if self.plan is None or parsed is None:
            return reason
        return self.plan.finish_reason(parsed, reason)

    def _parts(self, pieces: list[tuple[Part, str]]) -> list[dict]:
        out: list[dict] = []
        for part, text in pieces:
            out += [{"reasoning_content": text}] if part is Part.REASONING else self._answer(text)
        return out

    def _answer(self, text: str) -> list[dict]:
        if self.tools is not None:
            return self.tools.feed(text)
        return [{"content": text}] if text else []
