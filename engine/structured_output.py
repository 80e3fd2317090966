"""Structured output: grammars compiled with xgrammar, one matcher per constrained request.

What it owns: the engine's grammar compiler (made once, on first use, from the
tokenizer, with the logits' width as the vocabulary size: a checkpoint may pad its
embedding past the tokenizer's ids, and those ids must be masked too), the compiled
grammars (cached by ``(kind, spec)``), and each constrained request's matcher.

A constrained request's lifecycle here::

    add ─▶ compiling (the compile thread; a cached grammar is ready at once) ─▶ ready
      ─▶ matcher made ─▶ each step it samples: sync, then its row of the token bitmask
      ─▶ terminated (a stop token accepted once the grammar is complete) ─▶ dropped

The engine keeps a request out of the scheduler until its grammar is ready, so the
step loop never waits for a compile. A matcher follows its request's output by count
(``accepted``): ``sync`` accepts the output tokens it has not seen yet, whoever
produced them (this engine's sampler, the prefill worker that sampled the first token,
the worker a stream migrated from). A recompute preemption keeps the output, so no
token is ever accepted twice.

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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.grammar import MAX_CACHED_GRAMMARS, parse_grammar, xgrammar_package
from engine.sampling_params import StructuredOutput

if TYPE_CHECKING:
    import xgrammar as xgr

log = logging.getLogger(__name__)

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


@dataclass
class _Constrained:
    """One request's matcher, once its grammar is compiled."""

    grammar: Future
    matcher: xgr.GrammarMatcher | None = None
    accepted: int = 0  # output tokens the matcher has seen
    terminated: bool = False


class StructuredOutputs:
    """Compiled grammars and the matchers of one engine's constrained requests.

    Compiles run on one background thread; ``on_ready`` (set by whoever drives the
    engine) is called from it when a grammar is ready, to wake a sleeping step loop.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = tuple(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None  # made on the compile thread
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()  # the cache: read on the step thread, filled here
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._requests: dict[str, _Constrained] = {}
        self._bitmask: torch.Tensor | None = None
        self.on_ready: Callable[[], None] | None = None
        self.num_compiles = 0
        self.compile_s = 0.0

    # -- compiling -------------------------------------------------------------

    def compiled(self, so: StructuredOutput) -> Future:
        """The compiled grammar for ``so`` (a future; done at once when cached)."""
        key = (so.kind, so.spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, so)
            self._cache[key] = future
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        future.add_done_callback(self._notify)
        return future

    def _compile(self, so: StructuredOutput) -> xgr.CompiledGrammar:
        xgr = xgrammar_package()  # the first use: later ones import it plainly
        t0 = time.perf_counter()
        if self._compiler is None:
            info = tokenizer_info(self._tokenizer, self.vocab_size, self._stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        compiled = self._compiler.compile_grammar(parse_grammar(so))
        self.num_compiles += 1
        self.compile_s += time.perf_counter() - t0
        return compiled

    def _notify(self, _: Future) -> None:
        if self.on_ready is not None:
            self.on_ready()

    def warm_up(self) -> None:
        """Build the compiler now (it reads the whole vocabulary), not on the first request."""
        self.compiled(StructuredOutput("json_object")).result()

    # -- requests --------------------------------------------------------------

    def add(self, request_id: str, so: StructuredOutput) -> None:
        self._requests[request_id] = _Constrained(self.compiled(so))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def is_ready(self, request_id: str) -> bool:
        """The grammar is compiled (or failed to: ``error`` says)."""
        return self._requests[request_id].grammar.done()

    def wait_any(self, timeout_s: float) -> None:
        """Block until some request's grammar is ready (or ``timeout_s`` passed)."""
        pending = [c.grammar for c in self._requests.values() if not c.grammar.done()]
        if pending:
            wait(pending, timeout_s, return_when=FIRST_COMPLETED)

    def error(self, request_id: str) -> BaseException | None:
        return self._requests[request_id].grammar.exception()

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def sync(self, request_id: str, output_token_ids: Sequence[int]) -> bool:
        """Accept the output tokens the matcher has not seen; True once it terminated.

        Waits for the grammar if it is still compiling (only a request that reached the
        batch by a path the engine does not hold back, such as a failed transfer's
        local recompute, can get here that early).
        """
        c = self._requests[request_id]
        if c.matcher is None:
            import xgrammar as xgr

            c.matcher = xgr.GrammarMatcher(c.grammar.result())
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
