"""Remote-KV intake (decode role): the engine's side of a prompt whose KV another worker
computes.

What it owns: reserving a request's blocks in the scheduler (the request waits in
``WAITING_FOR_REMOTE_KV``, outside the token budget), pinning them while a transfer
may write into them, landing a packed copy of the KV into them (a paged transfer writes
in place and lands nothing), committing the request into the batch with the first token
the prefill worker sampled, or failing it (recompute here, or an error). An arrival whose
grammar is still compiling waits in the engine's ``GrammarPen`` (the one new requests
wait in): the grammar must see the first token before the request joins the batch.

A request's lifecycle here::

    reserve ──▶ waiting (blocks reserved; the worker pins them for the transfer)
      ├─ arrive ─▶ [grammar compiling: held back] ─▶ committed: RUNNING, first token out
      │                      └─ grammar failed (or past its time limit) ─▶ FINISHED_ERROR
      ├─ fail, recompute ─▶ WAITING (a local prefill; FINISHED_ERROR if its grammar failed)
      ├─ fail ─▶ FINISHED_ERROR
      └─ abort (the scheduler's ``finish_requests``) ─▶ forgotten

The transfer itself, its records and deadlines are ``kv_transfer``'s (``handoff.py``);
the decode worker calls this through ``LLMEngine`` on its step thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.block_pool import KVBlock, KVCacheManager
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.model.kv_cache import KVCache
from engine.model.sampler import TokenLogprobs
from engine.structured_output import GrammarPen


@dataclass(frozen=True)
class Arrival:
    """What comes with a prompt's KV: the first token the prefill worker sampled, its logprobs
    and the prompt tokens the prefill worker's prefix cache served (for the usage)."""

    first_token: int
    first_logprobs: TokenLogprobs | None = None
    num_cached_tokens: int = 0


class RemoteKVIntake:
    """Requests whose prompt KV arrives from another worker (the lifecycle is in the module
    docstring). ``LLMEngine`` makes one over its scheduler, KV cache manager, KV cache and grammar
    matchers, and makes it anew when it resets."""

    def __init__(
        self, scheduler: Scheduler, kv_manager: KVCacheManager, kv_cache: KVCache, pen: GrammarPen
    ) -> None:
        self.scheduler = scheduler
        self.kv_manager = kv_manager
        self.kv_cache = kv_cache
        self.pen = pen  # the engine's: an arrival whose grammar still compiles waits there

    def reserve(self, request: Request) -> tuple[list[int], int] | None:
        """Reserve blocks for the request's prompt (and a migrated stream's output); returns
        their ids in token order and how many leading ones need not be sent (held by this
        engine's prefix cache, or behind every layer's window), or None when the pool has
        no room now (nothing is kept)."""
        return self.scheduler.add_remote(request)

    def is_waiting(self, request_id: str) -> bool:
        """The request holds reserved blocks and its KV has not arrived."""
        return request_id in self.scheduler.remote

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.remote)

    def pin(self, request_id: str) -> list[KVBlock]:
        """One more reference to each of the request's blocks, until ``unpin``."""
        return self.kv_manager.pin(request_id)

    def unpin(self, pinned: list[KVBlock]) -> None:
        self.kv_manager.unpin(pinned)

    def land(self, request_id: str, k: torch.Tensor | None, v: torch.Tensor | None) -> bool:
        """Write a packed copy of the prompt's KV into the reserved blocks (``k``/``v``:
        [layers, blocks, block, Hkv, D], from the first block sent, or all of them; None:
        the transfer wrote them in place). False when the request does not wait for KV
        here (unknown, aborted, already arrived)."""
        request = self.scheduler.remote.get(request_id)
        if request is None:
            return False
        if k is not None and v is not None:
            ids = self.kv_manager.block_ids(request_id)
            unsent = request.num_unsent_blocks
            if k.shape[1] == len(ids):
                k, v = k[:, unsent:], v[:, unsent:]
            elif k.shape[1] != len(ids) - unsent:
                raise ValueError(
                    f"request {request_id!r}: {k.shape[1]} blocks of KV for {len(ids) - unsent} reserved "
                    f"(of {len(ids)}, {unsent} not sent)"
                )
            self.kv_cache.scatter(ids[unsent:], k, v)
        return True

    def commit(self, request_id: str, arrival: Arrival) -> Request | None:
        """The request's KV has landed: it joins the batch with ``arrival``'s first token (and
        may finish at once: a stop token, ``max_tokens`` of 1). None when it does not wait
        here, or when its grammar is still compiling or failed: the arrival waits in the
        engine's ``GrammarPen``, which commits it here once ready, or ends it with an error."""
        if request_id not in self.scheduler.remote:
            return None
        if self.pen.must_wait(request_id):
            self.pen.hold(request_id, arrival)
            return None
        request = self.scheduler.remote_arrived(request_id, arrival.first_token)
        if request is not None:
            request.num_cached_tokens = arrival.num_cached_tokens
        return request

    def fail(self, request_id: str, recompute: bool) -> Request | None:
        """The KV will not come: queue the request to prefill here (``recompute``) or finish
        it with an error (also when its grammar failed: nothing could be sampled). None when it
        does not wait here."""
        self.pen.pop(request_id)
        structured = self.pen.structured
        if request_id in structured and structured.is_ready(request_id) and structured.error(request_id):
            recompute = False
        return self.scheduler.remote_failed(request_id, recompute)

    def forget(self, request_id: str) -> None:
        """The request ended (aborted, finished): drop an arrival held for it."""
        self.pen.pop(request_id)
