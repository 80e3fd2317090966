"""A request's state inside one engine.

A request carries counters, not phase flags. It is "in prefill" while
``num_computed_tokens < num_prompt_tokens``; chunked prefill, prefix-cache hits,
preemption by recompute and KV that arrives from a remote prefill worker are all
moves of ``num_computed_tokens``.

Lifecycle (``RequestStatus`` is ordered; everything past ``SWAPPED`` is finished)::

    WAITING ──schedule──▶ RUNNING ──finish──▶ FINISHED_*
       ▲   ▲                 │  │
       │   └──recompute──────┘  └──swap out──▶ SWAPPED ──swap in──▶ RUNNING
    WAITING_FOR_REMOTE_KV ──KV arrived──▶ RUNNING (decode role)
                          ──transfer failed──▶ WAITING (recompute) or FINISHED_ERROR

In the prefill role a request is generated with ``max_tokens=1`` and ``hold_kv``:
when it finishes, its blocks stay allocated until the worker releases them after a
transfer read them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.wire.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Where a request stands in its engine (the lifecycle in the module docstring); ordered, so
    every status past ``SWAPPED`` is finished."""

    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1
    RUNNING = 2
    SWAPPED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def finished(self) -> bool:
        return self > RequestStatus.SWAPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler sees it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0  # lower value = more important, as in vLLM
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache, first schedule
    # Decode role: leading blocks of a remote prompt not sent (this worker's prefix cache held
    # them, or they are behind every layer's window).
    num_unsent_blocks: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    # Seeds the request's random draws (with the output index), whatever batch it is in.
    sampling_seed: int = 0
    # Monotonic order of arrival, used to break ties (set by the scheduler).
    seq_no: int = 0
    # Prefill role: keep the blocks after finishing until the caller releases them (a
    # transfer reads them in place).
    hold_kv: bool = False
    # The LoRA adapter it runs under, by its key ("name@digest": engine.model.lora.Adapter),
    # None for the base model; prefix-cache hashes are rooted in it.
    adapter: str | None = None
    # Set by the engine (the scheduler never reads the clock), for latency metrics.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids in positions [start, end) of prompt + output, without a full copy."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.SWAPPED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
