"""Admission control: a bound on the work the router has let in and not yet finished.

Pure logic (integers and ``now`` passed in, no clock, no Ray). A request is admitted
when both bounds leave room for it: outstanding requests and outstanding prompt
tokens. A rejection carries a ``retry_after_s`` hint: how long, at the rate requests
have recently been finishing, until enough of them are gone to make room (never less
than ``min_retry_after_s``, never more than ``max_retry_after_s``).

A ticket's lifecycle::

    try_admit(prompt_tokens, now) ──▶ Ticket ──▶ release(ticket, now)   (exactly once)
                                 └──▶ Rejection(reason, retry_after_s)

``try_admit_all`` admits a batch (the prompts of one request) whole or not at all.

``Intake`` bounds the work before admission the same way: the requests a replica is
reading, rendering and tokenizing at once (``router.core`` runs that on its tokenizer
threads) and their bodies' bytes. An intake ticket's lifecycle::

    try_enter(body_bytes, now) ──▶ IntakeTicket ──▶ leave(ticket, now)   (when its thread is done)
                               └──▶ Rejection(reason, retry_after_s)
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionConfig:
    """The admission bounds (outstanding requests and prompt tokens: the ``max_outstanding_*``
    settings) and the limits of the retry hint; checked on creation."""

    max_requests: int = 256
    max_prompt_tokens: int = 262_144
    min_retry_after_s: float = 1.0
    max_retry_after_s: float = 60.0
    rate_window_s: float = 10.0  # how far back finished requests count for the rate

    def __post_init__(self) -> None:
        if self.max_requests < 1:
            raise ValueError(f"max_outstanding_requests must be >= 1, got {self.max_requests}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_outstanding_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if not 0 < self.min_retry_after_s <= self.max_retry_after_s:
            raise ValueError("need 0 < min_retry_after_s <= max_retry_after_s")


@dataclass(frozen=True)
class IntakeConfig:
    """The bounds on the work before admission: requests being validated (parsed, rendered,
    tokenized) at once and their bodies' bytes, past either a 429; and the tokenizer threads
    that do it, the others waiting their turn. Checked on creation."""

    threads: int = 2
    max_requests: int = 256
    max_bytes: int = 16 << 20  # 16 bodies of the 1 MiB limit: a few seconds of tokenizing

    def __post_init__(self) -> None:
        for name in ("threads", "max_requests", "max_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"intake {name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Ticket:
    """An admitted request's share of the bounds; hand it to ``release`` exactly
    once, when the request ends."""

    prompt_tokens: int


@dataclass(frozen=True)
class IntakeTicket:
    """A request's share of the intake bounds; hand it to ``Intake.leave`` exactly once,
    when its validation is done."""

    body_bytes: int


@dataclass(frozen=True)
class Rejection:
    """A refusal: the message names the bound that was hit, with the whole seconds to wait before
    retrying (the edges answer 429 or RESOURCE_EXHAUSTED with it)."""

    reason: str
    retry_after_s: int
    code: str = "busy"  # the bound that was hit: a short label for metrics


class Admission:
    """One router replica's count of the work it let in and has not finished (a ticket's
    lifecycle is in the module docstring); ``RouterCore`` owns one, and every call
    takes the time as ``now``."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self.requests = 0
        self.prompt_tokens = 0
        self.num_admitted = 0
        self.num_rejected = 0
        self._hint = _RetryHint(self.config)  # from the rate requests are released at

    def try_admit(self, prompt_tokens: int, now: float) -> Ticket | Rejection:
        """Admit the request (count it as outstanding) or say why not and when to retry."""
        cfg = self.config
        if self.requests >= cfg.max_requests:
            return self._reject(
                f"the server has {self.requests} requests in progress "
                f"(max_outstanding_requests={cfg.max_requests})",
                self.requests - cfg.max_requests + 1,
                now,
                "max_outstanding_requests",
            )
        # An idle router admits any single prompt: validation already capped its length.
        if self.requests and self.prompt_tokens + prompt_tokens > cfg.max_prompt_tokens:
            return self._reject(
                f"the server has {self.prompt_tokens} prompt tokens in progress and this request "
                f"adds {prompt_tokens} (max_outstanding_prompt_tokens={cfg.max_prompt_tokens})",
                1,
                now,
                "max_outstanding_prompt_tokens",
            )
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.num_admitted += 1
        return Ticket(prompt_tokens)

    def try_admit_all(self, prompt_tokens: list[int], now: float) -> list[Ticket] | Rejection:
        """A ticket for each request of a batch, or none (the refusal of the first that did
        not fit). ValueError for a batch larger than ``max_requests``: it could never fit."""
        if len(prompt_tokens) > self.config.max_requests:
            raise ValueError(f"{len(prompt_tokens)} requests at once are more than this server ever admits "
                             f"(max_outstanding_requests={self.config.max_requests})")
        tickets: list[Ticket] = []
        for n in prompt_tokens:
            decision = self.try_admit(n, now)
            if isinstance(decision, Rejection):
                for ticket in tickets:  # never let in: no finish to count toward the rate
                    self.requests -= 1
                    self.prompt_tokens -= ticket.prompt_tokens
                    self.num_admitted -= 1
                return decision
            tickets.append(decision)
        return tickets

    def release(self, ticket: Ticket, now: float) -> None:
        """The admitted request ended (finished, failed or cancelled)."""
        self.requests -= 1
        self.prompt_tokens -= ticket.prompt_tokens
        self._hint.finished(now)

    def _reject(self, reason: str, must_finish: int, now: float, code: str) -> Rejection:
        self.num_rejected += 1
        return Rejection(reason, self._hint.seconds(must_finish, now), code)


class Intake:
    """One router replica's count of the requests it is validating before admission (an
    intake ticket's lifecycle is in the module docstring); ``RouterCore`` owns one, and
    every call takes the time as ``now``. Its retry hint follows the rate validations
    end at, within admission's bounds on the hint."""

    def __init__(self, config: IntakeConfig | None = None, hint: AdmissionConfig | None = None) -> None:
        self.config = config or IntakeConfig()
        self.requests = 0
        self.bytes = 0
        self._hint = _RetryHint(hint or AdmissionConfig())

    def try_enter(self, body_bytes: int, now: float) -> IntakeTicket | Rejection:
        """Count the request as being validated, or say why not and when to retry."""
        cfg = self.config
        if self.requests >= cfg.max_requests:
            reason = f"the server is validating {self.requests} requests (max_intake_requests={cfg.max_requests})"
            return Rejection(reason, self._hint.seconds(self.requests - cfg.max_requests + 1, now),
                             "max_intake_requests")
        # An idle intake takes any body: the body size limit already capped it.
        if self.requests and self.bytes + body_bytes > cfg.max_bytes:
            reason = (f"the server is validating {self.bytes} bytes of requests and this one adds "
                      f"{body_bytes} (max_intake_bytes={cfg.max_bytes})")
            return Rejection(reason, self._hint.seconds(1, now), "max_intake_bytes")
        self.requests += 1
        self.bytes += body_bytes
        return IntakeTicket(body_bytes)

    def leave(self, ticket: IntakeTicket, now: float) -> None:
        """The request's validation is done (it passed, failed, or its client left and the
        thread finished anyway)."""
        self.requests -= 1
        self.bytes -= ticket.body_bytes
        self._hint.finished(now)


class _RetryHint:
    """The whole seconds a refusal suggests waiting: how long until ``must_finish`` more of
    the work is done, at the rate it finished over the last ``rate_window_s`` (never less
    than ``min_retry_after_s``, never more than ``max_retry_after_s``)."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._finished: deque[float] = deque()  # finish times within the rate window

    def finished(self, now: float) -> None:
        self._finished.append(now)
        self._trim(now)

    def seconds(self, must_finish: int, now: float) -> int:
        self._trim(now)
        cfg = self.config
        rate = len(self._finished) / cfg.rate_window_s  # finished per second
        # Nothing finished lately: no rate to go by, so suggest the shortest wait.
        wait = must_finish / rate if rate > 0 else cfg.min_retry_after_s
        return math.ceil(min(max(wait, cfg.min_retry_after_s), cfg.max_retry_after_s))

    def _trim(self, now: float) -> None:
        while self._finished and self._finished[0] < now - self.config.rate_window_s:
            self._finished.popleft()
