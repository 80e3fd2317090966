"""The prefill worker (a Ray actor): chunked prefill with a prefix cache kept across requests.

A request's lifecycle here::

    prefill() ─▶ queued ─▶ chunks under the step budget ─▶ first token sampled
      ─▶ KV packed out of the blocks (blocks freed; the prefix cache keeps them)
      ─▶ payload to the decode worker ─▶ bytes pushed ─▶ ack, or lease expiry ─▶ copy dropped

The engine runs with ``hold_kv``: a finished prompt keeps its blocks only until its
KV has been copied into one contiguous K and one V tensor. That copy is what the
transfer sends and what the lease protects; the decode worker acknowledges by
answering ``receive_kv``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

from engine.sampling_params import SamplingParams
from engine.messages import PrefillLoad, PrefillResult, TransferState
from kv_transfer import TransferMeta
from workers.base import WorkerBase


class PrefillWorker(WorkerBase):
    role = "prefill"

    def __init__(self, *args, **kwargs) -> None:
        """``WorkerBase``'s arguments."""
        super().__init__(*args, **kwargs)
        self._transfer_ids = itertools.count()
        self._sending = 0

    async def load(self) -> PrefillLoad:
        return await self.runtime.call(self._load)

    def _load(self) -> PrefillLoad:
        load = self.engine.load()
        return PrefillLoad(
            worker_id=self.worker_id,
            queued_prefill_tokens=self.engine.num_queued_tokens(),
            running_chunks=load.num_running,
            waiting=load.num_waiting,
            prefix_cache_queries=load.prefix_cache_queries,
            prefix_cache_hits=load.prefix_cache_hits,
            sending=self._sending,
        )

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        decode_worker,
        reservation,
    ) -> PrefillResult:
        """Prefill the prompt, sample its first token, and push its KV to ``decode_worker``."""
        t0 = time.perf_counter()
        first_params = dataclasses.replace(params, max_tokens=1, min_tokens=0, stop=())
        paged = self.backend.paged
        final = None
        async for out in self.runtime.generate(
            prompt_token_ids, first_params, request_id, hold_kv=True, keep_blocks=paged
        ):
            final = out
        t_done = time.perf_counter()
        self._sending += 1
        try:
            num_blocks = len(final.kv_blocks) if paged else final.packed_kv[0].shape[1]
            meta = TransferMeta(
                transfer_id=f"{self.worker_id}-{next(self._transfer_ids)}",
                request_id=request_id,
                layout=self.layout,  # the receiver checks it against its own
                num_blocks=num_blocks,
                num_tokens=len(prompt_token_ids),
                dst_endpoint=reservation.endpoint,
                deadline=reservation.deadline,
            )
            state, error = await self._send(meta, decode_worker, final)
        finally:
            self._sending -= 1
            if paged:  # read in place: the blocks stay held until the receiver answered
                self.runtime.submit(self.engine.release_held, request_id)
        return PrefillResult(
            request_id=request_id,
            first_token=final.token_ids[0],
            num_cached_tokens=final.num_cached_tokens,
            state=int(state),
            queue_s=0.0,
            prefill_s=t_done - t0,
            transfer_s=time.perf_counter() - t_done,
            kv_bytes=self.layout.nbytes(num_blocks),
            error=error,
        )

    async def _send(self, meta: TransferMeta, decode_worker, final):
        lp = final.logprobs[0] if final.logprobs else None
        payload = None
        k, v = final.packed_kv or (None, None)
        try:
            if self.backend.paged:
                payload = self.backend.prepare_blocks(meta, final.kv_blocks)
            else:
                payload = self.backend.prepare(meta, k, v)
            ack = asyncio.ensure_future(
                decode_worker.receive_kv.remote(meta, payload, final.token_ids[0], lp, final.num_cached_tokens)
            )
            await self._push_until_answered(meta, k, v, payload, ack)
            state = TransferState(await asyncio.wait_for(ack, timeout=self.transfer.lease_s))
            return state, None if state == TransferState.DONE else "receiver reported failure"
        except Exception as e:  # any failure ends this transfer; the decode side recovers
            reason = getattr(e, "reason", "timeout" if isinstance(e, asyncio.TimeoutError) else type(e).__name__)
            self.backend.stats.failures[reason] += 1
            self.metrics.on_transfer_failure(reason)
            # Tell the decode side at once instead of letting it wait for the deadline.
            decode_worker.transfer_failed.remote(meta.request_id)
            return TransferState.FAILED, f"{reason}: {e}"
        finally:
            if payload is not None:
                self.backend.release(meta, payload)

    async def _push_until_answered(self, meta: TransferMeta, k, v, payload, ack: asyncio.Future) -> None:
        """Push the bytes; stop early if the receiver answers that it will not take them."""
        push = asyncio.ensure_future(self.backend.push_async(meta, k, v, payload))
        await asyncio.wait([ack, push], return_when=asyncio.FIRST_COMPLETED)
        if not push.done() and (ack.exception() is not None or ack.result() != TransferState.DONE):
            # Refused or gave up: without this the push waits for a receive that never comes.
            self.backend.abandon(meta, payload)
        try:
            await push
        except Exception:
            if not ack.done():
                raise
            # The receiver's answer says what happened; the push's own error adds nothing.

