"""The decode worker (a Ray actor): continuous batching over KV computed elsewhere.

A disaggregated request's lifecycle here::

    reserve ──▶ WAITING_FOR_REMOTE_KV ──receive_kv ok──▶ RUNNING ──▶ finished
                        │
                        ├─ transfer failed / deadline passed, policy recompute ─▶ WAITING (local prefill)
                        └─ policy fail ─▶ finished with an error

``generate(request_id)`` streams the request's token deltas (Ray streaming
generator); it may be called before or after the KV arrives. ``generate`` with a
prompt runs the whole request here: the colocated mode, without any transfer.
Blocks are freed when a request finishes, is aborted, or its stream is dropped.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.llm_engine import RequestOutput
from engine.sampling_params import SamplingParams
from kv_transfer import KVLayout, TransferError, TransferMeta, TransferState
from kv_transfer.config import TransferConfig
from kv_transfer.worker_base import WorkerBase


@dataclass(frozen=True)
class StreamDelta:
    """What a worker sends per message: everything since the previous message."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list | None = None  # [(token, logprob, [(id, logprob), ...])] for the new tokens
    error: str | None = None

    @classmethod
    def from_output(cls, out: RequestOutput, num_logprobs_sent: int = 0) -> "StreamDelta":
        lps = None
        if out.logprobs is not None:
            lps = [(lp.token_id, lp.logprob, list(lp.top)) for lp in out.logprobs[num_logprobs_sent:]]
        return cls(
            request_id=out.request_id,
            token_ids=out.new_token_ids,
            text=out.new_text,
            finished=out.finished,
            finish_reason=out.finish_reason,
            num_prompt_tokens=out.num_prompt_tokens,
            num_output_tokens=len(out.token_ids),
            num_cached_tokens=out.num_cached_tokens,
            logprobs=lps,
            error="the KV transfer failed and kv_failure_policy is 'fail'"
            if out.finish_reason == "error"
            else None,
        )


@dataclass(frozen=True)
class DecodeLoad:
    worker_id: str
    free_blocks: int
    total_blocks: int
    running: int
    waiting: int
    waiting_for_kv: int


@dataclass(frozen=True)
class Reservation:
    request_id: str
    block_ids: list[int]
    layout: KVLayout
    dst_rank: int
    deadline: float


class DecodeWorker(WorkerBase):
    role = "decode"

    def __init__(
        self,
        worker_id: str,
        engine_config: EngineConfig,
        transfer: TransferConfig,
        torch_threads: int = 1,
        stream_interval_s: float = 0.0,
    ) -> None:
        super().__init__(worker_id, engine_config, transfer, torch_threads)
        self.stream_interval_s = stream_interval_s
        self.runtime.add_periodic(self._expire_reservations)
        self._deadlines: dict[str, float] = {}
        self.num_transfer_failures = 0

    # -- health and load -------------------------------------------------------

    async def ready(self) -> dict:
        return {**await super().ready(), "layout": self.layout}

    async def load(self) -> DecodeLoad:
        return await self.runtime.call(self._load)

    def _load(self) -> DecodeLoad:
        s = self.engine.scheduler
        pool = self.engine.kv_manager.pool
        return DecodeLoad(
            worker_id=self.worker_id,
            free_blocks=pool.num_free_blocks,
            total_blocks=pool.num_usable_blocks,
            running=len(s.running),
            waiting=s.num_waiting + len(s.swapped),
            waiting_for_kv=len(s.remote),
        )

    async def stats(self) -> dict:
        return {**await super().stats(), "transfer_failures": self.num_transfer_failures}

    # -- disaggregated requests ------------------------------------------------

    async def reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Reservation | None:
        """Reserve blocks for the prompt's KV; None when this worker has no room now."""
        self.runtime.open_stream(request_id)
        return await self.runtime.call(self._reserve, request_id, prompt_token_ids, params)

    def _reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Reservation | None:
        blocks = self.engine.add_remote_request(prompt_token_ids, params, request_id=request_id)
        if blocks is None:
            self.runtime.abort_now(request_id)
            return None
        deadline = time.time() + self.transfer.timeout_s
        self._deadlines[request_id] = deadline
        return Reservation(request_id, blocks, self.layout, self.backend.rank, deadline)

    async def receive_kv(
        self, meta: TransferMeta, payload, first_token: int, first_logprobs=None, num_cached_tokens: int = 0
    ) -> int:
        """Pull the prompt's KV into the reserved blocks; returns the TransferState.

        ``num_cached_tokens``: the prompt tokens the prefill worker found in its prefix
        cache, reported in the request's usage.
        """
        rid = meta.request_id
        try:
            if meta.layout != self.layout:
                raise TransferError("layout", f"KV layout {meta.layout} does not match {self.layout}")
            t0 = time.perf_counter()
            k, v = await self.backend.pull_async(meta, payload)
            self.metrics.on_transfer(time.perf_counter() - t0, k.nbytes + v.nbytes)
        except Exception as e:  # any failure ends this transfer; the policy decides what follows
            reason = getattr(e, "reason", "timeout" if isinstance(e, asyncio.TimeoutError) else type(e).__name__)
            self.backend.stats.failures[reason] += 1
            self.metrics.on_transfer_failure(reason)
            await self.runtime.call(self._transfer_failed, rid)
            return int(TransferState.FAILED)
        await self.runtime.call(self._kv_arrived, rid, first_token, k, v, first_logprobs, num_cached_tokens)
        self.backend.recycle(k, v)
        return int(TransferState.DONE)

    def _kv_arrived(self, rid: str, first_token: int, k, v, first_logprobs, num_cached_tokens: int) -> None:
        self._deadlines.pop(rid, None)
        out = self.engine.remote_kv_arrived(rid, first_token, k, v, first_logprobs, num_cached_tokens)
        if out is not None:
            self.runtime.deliver(out)

    async def transfer_failed(self, request_id: str) -> None:
        """The KV will not come (the sender or the router says so)."""
        await self.runtime.call(self._transfer_failed, request_id)

    def _transfer_failed(self, request_id: str) -> None:
        """On the step thread: recompute the prompt here, or fail the request."""
        self._deadlines.pop(request_id, None)
        if request_id not in self.engine.scheduler.remote:
            return
        self.num_transfer_failures += 1
        out = self.engine.remote_kv_failed(request_id, self.transfer.failure_policy == "recompute")
        if out is not None:
            self.runtime.deliver(out)

    def _expire_reservations(self, now: float) -> None:
        expired = [rid for rid, d in self._deadlines.items() if d < now]
        for rid in expired:
            self.backend.stats.failures["timeout"] += 1
            self.metrics.on_transfer_failure("timeout")
            self._transfer_failed(rid)

    # -- streaming -------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
    ):
        """Stream deltas of a reserved request, or (with a prompt) run it here in full."""
        if prompt_token_ids is None:
            stream = self.runtime.open_stream(request_id)
            outputs = self.runtime.follow(request_id, stream)
        else:
            outputs = self.runtime.generate(prompt_token_ids, params, request_id)
        sent_lps = 0
        async for out in outputs:
            delta = StreamDelta.from_output(out, sent_lps)
            sent_lps += len(delta.logprobs or ())
            yield delta
            if self.stream_interval_s and not out.finished:
                # Tokens of the steps meanwhile merge in the stream into the next message.
                await asyncio.sleep(self.stream_interval_s)

    async def abort(self, request_id: str) -> None:
        self.runtime.submit(self._deadlines.pop, request_id, None)  # on the step thread, like the rest
        await super().abort(request_id)


class ColocatedWorker(DecodeWorker):
    """Both phases in one worker, no transfer: ``generate`` with a prompt."""

    role = "colocated"
