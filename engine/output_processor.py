"""Output processing: what a request's sampled tokens become for whoever asked.

What it owns: each request's incremental detokenizer (with its stop strings), its
logprobs and prompt logprobs, and how much of each has been delivered; it builds the
``RequestOutput`` deltas a step returns. It decides two of the ways a request stops
(a stop string in its text; its grammar complete and a stop token taken); the engine
finishes those in the scheduler. The scheduler and the model runner never see text.

A request's lifecycle here::

    add ─▶ update (each step that samples for it: detokenize, look for stop
           strings, take its logprobs) ─▶ output (this step's delta) ─▶ ...
        ─▶ final (the last output, with the whole token list and times) ─▶ forgotten

A migrated stream is added with the tokens the worker it left had already streamed:
their text counts as sent, and its outputs start after them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.request import Request
from engine.detokenizer import IncrementalDetokenizer
from engine.model.sampler import TokenLogprobs
from engine.structured_output import StructuredOutputs
from engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class RequestTimes:
    """Where a finished request's time went, in seconds (None: that phase was elsewhere)."""

    queue_s: float | None
    prefill_s: float | None
    decode_s: float | None
    e2e_s: float

    @classmethod
    def of(cls, request: Request, now: float) -> RequestTimes:
        sched, first = request.first_scheduled_time, request.first_token_time
        return cls(
            queue_s=None if sched is None else sched - request.arrival_time,
            prefill_s=None if sched is None or first is None else first - sched,
            decode_s=None if first is None else now - first,
            e2e_s=now - request.arrival_time,
        )


@dataclass
class RequestOutput:
    """Progress of one request after a step. ``new_*`` fields hold this step's delta.

    ``token_ids`` and ``logprobs`` (the whole output so far) are filled on the final
    output only: copying them every step made streaming cost grow with output length.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    # ``prompt_logprobs`` asked: one entry per prompt token, None first (vLLM's shape), on
    # the request's first output with a token only.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_output_tokens: int = 0
    # Prefill role (``hold_kv``): the ids of the blocks that hold the prompt's KV, kept
    # until ``release_held`` (a transfer reads them in place).
    kv_blocks: list[int] | None = None
    times: RequestTimes | None = None  # set on the final output

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class _Tracked:
    """One request's output state: its detokenizer and what has been delivered."""

    detok: IncrementalDetokenizer
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # None again once delivered
    tokens_sent: int = 0
    logprobs_sent: int = 0


class OutputProcessor:
    """Turns one engine's sampled tokens into ``RequestOutput`` deltas (the lifecycle is in the
    module docstring). ``LLMEngine`` makes one with its tokenizer and grammar matchers, adds each
    request it accepts, feeds it every step's samples and asks it for the outputs."""

    def __init__(self, tokenizer: Tokenizer, structured: StructuredOutputs) -> None:
        self.tokenizer = tokenizer
        self.structured = structured
        self._tracked: dict[str, _Tracked] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tracked

    def add(self, request: Request, resume_output: Sequence[int] = ()) -> None:
        """Start following a request's output; ``resume_output``: tokens a worker it
        migrated from had already streamed (their text is not sent again, and it delivered
        the prompt's logprobs)."""
        params = request.sampling_params
        tracked = _Tracked(
            detok=IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                stop=params.stop,
                skip_special_tokens=params.skip_special_tokens,
                include_stop_str_in_output=params.include_stop_str_in_output,
            ),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=(
                [None] * request.num_prompt_tokens
                if params.prompt_logprobs is not None and not resume_output
                else None
            ),
            tokens_sent=len(resume_output),
        )
        tracked.detok.skip(resume_output)
        self._tracked[request.request_id] = tracked

    def remove(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)

    def clear(self) -> None:
        self._tracked.clear()

    # -- prompt logprobs -------------------------------------------------------

    def store_prompt_logprobs(self, computed: dict[str, tuple[int, list[TokenLogprobs]]]) -> None:
        """Put a step's prompt logprobs in place by prompt index (a chunk recomputed after a
        preemption overwrites its own entries with the same values)."""
        for rid, (first, lps) in computed.items():
            tracked = self._tracked.get(rid)
            if tracked is not None and tracked.prompt_logprobs is not None:
                tracked.prompt_logprobs[first : first + len(lps)] = lps

    def set_prompt_logprobs(self, request_id: str, prompt_logprobs: list[TokenLogprobs | None]) -> None:
        """The prompt's logprobs, whole, as another worker computed them (decode role)."""
        self._tracked[request_id].prompt_logprobs = prompt_logprobs

    # -- each step -------------------------------------------------------------

    def update(
        self, requests: Sequence[Request], sampled: dict[str, int], logprobs: dict[str, TokenLogprobs], now: float
    ) -> list[str]:
        """Take in one new token of each of ``requests`` (``sampled`` by id) and its logprobs;
        returns the ids of those that must stop now (a stop string in their text, whose
        ``stop_reason`` is set, or a complete grammar). The caller finishes them before it
        asks for their outputs."""
        stopped = []
        structured = self.structured
        for request in requests:
            rid = request.request_id
            if request.first_token_time is None:
                request.first_token_time = now
            tracked = self._tracked[rid]
            if tracked.logprobs is not None and rid in logprobs:
                tracked.logprobs.append(logprobs[rid])
            stop = tracked.detok.update([sampled[rid]])
            if request.is_finished:
                continue
            if stop is not None:
                request.stop_reason = stop
                stopped.append(rid)
            elif rid in structured and structured.sync(rid, request.output_token_ids):
                stopped.append(rid)  # the grammar is complete and took a stop token
        return stopped

    def output(self, request: Request) -> RequestOutput:
        """The request's delta since its last output (the whole output too, once finished)."""
        tracked = self._tracked[request.request_id]
        finished = request.is_finished
        new_text = tracked.detok.take_delta(finished=finished)
        new_ids = request.output_token_ids[tracked.tokens_sent :]
        tracked.tokens_sent = request.num_output_tokens
        lps = tracked.logprobs
        new_lps = None
        if lps is not None:
            new_lps = lps[tracked.logprobs_sent :]
            tracked.logprobs_sent = len(lps)
        prompt_lps = None
        if tracked.prompt_logprobs is not None and new_ids:
            prompt_lps, tracked.prompt_logprobs = tracked.prompt_logprobs, None
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids) if finished else [],
            text=tracked.detok.output_text(),
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            # A moved stream's cache hits may cover its earlier output too; usage counts the prompt's.
            num_cached_tokens=min(request.num_cached_tokens, request.num_prompt_tokens),
            logprobs=list(lps) if lps is not None and finished else None,
            new_logprobs=new_lps,
            prompt_logprobs=prompt_lps,
            num_output_tokens=request.num_output_tokens,
        )

    def final(self, request: Request, now: float) -> RequestOutput:
        """A finished request's last output, with its times; the request is forgotten here."""
        out = self.output(request)
        out.times = RequestTimes.of(request, now)
        self.remove(request.request_id)
        return out
