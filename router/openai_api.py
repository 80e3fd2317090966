"""OpenAI response shapes: completions and chat completions, whole or as SSE chunks.

``Accumulator`` folds a request's ``StreamDelta``s into its text, usage, finish
reason and logprobs; the builders below turn that (or one delta) into the JSON the
OpenAI API returns. A request that asked for vLLM's ``prompt_logprobs`` gets them as
vLLM returns them: on each completion choice, at the top of a chat completion, and
on the first chunk of a stream. A tool request's message is read by its ``ToolPlan``
(``router.tool_calls``). Pure: no Ray, no network.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii

from router.chat_output import chat_message, read_message
from router.reasoning import ReasoningPlan
from router.tool_calls import ToolPlan


@dataclass
class Accumulator:
    """Everything a request streamed so far."""

    tokenizer: object
    text_parts: list[str] = field(default_factory=list)
    text_len: int = 0  # characters so far, without joining the parts
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[str, float, list[tuple[str, float]]]] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list | None = None  # vLLM's shape (``prompt_logprobs_json``)

    def add(self, delta) -> list[tuple[str, float, list[tuple[str, float]]]] | None:
        """Take one delta; returns its logprobs with tokens as text (None without logprobs)."""
        if delta.text:
            self.text_parts.append(delta.text)
            self.text_len += len(delta.text)
        self.token_ids += delta.token_ids
        self.prompt_tokens = delta.num_prompt_tokens or self.prompt_tokens
        self.completion_tokens = max(self.completion_tokens, delta.num_output_tokens, len(self.token_ids))
        self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens)
        if delta.finished:
            self.finish_reason = delta.finish_reason
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs_json(delta.prompt_logprobs, self.token_text)
        if delta.logprobs is None:
            return None
        # An echoed prompt's first token has no logprob and no top tokens (None).
        text = self.token_text
        lps = [
            (text(t), _floored(lp), None if top is None else [(text(i), _floored(v)) for i, v in top])
            for t, lp, top in delta.logprobs
        ]
        self.logprobs = (self.logprobs or []) + lps
        return lps

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


# JSON has no -inf (nor NaN): a token drawn where its constraints left nothing allowed has
# logprob -inf, and would make the whole response a 500. vLLM floors them at the same value.
MIN_LOGPROB = -9999.0


def _floored(lp: float | None) -> float | None:
    return lp if lp is None or lp > MIN_LOGPROB else MIN_LOGPROB  # NaN too: it compares false


def completion_logprobs(lps, text_offset: int) -> dict | None:
    if lps is None:
        return None
    offsets, pos = [], text_offset
    for token, _, _ in lps:
        offsets.append(pos)
        pos += len(token)
    return {
        "tokens": [t for t, _, _ in lps],
        "token_logprobs": [lp for _, lp, _ in lps],
        "top_logprobs": [None if top is None else dict(top) for _, _, top in lps],
        "text_offset": offsets,
    }


def prompt_logprobs_json(entries: list, token_text) -> list:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then for each one
    ``{token id: {"logprob", "rank", "decoded_token"}}``, the prompt's token first and
    then the top tokens. ``entries``: a delta's (token, logprob, rank, top) tuples."""
    out: list = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        token, logprob, rank, top = entry
        ranked = {token: {"logprob": _floored(logprob), "rank": rank, "decoded_token": token_text(token)}}
        for r, (t, lp) in enumerate(top, 1):
            ranked.setdefault(t, {"logprob": _floored(lp), "rank": r, "decoded_token": token_text(t)})
        out.append(ranked)
    return out


def echo_logprobs(prompt_token_ids: list[int], entries: list) -> list:
    """An echoed prompt's tokens as output logprobs (token, logprob, top), the first
    without either."""
    return [(prompt_token_ids[0], None, None)] + [(t, lp, top) for t, lp, _, top in entries[1:]]


def chat_logprobs(lps) -> dict | None:
    if lps is None:
        return None

    def entry(token: str, lp: float) -> dict:
        return {"token": token, "logprob": lp, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(tt, tlp) for tt, tlp in top]} for t, lp, top in lps
        ]
    }


# json.dumps(obj, separators=...) builds an encoder per call; one will do.
_json = json.JSONEncoder(separators=(",", ":")).encode
_json_str = encode_basestring_ascii  # a str as JSON, exactly as json.dumps writes it (in C)


def _json_reason(reason: str | None) -> str:
    return "null" if reason is None else _json_str(reason)


@dataclass(frozen=True)
class Envelope:
    """The fields every response and chunk of one request share."""

    id: str
    model: str
    created: int

    def completion_sse(self, text: str, reason: str | None, lps=None, text_offset: int = 0) -> str:
        """``sse(completion_chunk(text, lps, text_offset, reason))``; without logprobs (the hot
        path of a stream) built from a per-request prefix, encoding only the new text."""
        if lps is not None:
            return sse(self.completion_chunk(text, lps, text_offset, reason))
        return f"{self._prefix('text_completion')}\"text\":{_json_str(text)},\"logprobs\":null," \
            f"\"finish_reason\":{_json_reason(reason)}}}],\"usage\":null}}\n\n"

    def chat_sse(self, text: str | None, reason: str | None, lps=None) -> str:
        """``sse(chat_chunk({"content": text} if text else {}, lps, reason))``, the same way."""
        if lps is not None:
            return sse(self.chat_chunk({"content": text} if text else {}, lps, reason))
        delta = f"{{\"content\":{_json_str(text)}}}" if text else "{}"
        return f"{self._prefix('chat.completion.chunk')}\"delta\":{delta},\"logprobs\":null," \
            f"\"finish_reason\":{_json_reason(reason)}}}],\"usage\":null}}\n\n"

    def _prefix(self, obj: str) -> str:
        # Cached per envelope: the same for every chunk of the request.
        cache = self.__dict__.setdefault("_prefixes", {})
        prefix = cache.get(obj)
        if prefix is None:
            head = _json({"id": self.id, "object": obj, "created": self.created, "model": self.model})
            prefix = cache[obj] = f"data: {head[:-1]},\"choices\":[{{\"index\":0,"
        return prefix

    def _response(self, obj: str, choice: dict | None, usage: dict | None, index: int = 0) -> dict:
        """The shape every response and chunk shares: one choice (``index``: 0 but for a
        request of several prompts), or none."""
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [] if choice is None else [{"index": index, **choice}],
            "usage": usage,
        }

    def completion(self, acc: Accumulator) -> dict:
        return self._response("text_completion", _text_choice(acc), acc.usage())

    def completion_chunk(self, text: str, lps, text_offset: int, reason: str | None, index: int = 0) -> dict:
        choice = {"text": text, "logprobs": completion_logprobs(lps, text_offset), "finish_reason": reason}
        return self._response("text_completion", choice, None, index)

    def chat(self, acc: Accumulator, tools: ToolPlan | None = None, reasoning: ReasoningPlan | None = None) -> dict:
        """The whole chat completion; with ``tools``, its message split into content and
        tool calls (``finish_reason`` "tool_calls" when the model called tools); with
        ``reasoning``, its thinking in ``reasoning_content``."""
        out = self._response("chat.completion", _chat_choice(acc, tools, reasoning), acc.usage())
        if acc.prompt_logprobs is not None:
            out["prompt_logprobs"] = acc.prompt_logprobs  # vLLM's place: the response's top level
        return out

    def first_chunk(self, prompt_logprobs: list | None, chat: bool) -> dict | None:
        """A stream's opening chunk: a chat's role, a completion's prompt logprobs (None
        for a completion without them); either carries ``prompt_logprobs`` when given."""
        if chat:
            chunk = self.chat_chunk({"role": "assistant", "content": ""}, None, None)
        elif prompt_logprobs is not None:
            chunk = self.completion_chunk("", None, 0, None)
        else:
            return None
        if prompt_logprobs is not None:
            (chunk if chat else chunk["choices"][0])["prompt_logprobs"] = prompt_logprobs
        return chunk

    def chat_chunk(self, delta: dict, lps, reason: str | None, index: int = 0) -> dict:
        choice = {"delta": delta, "logprobs": chat_logprobs(lps), "finish_reason": reason}
        return self._response("chat.completion.chunk", choice, None, index)

    def usage_chunk(self, obj: str, acc: Accumulator) -> dict:
        return self._response(obj, None, acc.usage())

    def choices(self, accs: list[Accumulator], chat: bool, n: int, reasoning: ReasoningPlan | None = None) -> dict:
        """The response of several choices (prompts × ``n``), a choice per accumulator,
        in order (see ``usage_of`` for ``n``); a chat's with its ``reasoning`` read."""
        obj = "chat.completion" if chat else "text_completion"
        out = self._response(obj, None, usage_of(accs, n))
        out["choices"] = [{"index": i, **(_chat_choice(acc, None, reasoning) if chat else _text_choice(acc))}
                          for i, acc in enumerate(accs)]
        if chat and accs[0].prompt_logprobs is not None:
            out["prompt_logprobs"] = accs[0].prompt_logprobs  # one prompt: the same for every choice
        return out

    def choices_usage_chunk(self, accs: list[Accumulator], chat: bool, n: int) -> dict:
        return self._response("chat.completion.chunk" if chat else "text_completion", None, usage_of(accs, n))


def usage_of(accs: list[Accumulator], n: int = 1) -> dict:
    """The usage of several requests answered as one: ``n`` choices a prompt, in runs of
    ``n`` (the prompt's tokens, and its cached ones, counted once, as OpenAI counts them);
    the completion tokens of every choice."""
    usages = [acc.usage() for acc in accs]
    prompt = sum(u["prompt_tokens"] for u in usages[::n])
    completion = sum(u["completion_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _text_choice(acc: Accumulator) -> dict:
    choice = {"text": acc.text, "logprobs": completion_logprobs(acc.logprobs, 0), "finish_reason": acc.finish_reason}
    if acc.prompt_logprobs is not None:
        choice["prompt_logprobs"] = acc.prompt_logprobs
    return choice


def _chat_choice(acc: Accumulator, tools: ToolPlan | None = None, reasoning: ReasoningPlan | None = None) -> dict:
    message = read_message(acc.text, acc.finish_reason, tools, reasoning)
    return {"message": chat_message(message, tools is not None, reasoning is not None),
            "logprobs": chat_logprobs(acc.logprobs), "finish_reason": message.finish_reason}


def sse(obj: dict | str) -> str:
    """One server-sent event."""
    data = obj if isinstance(obj, str) else _json(obj)
    return f"data: {data}\n\n"


def model_list(name: str, created: int, max_model_len: int, adapters: tuple[str, ...] = ()) -> dict:
    """``GET /v1/models``: the base model, then each LoRA adapter with the base as its ``parent``."""
    base = {"id": name, "object": "model", "created": created, "owned_by": "tandem", "max_model_len": max_model_len}
    return {
        "object": "list",
        "data": [base, *({**base, "id": a, "root": a, "parent": name} for a in adapters)],
    }
