"""Checks structured-output specs with xgrammar, outside the router process.

xgrammar imports torch, which the router process never loads, so the parse runs in a
helper process (one, spawned on the first constrained request; it imports xgrammar
once; the first constrained request waits for that) and its verdicts are cached here
by (kind, spec): a spec is sent at most once while it stays in the cache. A helper
that died is replaced on the next check; a helper whose router died exits.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from engine.grammar import MAX_CACHED_GRAMMARS, message, problem
from engine.sampling_params import StructuredOutput


def _exit_with_parent(parent: int) -> None:
    """In the helper: leave when the router process is gone (Ray may kill it outright)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


class GrammarChecker:
    """Parses structured-output specs in a helper process spawned on the first check, and caches
    the verdicts. ``RouterCore`` keeps one for its life; ``close`` stops the helper."""

    def __init__(self, max_cached: int = MAX_CACHED_GRAMMARS) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._verdicts: OrderedDict[tuple[str, str], str | None] = OrderedDict()
        self._max_cached = max_cached

    async def check(self, so: StructuredOutput, field: str | None) -> str | None:
        """None when xgrammar parses the spec, else the error message (naming ``field``)."""
        key = (so.kind, so.spec)
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            why = self._verdicts[key]
        else:
            why = await self._ask(so)
            self._verdicts[key] = why
            while len(self._verdicts) > self._max_cached:
                self._verdicts.popitem(last=False)
        return None if why is None else message(so, field, why)

    async def _ask(self, so: StructuredOutput) -> str | None:
        loop = asyncio.get_running_loop()
        for attempt in range(2):
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    1, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_exit_with_parent, initargs=(os.getpid(),),
                )
            try:
                return await loop.run_in_executor(self._pool, problem, so.kind, so.spec)
            except BrokenProcessPool:
                self._pool = None  # the helper died: a new one on the next try
                if attempt:
                    raise
        return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
