"""The router's transport-independent part (``RouterCore``): validation's checks that
need the model, admission, dispatch, auth, the worker list it keeps fresh and the latency
it reports; and ``RouterConfig``, a replica's settings. ``router.server`` puts HTTP and
gRPC in front of it.

Validation (parsing a body, rendering the chat, tokenizing) runs on the core's tokenizer
threads (``prepare``), never on the event loop that streams every other request's tokens,
and within the intake bounds (``router.admission.Intake``): past them, a 429."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import ray

from engine.grammar import GrammarLimits
from engine.wire.metrics import RouterMetrics
from router.aborts import AbortBudget, AbortConfig
from router.admission import Admission, AdmissionConfig, Intake, IntakeConfig, Rejection, Ticket
from router.api_config import ApiConfig
from router.dispatch import Dispatcher
from router.dispatch_config import DispatchConfig
from router.errors import ApiError
from router.fanout import Fanout
from router.grammar_check import GrammarChecker
from router.latency import LatencyWindow
from router.reasoning import reasoning_parser
from router.response_store import ResponseStore
from router.validation import Choice, PreparedRequest, ServedModel, check_api_key
from router.worker_loads import Affinity

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RouterConfig:
    """A router replica's settings: admission bounds, dispatch settings (the cluster supplies block
    size and running cap), body size limit, API key, how often the worker list is refreshed, and
    what the API reads of outputs and keeps (``api``); ``cluster.service`` builds it from the
    flags or a RayService's args."""

    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    intake: IntakeConfig = field(default_factory=IntakeConfig)  # validation before admission: threads, bounds
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)  # block size etc. come from the cluster
    max_body_bytes: int = 1 << 20
    api_key: str | None = None  # None: no auth
    workers_refresh_s: float = 1.0  # also how often the replica reports its latency to the controller
    latency_window_s: float = 10.0  # the span of the TTFT / ITL percentiles it reports
    aborts: AbortConfig = field(default_factory=AbortConfig)  # Aborts of ids run elsewhere, passed on
    grammar: GrammarLimits = field(default_factory=GrammarLimits)  # structured-output specs: bounds, parse time
    api: ApiConfig = field(default_factory=ApiConfig)  # reasoning output, stored responses



class RouterCore:
    """The transport-independent part: validation, admission, dispatch, auth."""

    def __init__(self, controller, config: RouterConfig, info: dict, workers: tuple, dispatch_settings: dict) -> None:
        """``info``, ``workers`` and ``dispatch_settings``: the cluster controller's
        ``model_info()``, ``workers()`` and ``dispatch_settings()`` (see ``connect``)."""
        from engine.tokenizer import Tokenizer

        self.controller = controller
        self.config = config
        info = dict(info)
        self.tokenizer = Tokenizer.from_pretrained(info.pop("model_dir"))
        reasoning = reasoning_parser(config.api.reasoning_parser, self.tokenizer.chat_template)
        self.model = ServedModel(**info, max_chars_per_token=self.tokenizer.max_chars_per_token(), reasoning=reasoning)
        self.responses = ResponseStore(config.api.max_stored_responses)  # the Responses API's stored ones
        self.created = int(time.time())
        self.admission = Admission(config.admission)
        self.intake = Intake(config.intake, config.admission)
        self._tokenizer_threads = ThreadPoolExecutor(config.intake.threads, thread_name_prefix="router-tokenizer")
        self.aborts = AbortBudget(config.aborts)
        self.replica_id = f"router-{os.getpid()}"
        self.metrics = RouterMetrics(self.model.name, self.replica_id)
        self.latency = LatencyWindow(config.latency_window_s)  # reported for the pools' control loop
        self._prefill, self._decode = workers
        self._refresher: asyncio.Task | None = None
        # Block size and running cap must match the workers' engines, and the prefix hash
        # follows the deployment's setting: the controller knows them.
        dispatch = dataclasses.replace(config.dispatch, **dispatch_settings)
        self.dispatcher = Dispatcher(lambda: self._prefill, lambda: self._decode, dispatch, self.metrics)
        self.grammars = GrammarChecker(config.grammar)
        self.fanouts: dict[str, Fanout] = {}  # request id -> its choices, for a request of several in flight

    @classmethod
    def connect(cls, controller, config: RouterConfig) -> RouterCore:
        """A core for the cluster behind ``controller`` (a cluster controller actor handle).

        Asks for the controller's ``start``, which is idempotent: it answers once the
        pools are up, so a replica may be created while they still start.
        """
        info = ray.get(controller.start.remote())
        workers, settings = ray.get([controller.workers.remote(), controller.dispatch_settings.remote()])
        return cls(controller, config, info, workers, settings)

    # -- workers ---------------------------------------------------------------

    def ensure_refreshing(self) -> None:
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.get_running_loop().create_task(self._refresh())

    async def _refresh(self) -> None:
        """Every ``workers_refresh_s``: the live worker list from the controller, and this
        replica's recent latency to it (the pools' control loop reads it against the SLO)."""
        while True:
            await asyncio.sleep(self.config.workers_refresh_s)
            try:
                self._prefill, self._decode = await self.controller.workers.remote()
                self.controller.report_latency.remote(self.replica_id, self.latency.report(time.monotonic()))
            except Exception:  # the controller restarting is no reason to stop serving
                log.exception("could not refresh the worker list")

    @property
    def healthy(self) -> bool:
        return bool(self._decode)

    # -- auth and admission ----------------------------------------------------

    def check_key(self, presented: str | None) -> None:
        check_api_key(self.config.api_key, presented)

    async def prepare(self, body_bytes: int, validate: Callable[[], T]) -> T:
        """``validate()`` (parsing, rendering the chat, tokenizing: ``router.validation``) on a
        tokenizer thread, counted against the intake bounds until it is done (429 past them);
        its ``ApiError`` is counted as an invalid request."""
        ticket = self._admitted(self.intake.try_enter(body_bytes, time.monotonic()))
        loop = asyncio.get_running_loop()
        work = self._tokenizer_threads.submit(validate)
        # Leave when the thread is done, not when the handler is: a client that went away
        # cancels its wait, not a tokenization already running.
        work.add_done_callback(lambda _: loop.call_soon_threadsafe(self.intake.leave, ticket, time.monotonic()))
        try:
            return await asyncio.wrap_future(work)
        except ApiError:
            self.metrics.on_rejected("invalid_request")
            raise

    async def check_structured_output(self, prepared: PreparedRequest) -> None:
        """400 naming the field when the request's output constraint is past a bound of
        ``config.grammar``, or xgrammar cannot parse it within ``compile_timeout_s``
        (counted as an invalid request)."""
        so = prepared.params.structured_output
        if so is None:
            return
        error = await self.grammars.check(so, prepared.structured_field)
        if error is not None:
            self.metrics.on_rejected("invalid_request")
            raise ApiError(400, error, param=prepared.structured_field)

    def admit_all(self, batch: list[Choice], n: int) -> list[Ticket]:
        """A ticket for each choice of ``batch`` (``n`` a prompt), or none (429); 400 for
        a batch larger than admission ever takes at once (it would be refused forever)."""
        lengths = [len(c.prepared.prompt_token_ids) for c in batch]
        try:
            decision = self.admission.try_admit_all(lengths, time.monotonic())
        except ValueError as e:
            prompts = len(batch) // n
            raise ApiError(400, f"{prompts} prompts with n = {n} are {len(batch)} choices: {e}",
                           param="n" if n > 1 else "prompt") from None
        return self._admitted(decision)

    def admit(self, prepared: PreparedRequest) -> Ticket:
        return self._admitted(self.admission.try_admit(len(prepared.prompt_token_ids), time.monotonic()))

    def _admitted(self, decision):
        """The ticket(s) of an admission (or intake) decision; a rejection is a 429."""
        if isinstance(decision, Rejection):
            self.metrics.on_rejected(decision.code)
            raise ApiError(429, f"server busy: {decision.reason}; retry after {decision.retry_after_s}s",
                           type="rate_limit_error", code="server_busy", retry_after_s=decision.retry_after_s)
        return decision

    def release(self, ticket: Ticket) -> None:
        self.admission.release(ticket, time.monotonic())

    # -- requests by id (gRPC) -------------------------------------------------

    def in_flight(self, rid: str) -> bool:
        return rid in self.fanouts or self.dispatcher.in_flight(rid)

    def abort(self, rid: str) -> bool:
        """Abort request ``rid`` (each of its choices, when it has several); returns
        whether it was in flight here. One that is not may run on another replica: every
        worker is asked, within the replica's budget (``router.aborts``; 429 past it)."""
        fan = self.fanouts.get(rid)
        if fan is not None:
            fan.abort()
            return True
        if not self.dispatcher.in_flight(rid):
            if not rid:  # no request has an empty id: one is made for a Generate without
                return False
            if (wait := self.aborts.try_take(time.monotonic())) is not None:
                cfg = self.config.aborts
                raise ApiError(429, f"too many Aborts of requests not running on this replica (aborts.per_s="
                                    f"{cfg.per_s:g}, aborts.burst={cfg.burst}); retry after {wait}s",
                               type="rate_limit_error", code="server_busy", retry_after_s=wait)
        return self.dispatcher.abort(rid)

    async def run(
        self, prepared: PreparedRequest, rid: str, ticket: Ticket,
        after: asyncio.Event | None = None, affinity: Affinity | None = None,
    ) -> AsyncIterator:
        """The request's deltas; releases the admission ticket however it ends.

        ``after``: start once it is set (its prompt's first choice has prefilled the
        prompt); ``affinity``: the placement it shares with its prompt's other choices.
        """
        self.ensure_refreshing()
        start = last = time.monotonic()
        ttft = None
        output_tokens = 0
        reason = "abort"  # if the client leaves before the end
        try:
            if after is not None:
                await after.wait()
                start = last = time.monotonic()
            deltas = self.dispatcher.generate(
                prepared.prompt_token_ids, prepared.params, rid, affinity, priority=prepared.priority
            )
            async for delta in deltas:
                now = time.monotonic()
                if delta.token_ids:
                    if ttft is None:
                        ttft = now - start
                        self.metrics.on_first_token(ttft)
                        self.latency.first_token(ttft, now)
                    else:
                        self.metrics.on_tokens(len(delta.token_ids), now - last)
                        self.latency.tokens(len(delta.token_ids), now - last, now)
                    last = now
                    output_tokens += len(delta.token_ids)
                if delta.finished:
                    reason = delta.finish_reason or "error"
                yield delta
        finally:
            self.release(ticket)
            self.metrics.on_finished(
                reason, time.monotonic() - start, ttft, len(prepared.prompt_token_ids), output_tokens
            )
