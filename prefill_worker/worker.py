"""The prefill worker (a Ray actor): chunked prefill with a prefix cache kept across requests.

A request's lifecycle here::

    prefill() ─▶ queued ─▶ chunks under the step budget ─▶ first token sampled
      ─▶ offer to the decode worker ─▶ it reads the KV ─▶ its answer, or lease expiry
      ─▶ blocks released; the prefix cache keeps full blocks
    ``abort`` at any point (the router knows the decode worker died, or the client went
    away): the prefill stops, the send stops waiting for an answer, and the blocks are
    released at once, not when the lease runs out
    ``retire`` (the worker leaves its role): no read is asked any more; the reads asked
    are answered first (or their lease runs out), then every prefill is aborted, its
    reader told that the KV will not come, and the blocks released: no block a decode
    worker may still read is freed, or reset onto another prompt, under its read

The KV moves straight out of this worker's blocks, which the engine holds (``hold_kv``)
until the decode worker has answered: NIXL's reader pulls them, gloo's push sends them
(a backend without a send does nothing on ``push``), and a packed backend sends a copy
gathered when they are offered (``kv_transfer.packed``). With ``pipeline`` on, the
blocks of every finished chunk are offered at once (``receive_kv_part``, pinned until
read), so that the decode worker reads them while later chunks compute and only the
last chunk's blocks wait for the first token. Each attempt has one hand-off record
(``kv_transfer.handoff.Sender``, which owns and locks it): a second prefill of it is
refused, one past the reservation's deadline is dropped, and its transitions say which
computed blocks are new (``offer_parts``) and whether a read may still be asked. The parts
of a send that hold no worker state (the parts' queue, a stretch of the reservation, the
waits for the receiver's answer and the push, the reasons a send ends early) are
``prefill_worker.kv_send``'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from engine.wire.clients import DecodeClient
from engine.wire.messages import PrefillLoad, PrefillResult, Reservation, TransferState, request_of
from engine.wire.sampling_params import SamplingParams
from kv_transfer import TransferMeta
from kv_transfer.handoff import OfferState, Sender
from kv_transfer.worker import WorkerBase
from prefill_worker.kv_send import (
    ABORTED,
    RETIRED,
    Aborted,
    NotAsked,
    Parts,
    aborted,
    answer_within,
    failed_result,
    kv_blocks,
    push_until_answered,
    stretch,
    wake,
)

if TYPE_CHECKING:

    from engine.output_processor import RequestOutput


class PrefillWorker(WorkerBase):
    """The prefill role's Ray actor (a request's lifecycle is in the module docstring): prefills
    prompts in chunks, samples each first token and hands the KV to the decode worker the router
    names. The cluster starts one per prefill slot and replaces it if it dies."""

    role = "prefill"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``WorkerBase``'s arguments."""
        super().__init__(*args, **kwargs)
        self._transfer_ids = itertools.count()
        self._sending = 0
        self.offers: Sender[Parts] = Sender()  # one hand-off record per attempt being prefilled or sent
        self._reads: set[asyncio.Future[int]] = set()  # receivers' answers awaited: reads that may touch blocks
        self._prefills: set[asyncio.Task[Any]] = set()  # the ``prefill`` calls running
        self.async_engine.add_periodic(self._tend_offers)

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
        *,
        decode_worker: Any,
        reservation: Reservation,
        resume_output: Sequence[int] = (),
        priority: int = 0,
    ) -> PrefillResult:
        """Prefill the prompt, sample its first token, and push its KV to ``decode_worker``.

        With ``pipeline`` on, the blocks of each finished chunk are offered while the next
        chunks compute (``receive_kv_part``); the rest go with the first token.
        ``resume_output``: a migrated stream's tokens so far. They are prefilled with the
        prompt (the prompt's blocks usually come from the prefix cache), and the token
        sampled is the one after them, at its place in the seeded random stream.
        ``priority``: the request's place in the scheduler's order (lower goes first).
        """
        t0 = time.perf_counter()
        decode = DecodeClient(decode_worker)
        num_tokens = len(prompt_token_ids) + len(resume_output)
        meta = self._transfer_meta(request_id, reservation, num_tokens)
        held = reservation.unsent_blocks  # cached on the decode side, or behind the window: never sent
        loop = asyncio.get_running_loop()
        parts = Parts(loop, held) if self.transfer.pipeline else None
        stop: asyncio.Future[str] = loop.create_future()  # set by ``abort``: the send stops waiting
        # The receiver's deadline on this side's clock: past it, the work is dropped.
        deadline = time.monotonic() + (reservation.deadline - time.time())
        self.offers.begin(request_id, held, parts, deadline, stop)  # refuses an attempt already here
        this = asyncio.current_task()
        assert this is not None  # a coroutine runs in a task
        self._prefills.add(this)
        state = TransferState.FAILED
        try:
            if (refusal := self._refusal(num_tokens, deadline, params, reservation)) is not None:
                decode.transfer_failed(request_id)  # it recomputes (or fails) at once
                return failed_result(request_id, refusal)
            final, landed, t_done = await self._compute(
                meta, prompt_token_ids, params, resume_output, decode, parts, priority, held, stop
            )
            if (why := self._ended_early(request_id, final, stop, decode)) is not None:
                return failed_result(request_id, why)
            self.offers.computed(request_id)
            state, error = await self._hand_over(meta, decode, final, landed, stop)
        finally:
            self._end_offer(request_id, state == TransferState.DONE, decode, stop)
            self._prefills.discard(this)
        return PrefillResult(
            request_id=request_id,
            first_token=final.token_ids[-1],
            num_cached_tokens=final.num_cached_tokens,
            state=int(state),
            queue_s=0.0,
            prefill_s=t_done - t0,
            transfer_s=time.perf_counter() - t_done,
            kv_bytes=self.layout.nbytes(len(kv_blocks(final)) - held),
            error=error,
        )

    def _end_offer(self, request_id: str, done: bool, decode: DecodeClient, stop: asyncio.Future[str]) -> None:
        """The attempt's hand-off ends here: its held blocks are released (they stayed
        held until the receiver answered), and a reader still waiting for KV that will
        not come, because this worker retires, is told so."""
        if self.offers.end(request_id, OfferState.COMPLETE if done else OfferState.FAILED) is not None:
            self.async_engine.submit(self.engine.release_held, request_id)
        if not done and self.offers.retiring and not aborted(stop):
            decode.transfer_failed(request_id)

    @staticmethod
    def _ended_early(
        request_id: str, final: RequestOutput, stop: asyncio.Future[str], decode: DecodeClient,
    ) -> str | None:
        """Why a prefill that ended has nothing to hand over, if so: aborted by the router
        (the abort's call, queued after the request's add, aborted it or released the
        blocks it held), or past its deadline (the decode worker is told)."""
        if stop.done():
            return stop.result()
        if final.finish_reason == "abort":
            decode.transfer_failed(request_id)
            return "the prefill was aborted past the reservation's deadline"
        return None

    def _refusal(
        self, num_tokens: int, deadline: float, params: SamplingParams, reservation: Reservation
    ) -> str | None:
        """Why this worker will not start a prefill, if it will not."""
        try:
            adapter = self.engine.check_adapter(params.adapter)
        except ValueError as e:
            return f"this prefill worker cannot run the request: {e}"
        if adapter != reservation.adapter_key:
            # KV computed under one adapter (or the base) is wrong for any other.
            return (f"the decode worker runs the request under adapter {reservation.adapter_key!r}, "
                    f"this prefill worker under {adapter!r}")
        if not self.engine.fits(num_tokens + 1):
            # A migrated stream's prompt and output may outgrow this pool, not the decode
            # worker's: recomputed there, the text is the same.
            pool = self.engine.num_kv_blocks
            return (f"{num_tokens} tokens do not fit this prefill worker's KV cache "
                    f"({pool} blocks of {self.engine.config.block_size})")
        if time.monotonic() > deadline:
            return "the reservation's deadline passed before the prefill began"
        return None

    def _transfer_meta(self, request_id: str, reservation: Reservation, num_tokens: int) -> TransferMeta:
        """The whole transfer of one attempt; each send takes its stretch (``kv_send.stretch``)."""
        return TransferMeta(
            transfer_id=f"{self.worker_id}-{next(self._transfer_ids)}",
            request_id=request_id,
            layout=self.layout,  # the receiver checks it against its own
            num_blocks=0,  # each send says how many it carries
            num_tokens=num_tokens,
            dst_endpoint=reservation.endpoint,
            deadline=reservation.deadline,
            dst_blocks=tuple(reservation.block_ids),
            sender=self.worker_id,
        )

    async def _hand_over(
        self, meta: TransferMeta, decode: DecodeClient, final: RequestOutput, landed: int | None,
        stop: asyncio.Future[str],
    ) -> tuple[TransferState, str | None]:
        """Send what the parts did not (``landed``: None once one failed) and the first token."""
        if landed is None:  # the decode side has applied its failure policy
            return TransferState.FAILED, "a pipelined part of the transfer failed"
        self._sending += 1
        try:
            return await self._send(meta, decode, final, landed, stop)
        except Aborted:
            return TransferState.FAILED, stop.result()
        finally:
            self._sending -= 1

    async def abort(self, request_id: str) -> None:
        """Abort one attempt (the id the router placed it under). The router does when
        the attempt's decode worker died or its client went away: besides the prefill,
        the hand-off ends now, its blocks freed without waiting out the lease (no live
        reader is left to read them)."""
        ended = self._end_handoffs([request_id])
        self.async_engine.submit(self._abort_and_release, request_id, ended)

    async def abort_request(self, request_id: str) -> None:
        """Abort every attempt of the client's ``request_id`` here, hand-offs included."""
        mine = [aid for aid in self.offers.states() if request_of(aid) == request_id]
        ended = self._end_handoffs(mine)
        self.async_engine.submit(self._abort_attempts_and_release, request_id, ended)

    def _end_handoffs(self, attempt_ids: list[str]) -> list[str]:
        """On the event loop: end these attempts' hand-off records and wake their sends;
        returns those ended here, whose held blocks the caller frees (a record ends once,
        so ``prefill`` does not free them again)."""
        ended = []
        for aid in attempt_ids:
            offer = self.offers.end(aid, OfferState.FAILED)
            if offer is not None:
                wake(offer.stop, ABORTED)
                ended.append(aid)
        return ended

    async def _let_go(self) -> None:
        """As it retires (module docstring): no more reads; those asked answered (or their
        lease out); then every prefill ends, and has queued its blocks' release, before
        the step thread stops."""
        self.offers.retire()
        if self._reads:
            await asyncio.wait(set(self._reads), timeout=self.transfer.lease_s)
        for stop in self.offers.stops():
            wake(stop, RETIRED)
        await self.async_engine.call(self._abort_everything)
        if self._prefills:
            await asyncio.wait(set(self._prefills), timeout=self.transfer.op_timeout_s)

    def _abort_and_release(self, request_id: str, ended: list[str]) -> None:
        # One call on the step thread, so no step comes between: a prefill still running
        # is aborted (its blocks freed), one that finished holds its blocks no more.
        self.abort_now(request_id)
        self._release_held(ended)

    def _abort_attempts_and_release(self, request_id: str, ended: list[str]) -> None:
        self._abort_attempts_of(request_id)
        self._release_held(ended)

    def _release_held(self, attempt_ids: list[str]) -> None:
        for aid in attempt_ids:
            self.engine.release_held(aid)

    async def _compute(
        self, meta: TransferMeta, prompt: list[int], params: SamplingParams, resume_output: Sequence[int],
        decode: DecodeClient, parts: Parts | None, priority: int, held: int, stop: asyncio.Future[str],
    ) -> tuple[RequestOutput, int | None, float]:
        """Run the prefill; with ``parts``, offer finished blocks as they come. Returns the
        final output, how many leading blocks are on the decode side (the ``held`` ones,
        and those the parts landed; None: a part failed) and when the prefill itself ended."""
        first_params = dataclasses.replace(params, max_tokens=len(resume_output) + 1, min_tokens=0, stop=())
        rid = meta.request_id
        if parts is not None:
            sender = asyncio.ensure_future(self._send_parts(meta, decode, parts, stop))
        final = None
        try:
            async for out in self.async_engine.generate(
                prompt, first_params, rid, priority=priority, hold_kv=True,
                resume_output=resume_output,
            ):
                final = out
        except BaseException:
            if parts is not None:
                parts.abandoned = True  # what is still queued is unpinned, not sent
            raise
        finally:
            t_done = time.perf_counter()
            if parts is not None:
                await self.async_engine.call(self.offers.unwatch, rid)  # nothing is offered after this
                parts.queue.put_nowait(None)
        assert final is not None, "a request's stream yields at least its last output"
        return final, (await sender if parts is not None else held), t_done

    def _tend_offers(self, now: float) -> None:
        """On the step thread: drop prefills past their deadline, and hand each pipelined
        prefill's newly computed blocks, pinned until their read is answered, to its sender."""
        for aid in self.offers.expire(now):
            self.async_engine.abort_now(aid)
        synced = False
        for aid, parts in self.offers.watched():
            if (new := self.offers.offer_parts(aid, self.engine.computed_blocks(aid))) is None:
                continue
            if not synced:  # counted computed is not yet written on a GPU: the step may still run
                self.engine.wait_for_device()
                synced = True
            first, block_ids = new
            parts.put_threadsafe((first, block_ids, self.engine.pin_blocks(aid)))

    async def _send_parts(
        self, meta: TransferMeta, decode: DecodeClient, parts: Parts, stop: asyncio.Future[str]
    ) -> int | None:
        """Send each stretch of finished blocks as it is offered, in order; returns the
        blocks landed, or None once a part failed or the attempt was aborted (the rest
        are only unpinned)."""
        landed: int | None = parts.first
        while (item := await parts.queue.get()) is not None:
            first, block_ids, pins = item
            try:
                if landed is not None and not parts.abandoned and not stop.done():
                    part = dataclasses.replace(
                        stretch(meta, first, len(block_ids)), transfer_id=f"{meta.transfer_id}.{first}",
                        num_tokens=len(block_ids) * self.layout.block_size,
                    )
                    ok = await self._send_part(part, decode, block_ids, first, stop)
                    landed = first + len(block_ids) if ok else None
            finally:
                self.async_engine.submit(self.engine.unpin_blocks, pins)
        return landed

    async def _send_part(
        self, meta: TransferMeta, decode: DecodeClient, block_ids: list[int], first: int,
        stop: asyncio.Future[str],
    ) -> bool:
        """Offer one stretch of finished blocks; whether it landed. Whatever fails (the
        checksums, the payload, the send, the answer) fails the part, never the sender."""
        payload = None
        try:
            meta = await self._summed(meta, block_ids)
            payload = self.kv_ranks.offer(self.backend, meta, block_ids)
            answer = self._ask(meta.request_id, stop, partial(decode.receive_kv_part, meta, payload, first_block=first))
            await push_until_answered(self.backend, meta, payload, answer, stop)
            return await answer_within(answer, stop, self.transfer.lease_s) == TransferState.DONE
        except (Aborted, NotAsked):
            return False  # the router knows, or ``prefill`` tells the reader as the worker retires
        except Exception as e:  # the decode worker died or never answered, or the blocks could not be offered
            self._count_failure(e)
            decode.transfer_failed(meta.request_id)
            return False
        finally:
            if payload is not None:
                self.backend.release(meta, payload)

    def _ask(
        self, request_id: str, stop: asyncio.Future[str], read: Callable[[], Awaitable[int]],
    ) -> asyncio.Future[int]:
        """Ask the receiver to read (``read()`` makes the call); its answer is counted among
        the reads that may touch the blocks until it comes. ``Aborted`` once the attempt
        was aborted, ``NotAsked`` once no read may be asked (the worker retires)."""
        if stop.done():
            raise Aborted()
        if not self.offers.ask_read(request_id):
            raise NotAsked()
        answer = asyncio.ensure_future(read())
        self._reads.add(answer)
        answer.add_done_callback(self._reads.discard)
        return answer

    async def _send(
        self, meta: TransferMeta, decode: DecodeClient, final: RequestOutput, landed: int, stop: asyncio.Future[str],
    ) -> tuple[TransferState, str | None]:
        """The KV (its blocks from ``landed`` on, when parts went ahead) and the first token."""
        lp = final.logprobs[-1] if final.logprobs else None
        payload = None
        try:
            blocks = kv_blocks(final)[landed:]
            meta = stretch(meta, landed, len(blocks))
            meta = await self._summed(meta, blocks)
            payload = self.kv_ranks.offer(self.backend, meta, blocks)
            ack = self._ask(meta.request_id, stop, partial(
                decode.receive_kv, meta, payload, first_token=final.token_ids[-1], first_logprobs=lp,
                num_cached_tokens=final.num_cached_tokens, prompt_logprobs=final.prompt_logprobs,
            ))
            await push_until_answered(self.backend, meta, payload, ack, stop)
            state = await answer_within(ack, stop, self.transfer.lease_s)
            return state, None if state == TransferState.DONE else "receiver reported failure"
        except Aborted:
            raise
        except NotAsked:
            return TransferState.FAILED, RETIRED
        except Exception as e:  # any failure ends this transfer; the decode side recovers
            reason = self._count_failure(e)
            # Tell the decode side at once instead of letting it wait for the deadline.
            decode.transfer_failed(meta.request_id)
            return TransferState.FAILED, f"{reason}: {e}"
        finally:
            if payload is not None:
                self.backend.release(meta, payload)

    async def _summed(self, meta: TransferMeta, block_ids: list[int]) -> TransferMeta:
        """``meta`` with its blocks' checksums, when the setting asks for them (summed off
        the event loop, each rank its heads; the blocks are held or pinned, so nothing
        writes into them)."""
        if not self.transfer.checksums:
            return meta
        return dataclasses.replace(meta, checksums=await self.kv_ranks.checksums(block_ids))
