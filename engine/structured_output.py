"""Structured output: grammars compiled with xgrammar, one matcher per constrained request.

What it owns: the engine's grammar compiler (made once, on first use, from the
tokenizer, with the logits' width as the vocabulary size: a checkpoint may pad its
embedding past the tokenizer's ids, and those ids must be masked too), the compiled
grammars (cached by ``(kind, spec)``), and each constrained request's matcher.

A constrained request's lifecycle here::

    add ─▶ queued ─▶ compiling (the compile thread; a cached grammar is ready at once) ─▶ ready
      │       │            └─ past compile_timeout_s (``expire``) ─▶ failed: the request ends with an error
      │       └─ every request for it removed (aborted) ─▶ cancelled: it never compiles
      ─▶ matcher made ─▶ each step it samples: sync, then its row of the token bitmask
      ─▶ terminated (a stop token accepted once the grammar is complete) ─▶ dropped

The engine keeps a request out of the scheduler until its grammar is ready, so the
step loop never waits for a parse or a compile (``LLMEngine`` checks only the spec's
bounds, ``engine.grammar.precheck``, on the step thread). A matcher follows its request's
output by count (``accepted``): ``sync`` accepts the output tokens it has not seen yet,
whoever produced them (this engine's sampler, the prefill worker that sampled the first
token, the worker a stream migrated from). A recompute preemption keeps the output, so no
token is ever accepted twice.

Compiles run one at a time on a compile thread. A thread cannot be stopped, and xgrammar
has no time limit of its own, so a compile that runs past ``GrammarLimits.compile_timeout_s``
is given up on: ``expire`` (the engine calls it each step) fails it, and its requests end
with an error naming the limit (the failure is cached like a grammar: the same spec fails
at once); a fresh thread takes the compiles queued behind it, and the old one finishes in
the background, its result dropped. At most ``MAX_ABANDONED`` given-up compiles run at a
time: past that the queue waits for the thread it has. An abort ends a compile only before
it starts.

Parsing specs into grammars (and the router's validation) is ``engine.grammar``.
xgrammar is imported on first use: it loads transformers, seconds an engine that
never sees a constrained request need not spend.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.grammar import (
    MAX_CACHED_GRAMMARS,
    GrammarLimits,
    message,
    parse_grammar,
    reason,
    too_slow,
    xgrammar_package,
)
from engine.wire.sampling_params import StructuredOutput

if TYPE_CHECKING:
    import xgrammar as xgr

    from engine.core.request import Request
    from engine.remote_kv import Arrival

    Held = Request | Arrival  # what the pen holds: a new request, or a decode worker's arrival

log = logging.getLogger(__name__)

# Compiles given up on (past their limit) that may still run on threads of their own: each
# holds a core until xgrammar is done with it, so past this many the queue waits instead.
MAX_ABANDONED = 2


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the tokenizer, ``vocab_size`` wide (the logits' width)."""
    import xgrammar as xgr

    backend = tokenizer.backend()
    vocab = backend.get_vocab(with_added_tokens=True)
    encoded = [""] * max(vocab_size, max(vocab.values()) + 1)
    for token, i in vocab.items():
        encoded[i] = token
    # What from_huggingface does, without needing a transformers tokenizer object.
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(
        encoded[:vocab_size],
        vocab_type=metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=list(stop_token_ids) or None,
        add_prefix_space=metadata["add_prefix_space"],
    )


@dataclass(eq=False)
class _Compile:
    """One spec's compile: its grammar to come (``future``), and when the compile thread
    began it (None while queued)."""

    so: StructuredOutput
    future: Future = field(default_factory=Future)
    started: float | None = None
    abandoned: bool = False  # past its limit, left to finish on a thread of its own


@dataclass
class _Constrained:
    """One request's compile, and its matcher once the grammar is compiled."""

    compile: _Compile
    matcher: xgr.GrammarMatcher | None = None
    accepted: int = 0  # output tokens the matcher has seen
    terminated: bool = False


class StructuredOutputs:
    """Compiled grammars and the matchers of one engine's constrained requests.

    Compiles run on one background thread at a time (see the module docstring for the
    limit on each); ``on_ready`` (set by whoever drives the engine) is called when a
    grammar is ready or failed, to wake a sleeping step loop. ``clock``: what ``expire``'s
    ``now`` is read on (``time.monotonic``).
    """

    def __init__(
        self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
        limits: GrammarLimits | None = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = tuple(stop_token_ids)
        self.limits = limits or GrammarLimits()
        self._clock = clock
        self._compiler: xgr.GrammarCompiler | None = None  # made on the compile thread
        self._lock = threading.Lock()  # below: read on the step thread, changed on the compile thread too
        self._pool = self._new_pool()
        self._cache: OrderedDict[tuple[str, str], _Compile] = OrderedDict()
        self._queued: list[_Compile] = []  # handed to the pool, not begun
        self._running: _Compile | None = None  # on the pool's thread, not given up on
        self._abandoned = 0  # given-up compiles still running
        self._requests: dict[str, _Constrained] = {}
        self._bitmask: torch.Tensor | None = None
        self.on_ready: Callable[[], None] | None = None
        self.num_compiles = 0
        self.compile_s = 0.0

    # -- compiling -------------------------------------------------------------

    @staticmethod
    def _new_pool() -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")

    def cached(self, so: StructuredOutput) -> bool:
        """A compile of ``so`` is cached here (ready, failed or under way)."""
        return (so.kind, so.spec) in self._cache

    def compiled(self, so: StructuredOutput) -> Future:
        """The compiled grammar for ``so`` (a future; done at once when cached)."""
        return self._compile_of(so).future

    def _compile_of(self, so: StructuredOutput) -> _Compile:
        key = (so.kind, so.spec)
        with self._lock:
            c = self._cache.get(key)
            if c is not None:
                self._cache.move_to_end(key)
                return c
            c = self._cache[key] = _Compile(so)
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            self._queued.append(c)
            self._pool.submit(self._run, c)
        c.future.add_done_callback(self._notify)
        return c

    def _run(self, c: _Compile) -> None:
        """On the compile thread: compile ``c`` unless it was cancelled or given up on."""
        with self._lock:
            if c in self._queued:
                self._queued.remove(c)
            if c.future.done() or not c.future.set_running_or_notify_cancel():
                return
        self._ensure_compiler()  # reading the vocabulary is not the spec's time
        with self._lock:
            c.started, self._running = self._clock(), c
        try:
            result, error = self._compile(c.so), None
        except Exception as e:  # the spec's fault: its requests end with it, worded as the router's 400
            result, error = None, ValueError(message(c.so, None, reason(e)))
        with self._lock:
            if c.abandoned:
                self._abandoned -= 1
            elif self._running is c:
                self._running = None
            if c.future.done():  # given up on: its requests already ended
                return
            if error is None:
                c.future.set_result(result)
            else:
                c.future.set_exception(error)

    def _ensure_compiler(self) -> None:
        if self._compiler is None:
            xgr = xgrammar_package()  # the first use: later ones import it plainly
            info = tokenizer_info(self._tokenizer, self.vocab_size, self._stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)

    def _compile(self, so: StructuredOutput) -> xgr.CompiledGrammar:
        t0 = time.perf_counter()
        assert self._compiler is not None
        compiled = self._compiler.compile_grammar(parse_grammar(so))
        self.num_compiles += 1
        self.compile_s += time.perf_counter() - t0
        return compiled

    def _notify(self, _: Future) -> None:
        if self.on_ready is not None:
            self.on_ready()

    def overdue(self, now: float) -> bool:
        """The compile running now is past ``compile_timeout_s`` (``expire`` ends it)."""
        c = self._running
        return c is not None and c.started is not None and now - c.started > self.limits.compile_timeout_s

    def expire(self, now: float) -> None:
        """Give up on the compile running past ``compile_timeout_s``: its requests fail
        with an error naming the limit, and (below ``MAX_ABANDONED`` given up already) a
        fresh thread takes the compiles queued behind it."""
        if not self.overdue(now):  # every step asks: no lock unless a compile is overdue
            return
        with self._lock:
            if not self.overdue(now):
                return
            c, self._running = self._running, None
            assert c is not None
            c.future.set_exception(ValueError(message(c.so, None, too_slow("compiling", self.limits))))
            log.warning("gave up compiling a %s spec after %.1f s (compile_timeout_s)", c.so.kind, now - c.started)
            if self._abandoned >= MAX_ABANDONED:
                return  # the thread is kept: the queue waits for it
            c.abandoned, self._abandoned = True, self._abandoned + 1
            old, self._pool = self._pool, self._new_pool()
            old.shutdown(wait=False, cancel_futures=True)  # its thread leaves once the compile returns
            for queued in self._queued:
                self._pool.submit(self._run, queued)

    def warm_up(self) -> None:
        """Build the compiler now (it reads the whole vocabulary), not on the first request."""
        self.compiled(StructuredOutput("json_object")).result()

    # -- requests --------------------------------------------------------------

    def add(self, request_id: str, so: StructuredOutput) -> None:
        self._requests[request_id] = _Constrained(self._compile_of(so))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def is_ready(self, request_id: str) -> bool:
        """The grammar is compiled (or failed to: ``error`` says)."""
        return self._requests[request_id].compile.future.done()

    def wait_any(self, timeout_s: float) -> None:
        """Block until some request's grammar is ready (or ``timeout_s`` passed)."""
        pending = [c.compile.future for c in self._requests.values() if not c.compile.future.done()]
        if pending:
            wait(pending, timeout_s, return_when=FIRST_COMPLETED)

    def error(self, request_id: str) -> BaseException | None:
        return self._requests[request_id].compile.future.exception()

    def remove(self, request_id: str) -> None:
        """Drop a request; a compile no other request waits for is cancelled if not begun."""
        gone = self._requests.pop(request_id, None)
        if gone is None or any(r.compile is gone.compile for r in self._requests.values()):
            return
        c = gone.compile
        with self._lock:
            if c.started is None and c.future.cancel():
                self._queued.remove(c)
                if self._cache.get((c.so.kind, c.so.spec)) is c:
                    del self._cache[(c.so.kind, c.so.spec)]

    def sync(self, request_id: str, output_token_ids: Sequence[int]) -> bool:
        """Accept the output tokens the matcher has not seen; True once it terminated.

        Waits for the grammar if it is still compiling (only a request that reached the
        batch by a path the engine does not hold back, such as a failed transfer's
        local recompute, can get here that early).
        """
        c = self._requests[request_id]
        if c.matcher is None:
            import xgrammar as xgr

            c.matcher = xgr.GrammarMatcher(c.compile.future.result())
        while c.accepted < len(output_token_ids) and not c.terminated:
            token = output_token_ids[c.accepted]
            c.accepted += 1
            if not c.matcher.accept_token(token):
                # Only a token the mask did not allow (from a worker without the
                # constraint): the output can no longer match, so it ends here.
                log.warning("request %s: token %d does not match its grammar; ending it", request_id, token)
                c.terminated = True
        c.terminated = c.terminated or c.matcher.is_terminated()
        return c.terminated

    def bitmask(
        self, request_ids: Sequence[str], outputs: Sequence[Sequence[int]],
    ) -> tuple[torch.Tensor, list[int]] | None:
        """The token bitmask of a step's sampled rows and the rows it constrains (None:
        no row is constrained). Each constrained matcher is synced first."""
        rows = [i for i, rid in enumerate(request_ids) if rid in self._requests]
        if not rows:
            return None
        n = len(request_ids)
        if self._bitmask is None or self._bitmask.shape[0] < n:
            import xgrammar as xgr

            self._bitmask = xgr.allocate_token_bitmask(max(n, 64), self.vocab_size)
        bitmask = self._bitmask[:n]
        for i in rows:
            rid = request_ids[i]
            self.sync(rid, outputs[i])
            self._requests[rid].matcher.fill_next_token_bitmask(bitmask, i)
        return bitmask, rows


class GrammarPen:
    """Where requests wait out their grammar's compile, off the scheduler: a new request
    (held as its ``Request``) and a decode worker's request whose KV has landed (held as
    its ``Arrival``: it joins the batch with the first token, which the grammar must see
    first). One pen for both, so one place decides what is held and when it goes::

        held ─▶ its grammar ready ─▶ taken (``take_ready``): admitted, or ended with its error
          └─ aborted, its KV failed, or ended otherwise ─▶ dropped (``pop``)
    """

    def __init__(self, structured: StructuredOutputs) -> None:
        self.structured = structured
        self._held: dict[str, Held] = {}

    def must_wait(self, request_id: str) -> bool:
        """The request is constrained and its grammar is compiling, or failed (an error
        is handed out by ``take_ready``, in step order, not where the request came in)."""
        s = self.structured
        return request_id in s and (not s.is_ready(request_id) or s.error(request_id) is not None)

    def hold(self, request_id: str, item: Held) -> None:
        """Keep ``item`` (the ``Request``, or the ``Arrival``) until the grammar is ready."""
        self._held[request_id] = item

    def pop(self, request_id: str) -> Held | None:
        """Drop what is held for the request (it ended otherwise); None when nothing is."""
        return self._held.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def __bool__(self) -> bool:
        return bool(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def held(self, kind: type) -> list[str]:
        """The ids of the held requests whose item is a ``kind`` (new ones: ``Request``)."""
        return [rid for rid, item in self._held.items() if isinstance(item, kind)]

    def has_ready(self) -> bool:
        """Some held request's grammar is ready (compiled or failed)."""
        return any(self.structured.is_ready(rid) for rid in self._held)

    def take_ready(self) -> list[tuple[str, Held, BaseException | None]]:
        """The held requests whose grammar is ready, taken out of the pen in the order they
        came in: each id, what was held, and the compile's error (None: it compiled)."""
        s = self.structured
        ready = [rid for rid in self._held if s.is_ready(rid)]
        return [(rid, self._held.pop(rid), s.error(rid)) for rid in ready]
