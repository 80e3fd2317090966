"""Request validation: turns an OpenAI-style body into token ids and ``SamplingParams``.

Everything a user can get wrong is caught here (and in the modules it uses, one concern
each: ``router.bodies`` the bodies' types, ``router.output_constraints`` the structured
output kinds, ``router.tool_requests`` the tools) and raised as ``ApiError`` with the
HTTP status (400, 404, 413), the offending field in ``param`` and a message that
names the field and the limit. The transports map it: HTTP sends the OpenAI error
JSON, gRPC a status code (see ``router.grpc_api``). Pure: no Ray, no network; the
tokenizer and the served model's limits are passed in.

Structured output (``response_format`` json_object / json_schema, and vLLM's
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``; at most one
per request) becomes ``SamplingParams.structured_output``. The checks that need no
grammar engine run here; parsing the spec with xgrammar (which imports torch) runs in
the router's helper process (``router.grammar_check``), before admission. Either way
a bad spec is a 400 naming the field (``PreparedRequest.structured_field``).

Tools (``tools``, ``tool_choice``, ``parallel_tool_calls``, and the assistant's
``tool_calls`` and tool messages in ``messages``) go to the chat template in HF's
convention; a required or named ``tool_choice`` becomes an output constraint (the
schemas are ``router.tool_parsers``'), and ``PreparedRequest.tools`` says how to read the
output.

vLLM's token controls become SamplingParams fields: ``logit_bias`` (OpenAI's map of
token ids, as strings, to biases in [-100, 100]), ``allowed_token_ids``, and
``bad_words`` (strings, tokenized here into the sequences the sampler bans).

Stop conditions are bounded before the prompt is tokenized: at most ``MAX_STOP_STRINGS``
``stop`` strings of at most ``MAX_STOP_STRING_LEN`` characters, and ``MAX_STOP_TOKEN_IDS``
``stop_token_ids`` (``engine.wire.sampling_params``' limits; the engine's own API keeps them too).

``priority`` (vLLM's): an integer, lower served first, that the workers' schedulers
order by when they run the ``priority`` policy. Under ``fcfs`` (the default) only 0
is accepted, as vLLM does: a priority the server would ignore is a 400.
"""

from __future__ import annotations

import dataclasses
import hmac
from dataclasses import dataclass
from typing import Any

import jinja2

from engine.wire.sampling_params import MAX_BAD_WORDS, SamplingParams, StructuredOutput, check_stop_conditions
from router.bodies import ChatBody, ChatMessage, CompletionBody, SamplingBody, check_text, parse_as
from router.errors import ApiError
from router.output_constraints import structured_output
from router.reasoning import ReasoningParser, ReasoningPlan
from router.tool_calls import ToolPlan
from router.tool_requests import chat_tools


def bearer(header: str | None) -> str | None:
    """The key in an ``Authorization`` header (``Bearer <key>``, or the bare key)."""
    if header and header.lower().startswith("bearer "):
        return header[7:].strip()
    return header


def check_api_key(expected: str | None, presented: str | None) -> None:
    """401 unless ``presented`` equals ``expected`` (constant time); no key set: open."""
    if expected is None:
        return
    if presented is None or not hmac.compare_digest(presented.encode(), expected.encode()):
        raise ApiError(
            401,
            "a valid API key is required (Authorization: Bearer <key>)",
            type="authentication_error",
            code="invalid_api_key",
        )


MAX_PROMPTS = 64  # choices in one completions request (prompts × n); each is a request to admission
MAX_N = 16  # choices of one prompt (``n``)
MAX_PRIORITY = 2**31 - 1  # |priority| at most this: it fits gRPC's int32


@dataclass(frozen=True)
class ServedModel:
    """What validation needs to know about the model being served."""

    name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    max_kv_blocks: int  # the smallest KV pool among the workers: a prompt must fit it
    prefill_workers: int = 0
    decode_workers: int = 0
    scheduling_policy: str = "fcfs"  # the workers' engine ``policy``: "priority" honors ``priority``
    # The tokenizer's ``max_chars_per_token``: a text over ``max_prompt_chars`` is refused
    # before it is tokenized. None: no such bound (any text might fit).
    max_chars_per_token: int | None = None
    # How the model's thinking is told from its answer in chat outputs (the router's
    # ``reasoning_parser`` setting for this model's chat template); None: it is not.
    reasoning: ReasoningParser | None = None
    # LoRA adapters every worker serves beside the base model: a request names one as its
    # ``model`` (``adapter_of``).
    adapters: tuple[str, ...] = ()

    @property
    def max_prompt_chars(self) -> int | None:
        """The most characters a prompt's text can have and still be under ``max_model_len``
        tokens; None when the tokenizer gives no bound."""
        return None if self.max_chars_per_token is None else (self.max_model_len - 1) * self.max_chars_per_token

    def check_name(self, requested: str | None) -> None:
        if requested is not None and requested != self.name and requested not in self.adapters:
            served = " and its adapters " + ", ".join(f"'{a}'" for a in self.adapters) if self.adapters else ""
            raise ApiError(
                404,
                f"The model '{requested}' does not exist; this server serves '{self.name}'{served}",
                param="model",
                code="model_not_found",
            )

    def adapter_of(self, requested: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names, or None (the base model)."""
        return requested if requested is not None and requested in self.adapters else None


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready for the dispatcher."""

    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    structured_field: str | None = None  # the field the output constraint came from
    echo: str | None = None  # completions' ``echo``: the prompt's text, to go before the output
    # ``echo`` with ``logprobs``: the prompt's tokens and logprobs go before the output's.
    echo_logprobs: bool = False
    tools: ToolPlan | None = None  # a chat request that may call tools: how to read its output
    reasoning: ReasoningPlan | None = None  # a chat request whose thinking is read apart from its answer
    n: int = 1  # choices to sample from this prompt (see ``choices``)
    priority: int = 0  # lower is scheduled first (under the workers' ``priority`` policy)


@dataclass(frozen=True)
class Choice:
    """One choice of a response: a request of its own, run with its prompt's siblings."""

    prepared: PreparedRequest  # n == 1, and the choice's own seed
    leader: int  # the index of its prompt's first choice: the one that prefills the prompt


def choices(batch: list[PreparedRequest]) -> list[Choice]:
    """The choices of a response to ``batch`` (one request a prompt), in vLLM's order:
    prompt ``p``'s choice ``i`` is at ``p * n + i``. With a ``seed`` s, choice i samples
    with s + i (vLLM's rule): the choices differ, and the response is reproducible."""
    out = []
    for prepared in batch:
        leader, seed = len(out), prepared.params.seed
        for i in range(prepared.n):
            params = prepared.params if seed is None else dataclasses.replace(prepared.params, seed=seed + i)
            out.append(Choice(dataclasses.replace(prepared, params=params, n=1), leader))
    return out


# -- sampling ------------------------------------------------------------------


def _check_priority(b: SamplingBody, model: ServedModel) -> None:
    """``priority`` within +-MAX_PRIORITY, and 0 unless the workers schedule by it."""
    if abs(b.priority) > MAX_PRIORITY:
        raise ApiError(400, f"priority must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {b.priority}",
                       param="priority")
    if b.priority != 0 and model.scheduling_policy != "priority":
        raise ApiError(400, f"priority is {b.priority}, but this server schedules requests "
                       f"{model.scheduling_policy!r}, not by priority: leave it out or send 0", param="priority")


def _check_n(b: SamplingBody) -> None:
    """``n`` in [1, MAX_N]; ``best_of`` only as a no-op (None, or equal to n)."""
    if not 1 <= b.n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {b.n}", param="n")
    if b.best_of not in (None, b.n):
        raise ApiError(400, f"best_of is not supported: it must equal n ({b.n}) or be left out, got {b.best_of}",
                       param="best_of")


def _check_stops(b: SamplingBody) -> None:
    """``stop`` and ``stop_token_ids`` within the engine's limits (``MAX_STOP_*`` in
    ``engine.wire.sampling_params``), checked before the prompt is tokenized."""
    stop = (b.stop,) if isinstance(b.stop, str) else b.stop or ()
    try:
        check_stop_conditions(stop, b.stop_token_ids or ())
    except ValueError as e:
        raise ApiError(400, str(e), param=str(e).split()[0]) from None


def _logit_bias(raw: dict[str, float], model: ServedModel) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as decimal strings) with integer keys."""
    bias = {}
    for key, value in raw.items():
        if not (key.isascii() and key.isdigit()):
            raise ApiError(400, f"logit_bias keys must be token ids (decimal integers as strings), got {key!r}",
                           param="logit_bias")
        if len(key) > 18 or int(key) >= model.vocab_size:
            raise ApiError(400, f"logit_bias has token id {key}, outside the vocabulary [0, {model.vocab_size})",
                           param="logit_bias")
        bias[int(key)] = value
    return bias


def _bad_words(words: list[str], tokenizer) -> list[list[int]]:
    """Each word's token ids, as vLLM finds them: the word as written (leading spaces
    dropped) and, when it tokenizes differently, with one leading space (mid-text)."""
    sequences: list[list[int]] = []
    for word in words:
        word = check_text(word, "bad_words").lstrip()
        if not word:
            raise ApiError(400, "bad_words must hold words that are not empty or blank", param="bad_words")
        bare = tokenizer.encode(word, add_special_tokens=False)
        spaced = tokenizer.encode(" " + word, add_special_tokens=False)
        if bare:
            sequences.append(bare)
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            sequences.append(spaced)
    return sequences


def _token_controls(b: SamplingBody, model: ServedModel, tokenizer) -> dict:
    """The body's ``logit_bias``, ``allowed_token_ids`` and ``bad_words`` as SamplingParams fields."""
    controls: dict = {"allowed_token_ids": b.allowed_token_ids}
    if b.logit_bias:
        controls["logit_bias"] = _logit_bias(b.logit_bias, model)
    if b.bad_words:
        controls["bad_words_token_ids"] = _bad_words(b.bad_words, tokenizer)
    return controls


def _sampling_params(
    b: SamplingBody, max_tokens: int | None, prompt_len: int, model: ServedModel, logprobs: int | None, **fields
):
    room = model.max_model_len - prompt_len
    if max_tokens is None:
        max_tokens = room
    elif isinstance(max_tokens, int) and max_tokens > room:
        raise ApiError(
            400,
            f"max_tokens is {max_tokens}, but the prompt has {prompt_len} tokens and the model's "
            f"context is {model.max_model_len} (max_model_len): at most {room} tokens can be generated",
            param="max_tokens",
        )
    given = {
        name: getattr(b, name)
        for name in (
            "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "seed", "stop_token_ids", "prompt_logprobs",
        )
        if getattr(b, name) is not None
    }
    if given.get("top_k", 0) >= model.vocab_size:
        given["top_k"] = 0  # the whole vocabulary, as 0 says (and small enough for the sampler's tensors)
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            stop=b.stop or (),
            ignore_eos=b.ignore_eos,
            min_tokens=b.min_tokens,
            skip_special_tokens=b.skip_special_tokens,
            include_stop_str_in_output=b.include_stop_str_in_output,
            logprobs=logprobs,
            adapter=model.adapter_of(b.model),
            **fields,
            **given,
        )
        params.check_vocab(model.vocab_size)
        return params
    except ValueError as e:
        # SamplingParams messages start with the field's name.
        raise ApiError(400, str(e), param=str(e).split()[0]) from None


def check_token_ids(ids, model: ServedModel, param: str) -> None:
    """400 naming ``param`` for an id outside the model's vocabulary."""
    for t in ids:
        if not 0 <= t < model.vocab_size:
            raise ApiError(
                400, f"{param} has token id {t}, outside the vocabulary [0, {model.vocab_size})", param=param
            )


def _check_length(text: str, model: ServedModel, param: str) -> str:
    """``text``, or a 400 naming ``param`` without tokenizing it when it has more characters
    than ``max_model_len`` tokens could hold (``ServedModel.max_prompt_chars``)."""
    most = model.max_prompt_chars
    if most is not None and len(text) > most:
        raise ApiError(
            400,
            f"{param} has {len(text)} characters; the model's context is {model.max_model_len} tokens "
            f"(max_model_len), this tokenizer's tokens hold at most {model.max_chars_per_token} characters "
            f"each, and the prompt must leave room for output: at most {most} characters",
            param=param,
            code="context_length_exceeded",
        )
    return text


def _check_prompt(ids: list[int], model: ServedModel, param: str) -> None:
    if not ids:
        raise ApiError(400, f"{param} must not be empty", param=param)
    check_token_ids(ids, model, param)
    if len(ids) >= model.max_model_len:
        raise ApiError(
            400,
            f"{param} has {len(ids)} tokens; the model's context is {model.max_model_len} tokens "
            "(max_model_len), and the prompt must be shorter to leave room for output",
            param=param,
            code="context_length_exceeded",
        )
    blocks = -(-(len(ids) + 1) // model.block_size)
    if blocks > model.max_kv_blocks:
        raise ApiError(
            400,
            f"{param} has {len(ids)} tokens, more than a worker's KV cache holds "
            f"({model.max_kv_blocks} blocks of {model.block_size} tokens)",
            param=param,
            code="context_length_exceeded",
        )


def _stream_flags(b: SamplingBody) -> tuple[bool, bool]:
    if b.stream_options is not None and not b.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    return b.stream, bool(b.stream_options and b.stream_options.include_usage)


def _parse_body(model_cls: type[SamplingBody], body: dict, model: ServedModel) -> Any:
    """Parse a body and check what every endpoint checks: the model's name, ``n``,
    ``best_of``, ``priority``, the stop conditions' limits and the number of ``bad_words``."""
    b = parse_as(model_cls, body)
    model.check_name(b.model)
    _check_n(b)
    _check_priority(b, model)
    _check_stops(b)
    if b.bad_words and len(b.bad_words) > MAX_BAD_WORDS:  # each would be tokenized twice
        raise ApiError(400, f"bad_words has {len(b.bad_words)} words, over the limit of {MAX_BAD_WORDS}",
                       param="bad_words")
    return b


def _prepared(
    b: SamplingBody, ids: list[int], max_tokens: int | None, model: ServedModel, logprobs: int | None, tokenizer,
    output: tuple[str, StructuredOutput] | None = None,
) -> PreparedRequest:
    """The prompt's ids with the body's sampling params (output constraint, or ``output``
    when given, and token controls included) and stream flags."""
    field, constraint = output or structured_output(b) or (None, None)
    controls = _token_controls(b, model, tokenizer)
    params = _sampling_params(b, max_tokens, len(ids), model, logprobs, structured_output=constraint, **controls)
    stream, usage = _stream_flags(b)
    return PreparedRequest(ids, params, stream, usage, field, n=b.n, priority=b.priority)


# -- the two endpoints ---------------------------------------------------------


# The variables the chat template gets from the renderer itself (``engine.tokenizer``):
# ``chat_template_kwargs`` may not replace them.
TEMPLATE_OWN_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "strftime_now"}
)


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's ``chat_template_kwargs``: variables for the template; 400 naming one that
    the renderer sets itself."""
    for name in kwargs or ():
        if name in TEMPLATE_OWN_VARIABLES:
            raise ApiError(400, f"chat_template_kwargs.{name}: the chat template gets {name!r} from the request "
                           "itself; it cannot be set here", param=f"chat_template_kwargs.{name}")
    return dict(kwargs or {})


def render_chat(
    messages: list[ChatMessage], tokenizer, add_generation_prompt: bool = True, tools: list[dict] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The conversation (and the ``tools``, HF's ``{"type": "function", "function": ...}``
    dicts, when given, and ``template_kwargs``, the template's other variables) through
    the model's chat template, as text; 400 naming ``messages`` (or the variable)."""
    plain = [m.for_template(i) for i, m in enumerate(messages)]
    extra = _template_kwargs(template_kwargs)
    if tools:
        extra["tools"] = tools
    try:
        return tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt, **extra)
    except (ValueError, jinja2.TemplateError) as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None


def prepare_completions(body: dict, model: ServedModel, tokenizer) -> list[PreparedRequest]:
    """Validate a ``/v1/completions`` body: a request a prompt (a list of prompts gives a
    choice each, in order); raises ``ApiError``."""
    b: CompletionBody = _parse_body(CompletionBody, body, model)
    if b.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    prompts = b.prompt
    if not (isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))):
        prompts = [prompts]
    if len(prompts) * b.n > MAX_PROMPTS:
        param = "prompt" if len(prompts) > MAX_PROMPTS else "n"
        raise ApiError(400, f"prompt holds {len(prompts)} prompts and n is {b.n}: {len(prompts) * b.n} choices, "
                       f"over the limit of {MAX_PROMPTS} a request", param=param)
    return [_completion(b, prompt, model, tokenizer) for prompt in prompts]


def prepare_completion(body: dict, model: ServedModel, tokenizer) -> PreparedRequest:
    """Validate a completions body of one prompt (as gRPC's are); raises ``ApiError``."""
    prepared = prepare_completions(body, model, tokenizer)
    if len(prepared) != 1:
        raise ApiError(400, f"prompt holds {len(prepared)} prompts; send one per request", param="prompt")
    return prepared[0]


def _completion(b: CompletionBody, prompt: str | list[int], model: ServedModel, tokenizer) -> PreparedRequest:
    if isinstance(prompt, str):
        ids = tokenizer.encode(_check_length(check_text(prompt, "prompt"), model, "prompt"))
    else:
        ids = list(prompt)
    _check_prompt(ids, model, "prompt")
    if b.logprobs is not None and b.logprobs < 0:
        raise ApiError(400, f"logprobs must be >= 0, got {b.logprobs}", param="logprobs")
    max_tokens = 16 if b.max_tokens is None else b.max_tokens
    echo_logprobs = b.echo and b.logprobs is not None
    if echo_logprobs:  # as vLLM: the prompt's logprobs with as many top tokens as the output's
        b = b.model_copy(update={"prompt_logprobs": max(b.logprobs, b.prompt_logprobs or 0)})
    prepared = _prepared(b, ids, max_tokens, model, b.logprobs, tokenizer)
    if not b.echo:
        return prepared
    # As vLLM: text as sent; token ids as the tokenizer spells them, special tokens kept.
    echo = prompt if isinstance(prompt, str) else tokenizer.decode(ids, skip_special_tokens=False)
    return dataclasses.replace(prepared, echo=echo, echo_logprobs=echo_logprobs)


def prepare_chat(body: dict, model: ServedModel, tokenizer) -> PreparedRequest:
    """Validate a ``/v1/chat/completions`` body; raises ``ApiError``."""
    b: ChatBody = _parse_body(ChatBody, body, model)
    tools = chat_tools(b, tokenizer)
    if tools.plan is not None and b.n > 1:
        raise ApiError(400, f"n is {b.n}, but a request that may call tools takes n = 1 (or tool_choice "
                       "'none')", param="n")
    # The template writes the special tokens itself (as HF's tokenize=True does).
    text = render_chat(b.messages, tokenizer, tools=tools.template_tools, template_kwargs=b.chat_template_kwargs)
    ids = tokenizer.encode(_check_length(text, model, "messages"), add_special_tokens=False)
    _check_prompt(ids, model, "messages")
    top = b.top_logprobs
    if top is not None and not b.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    max_tokens = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
    logprobs = (top or 0) if b.logprobs else None
    prepared = _prepared(b, ids, max_tokens, model, logprobs, tokenizer, tools.output)
    constrained = prepared.params.structured_output is not None
    reasoning = ReasoningPlan.for_prompt(model.reasoning, text, constrained)
    return dataclasses.replace(prepared, tools=tools.plan, reasoning=reasoning)
