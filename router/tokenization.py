"""The tokenizer endpoints, in vLLM's shapes: ``POST /tokenize`` and ``POST /detokenize``.

``/tokenize`` takes a completions-style ``prompt`` (text; ``add_special_tokens``,
default true) or a chat-style ``messages`` list, with optional ``tools`` and
``chat_template_kwargs`` (through the chat template, the tools as a chat request whose
``tool_choice`` is not "none" renders them;
``add_generation_prompt`` default true, ``add_special_tokens`` default false, as the
template writes them itself) and returns ``{"count", "max_model_len", "tokens"}``
(plus ``token_strs`` when ``return_token_strs`` is set). A prompt longer than the
context is counted, not refused: telling the client so is what the count is for.
``/detokenize`` turns ``{"tokens"}`` into ``{"prompt"}``. Pure, like
``router.validation``: bad input is an ``ApiError`` naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from router.bodies import ChatMessage, ToolDef, check_text, parse_as
from router.errors import ApiError
from router.tool_requests import template_tools
from router.validation import ServedModel, check_token_ids, render_chat


class _TokenizerBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None


class TokenizeCompletionBody(_TokenizerBody):
    """A ``/tokenize`` body with a completions-style ``prompt``."""

    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatBody(_TokenizerBody):
    """A ``/tokenize`` body with a chat's ``messages`` (and ``tools``), rendered
    through the chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeBody(_TokenizerBody):
    """A ``/detokenize`` body: the token ids to turn back into text."""

    tokens: list[int]


def tokenize(body: dict, model: ServedModel, tokenizer) -> dict:
    """The ``/tokenize`` response for ``body``; raises ``ApiError``."""
    if "messages" in body:
        b = parse_as(TokenizeChatBody, body)
        model.check_name(b.model)
        if b.continue_final_message and b.add_generation_prompt:
            raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true",
                           param="continue_final_message")
        text = render_chat(b.messages, tokenizer, b.add_generation_prompt, template_tools(b.tools),
                           b.chat_template_kwargs)
        if b.continue_final_message:
            text = _open_final_message(text, check_text(b.messages[-1].text(), "messages"))
    else:
        b = parse_as(TokenizeCompletionBody, body)
        model.check_name(b.model)
        text = check_text(b.prompt, "prompt")
    ids = tokenizer.encode(text, add_special_tokens=b.add_special_tokens)
    out = {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids}
    if b.return_token_strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


def _open_final_message(text: str, final: str) -> str:
    """The rendered chat cut right after the last message's content, so the model would go
    on with that message rather than start a new one (as vLLM's continue_final_message)."""
    final = final.strip()  # templates often trim it
    start = text.rfind(final) if final else -1
    if start < 0:
        raise ApiError(400, "continue_final_message needs a final message whose text the chat template keeps",
                       param="continue_final_message")
    return text[: start + len(final)]


def detokenize(body: dict, model: ServedModel, tokenizer) -> dict:
    """The ``/detokenize`` response for ``body``; raises ``ApiError``."""
    b = parse_as(DetokenizeBody, body)
    model.check_name(b.model)
    check_token_ids(b.tokens, model, "tokens")
    return {"prompt": tokenizer.decode(b.tokens, skip_special_tokens=False)}
