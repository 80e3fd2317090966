"""The KV hand-off on workers built in this process (no Ray), with scripted transfer
backends: each test is one of the ways a request could get KV that is not its own, or
blocks freed while a read may still write into them. Every test ends with the worker's
KV blocks all free."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time

import pytest

from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.wire.messages import TransferState
from kv_transfer.base import KVTransferBackend, TransferError, TransferMeta
from kv_transfer.config import TransferConfig
from tests.helpers import PATIENCE_S, async_wait_for

PROMPT = list(range(5, 45))  # 40 tokens: 3 blocks of 16
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


class _ScriptedPaged(KVTransferBackend):
    """A paged backend whose reads do what the test says (nothing is moved)."""

    name = "inprocess"
    paged = True

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[list[int]] = []  # the block ids of each read begun
        self.error: BaseException | None = None  # what the next read raises
        self.write = None  # called with the block ids of each read: the bytes landing

    def prepare(self, meta, k, v):
        raise AssertionError("paged: nothing is packed")

    def pull(self, meta, payload):
        raise AssertionError("paged: nothing is packed")

    def attach_cache(self, k, v) -> None:
        pass

    async def pull_blocks_async(self, meta: TransferMeta, payload, block_ids: list[int]) -> None:
        self.reads.append(list(block_ids))
        if self.error is not None:
            raise self.error
        if self.write is not None:
            self.write(block_ids)

    def prepare_blocks(self, meta, block_ids):
        return tuple(block_ids)  # the offer: the receiver would read these in place


def _decode_worker(model: str, policy: str = "recompute"):
    from decode_worker.worker import DecodeWorker

    config = EngineConfig(model=model, num_kv_blocks=32, block_size=16)
    transfer = TransferConfig(backend="inprocess", failure_policy=policy, checksums=True)
    worker = DecodeWorker("decode-0", config, transfer)
    worker.backend = _ScriptedPaged()
    return worker


def _meta(worker, reservation, first: int, num_blocks: int) -> TransferMeta:
    return TransferMeta(
        transfer_id=f"t{first}", request_id=reservation.request_id, layout=worker.layout, num_blocks=num_blocks,
        num_tokens=len(PROMPT), dst_blocks=tuple(reservation.block_ids[first : first + num_blocks]),
        sender="prefill-0",
    )


async def _blocks_in_use(worker) -> int:
    return await worker.async_engine.call(lambda: worker.engine.stats().num_blocks_in_use)


def test_a_final_transfer_short_of_its_reservation_is_refused_and_the_prompt_recomputed(tiny_model):
    """A sender that sends fewer blocks than were reserved (a prefill cut short) must
    not have its request run on the blocks never written: the failure policy runs
    (``fail`` here, so that the request's end shows it)."""
    worker = _decode_worker(tiny_model, policy="fail")

    async def main():
        reservation = await worker.reserve("a", PROMPT, GREEDY, subscriber="sub")
        assert len(reservation.block_ids) == 3
        state = await worker.receive_kv(_meta(worker, reservation, 0, 2), None, first_token=7)
        running = await worker.async_engine.call(lambda: "a" in worker.engine.scheduler.requests)
        in_use = await _blocks_in_use(worker)
        worker.async_engine.shutdown()
        return state, running, in_use

    state, running, in_use = asyncio.run(main())
    assert state == TransferState.FAILED, "a final part that leaves blocks unwritten must fail the transfer"
    assert worker.backend.reads == [], "it is refused before anything is read"
    assert not running and worker.num_transfer_failures == 1, "the request must end by the failure policy"
    assert in_use == 0, f"{in_use} blocks still in use"


def test_a_read_that_could_not_be_stopped_keeps_its_blocks_until_it_settles(tiny_model):
    """A stuck read may still write into its blocks: they stay out of use after the
    request has moved on, and come back once the backend says the read has ended."""
    worker = _decode_worker(tiny_model)
    settled = concurrent.futures.Future()
    error = TransferError("stuck", "a read could not be cancelled")
    error.settled = settled
    worker.backend.error = error

    async def main():
        reservation = await worker.reserve("a", PROMPT, GREEDY, subscriber="sub")
        state = await worker.receive_kv(_meta(worker, reservation, 0, 3), None, first_token=7)
        await worker.abort("a")  # the request ends (it was recomputing)
        await worker.async_engine.call(lambda: None)
        held_while_stuck = await _blocks_in_use(worker)
        quarantined = worker.handoff.num_quarantined
        settled.set_result(None)
        await worker.async_engine.call(lambda: None)  # the settle callback queues on the step thread
        await worker.async_engine.call(lambda: None)
        in_use = await _blocks_in_use(worker)
        worker.async_engine.shutdown()
        return state, held_while_stuck, quarantined, in_use

    state, held_while_stuck, quarantined, in_use = asyncio.run(main())
    assert state == TransferState.FAILED
    assert quarantined == 1 and held_while_stuck == 3, "the stuck read's 3 blocks must stay out of use"
    assert in_use == 0, f"{in_use} blocks still in use after the read settled"


def test_a_reservation_whose_kv_never_comes_expires_on_the_sweep_counted_once(tiny_model):
    """Past its deadline (an injected clock), the periodic sweep ends the reservation:
    one "timeout" counted, the failure policy run once, its pins back."""
    worker = _decode_worker(tiny_model)

    async def main():
        await worker.reserve("a", PROMPT, GREEDY, subscriber="sub")
        before = (await worker.stats())["handoffs"]
        await worker.async_engine.call(worker._expire_reservations, time.monotonic() + 3600)
        await worker.async_engine.call(worker._expire_reservations, time.monotonic() + 7200)
        after = (await worker.stats())["handoffs"]
        await worker.abort("a")  # it recomputes; end it here
        await worker.async_engine.call(lambda: None)
        in_use = await _blocks_in_use(worker)
        worker.async_engine.shutdown()
        return before, after, in_use

    before, after, in_use = asyncio.run(main())
    assert before == {"a": "RESERVED"} and after == {}, (before, after)
    assert worker.backend.stats.failures["timeout"] == 1 and worker.num_transfer_failures == 1
    assert in_use == 0, f"{in_use} blocks still in use"


def test_a_request_id_whose_blocks_are_still_held_for_a_transfer_is_refused(tiny_model):
    """A prefill engine holds a finished request's blocks until its reader is done; a
    second request under that id must not be let in (its block table would be appended
    to the first one's, and one release would free blocks still being read)."""
    engine = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=32, block_size=16))
    engine.add_request(PROMPT, SamplingParams(max_tokens=1), request_id="a", hold_kv=True)
    while engine.has_unfinished_requests():
        engine.step()
    held = engine.kv_manager.block_ids("a")
    assert held, "the finished request's blocks are held for the transfer"
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(PROMPT[:20], SamplingParams(max_tokens=1), request_id="a", hold_kv=True)
    assert engine.kv_manager.block_ids("a") == held, "the held request's block table must be untouched"
    engine.release_held("a")
    assert engine.stats().num_blocks_in_use == 0


def test_a_duplicate_generate_leaves_the_running_request_and_its_stream_alone(tiny_model):
    """The prefill role's ``generate`` under an id already streaming is refused without
    taking the first request's stream (which would then never finish)."""
    from engine.async_engine import AsyncEngine

    engine = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=32, block_size=16))
    runtime = AsyncEngine(engine)

    async def main():
        first = runtime.generate(PROMPT, GREEDY, "a")
        out = await first.__anext__()
        stream = runtime._streams.get("a")
        with pytest.raises(ValueError, match="already in use"):
            async for _ in runtime.generate(PROMPT, GREEDY, "a"):
                pass
        kept = runtime._streams.get("a") is stream

        async def rest():
            return [o async for o in first]

        outs = [out] + await asyncio.wait_for(rest(), PATIENCE_S)  # a dropped stream never ends
        in_use = await runtime.call(lambda: engine.stats().num_blocks_in_use)
        runtime.shutdown()
        return kept, outs, in_use

    kept, outs, in_use = asyncio.run(main())
    assert kept, "the refused duplicate must not drop the running request's stream"
    assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == GREEDY.max_tokens
    assert in_use == 0


class _Recorder:
    """A Ray method stand-in that records its calls."""

    def __init__(self, result=None) -> None:
        self.calls: list[tuple] = []
        self.result = result

    def remote(self, *args, **kwargs):
        self.calls.append(args)  # (the arguments by position: what identifies a call here)
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.result)
        return future


class _NeverAnswers(_Recorder):
    """A Ray method of a dead actor whose call hangs (a receiver that never answers)."""

    def remote(self, *args, **kwargs):
        self.calls.append(args)
        return asyncio.get_running_loop().create_future()


class _FakeDecodeHandle:
    def __init__(self, answers: bool = True) -> None:
        self.transfer_failed = _Recorder()
        receive = _Recorder if answers else _NeverAnswers
        self.receive_kv = receive(int(TransferState.DONE))
        self.receive_kv_part = receive(int(TransferState.DONE))


def test_a_prefill_worker_refuses_a_moved_stream_that_outgrows_its_pool_before_computing(tiny_model):
    """Prompt plus the stream's output so far over the prefill worker's pool: refused at
    once (the decode worker, told, recomputes with the room it has), never computed in
    part and sent as if whole."""
    from engine.wire.messages import Reservation
    from prefill_worker.worker import PrefillWorker

    config = EngineConfig(model=tiny_model, num_kv_blocks=4, block_size=16)  # 3 usable blocks: 48 tokens
    worker = PrefillWorker("prefill-0", config, TransferConfig(backend="inprocess"))
    decode = _FakeDecodeHandle()
    resume = list(range(50, 70))  # 40 + 20 tokens

    async def main():
        reservation = Reservation("a", [1, 2, 3, 4], worker.layout, "", time.time() + 3600)
        result = await worker.prefill("a", PROMPT, GREEDY, decode_worker=decode, reservation=reservation, resume_output=resume)
        steps = await worker.async_engine.call(lambda: worker.engine.stats().num_steps)
        in_use = await worker.async_engine.call(lambda: worker.engine.stats().num_blocks_in_use)
        worker.async_engine.shutdown()
        return result, steps, in_use

    result, steps, in_use = asyncio.run(main())
    assert result.state == TransferState.FAILED and "60 tokens do not fit" in result.error, result.error
    assert decode.transfer_failed.calls == [("a",)], "the decode worker must be told at once"
    assert decode.receive_kv.calls == [] and steps == 0, "nothing may be computed or sent"
    assert len(worker.offers) == 0 and in_use == 0


def test_cached_tokens_in_the_usage_never_exceed_the_prompt(tiny_model):
    """A moved stream's prefix hits may cover its earlier output too; the usage reports
    cached prompt tokens only."""
    engine = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=32, block_size=16))
    assert engine.add_remote_request(PROMPT, GREEDY, request_id="a", resume_output=[3, 4, 5]) is not None
    out = engine.remote_kv_arrived("a", 7, None, None, num_cached_tokens=len(PROMPT) + 3)
    assert out.num_cached_tokens == len(PROMPT)
    engine.abort("a")
    assert engine.stats().num_blocks_in_use == 0


def test_a_block_that_does_not_sum_to_what_was_sent_fails_its_transfer(tiny_model):
    """With checksums on, the receiver sums the blocks it read: the right bytes pass, a
    single changed word (or another request's block) fails the transfer, never served."""
    import torch

    from kv_transfer.checksum import block_checksums

    worker = _decode_worker(tiny_model, policy="fail")
    cache = worker.engine.kv_cache
    sent = [torch.randn(cache.k[:, :3].shape) for _ in range(2)]  # the sender's 3 blocks, K and V
    sums = block_checksums(*sent, [0, 1, 2])

    def land(corrupt: bool):
        def write(block_ids):
            cache.k[:, block_ids] = sent[0]
            cache.v[:, block_ids] = sent[1]
            if corrupt:
                cache.v[1, block_ids[2], 0, 0, 0] += 1.0
        return write

    async def main():
        states = []
        for rid, corrupt in (("good", False), ("bad", True)):
            worker.backend.write = land(corrupt)
            prompt = PROMPT if rid == "good" else [t + 100 for t in PROMPT]  # no prefix hit
            reservation = await worker.reserve(rid, prompt, GREEDY, subscriber="sub")
            meta = dataclasses.replace(_meta(worker, reservation, 0, 3), checksums=sums)
            states.append(await worker.receive_kv(meta, None, first_token=7))
        await worker.abort("good")
        await worker.async_engine.call(lambda: None)
        in_use = await _blocks_in_use(worker)
        worker.async_engine.shutdown()
        return states, in_use

    states, in_use = asyncio.run(main())
    assert states == [TransferState.DONE, TransferState.FAILED]
    assert worker.backend.stats.failures["checksum"] == 1
    assert in_use == 0, f"{in_use} blocks still in use"


RESERVED = [1, 2, 3]  # the decode worker's blocks for PROMPT


class _LateEvent:
    """A device event that has happened only once someone waited for it."""

    def __init__(self) -> None:
        self.done = False

    def synchronize(self) -> None:
        self.done = True


def test_pipelined_parts_are_offered_only_after_the_step_that_wrote_them_ran_on_the_device(tiny_model):
    """On a GPU a step that samples nothing returns before its kernels ran: a block it
    computed may be offered (and read by the decode worker) only once its step's event
    has completed. Events here complete only when waited for."""
    from engine.wire.messages import Reservation

    worker = _prefill_worker(tiny_model, max_num_batched_tokens=16)  # a block per step
    events: list[_LateEvent] = []
    worker.engine.runner.make_event = lambda: events.append(_LateEvent()) or events[-1]
    offered: list[tuple[int, bool]] = []  # (last block of a part, whether its step had run)

    def prepare_blocks(meta, block_ids):
        if block_ids:  # block i of the prompt was computed by step i
            last = RESERVED.index(meta.dst_blocks[-1])
            offered.append((last, events[last].done))
        return None

    worker.backend.prepare_blocks = prepare_blocks
    decode = _FakeDecodeHandle()

    async def main():
        reservation = Reservation("a", RESERVED, worker.layout, "", time.time() + 60)
        result = await worker.prefill("a", PROMPT, GREEDY, decode_worker=decode, reservation=reservation)
        in_use = await worker.async_engine.call(lambda: worker.engine.stats().num_blocks_in_use)
        worker.async_engine.shutdown()
        return result, in_use

    result, in_use = asyncio.run(main())
    assert result.state == TransferState.DONE
    assert offered and all(ran for _, ran in offered), f"parts offered before their step ran: {offered}"
    assert in_use == 0


class _ScriptedPush(_ScriptedPaged):
    """A paged backend whose sender pushes (as gloo channels do): a push to a dead
    receiver waits until it is abandoned."""

    sends = True

    def __init__(self) -> None:
        super().__init__()
        self.abandoned: list[str] = []
        self._abandon = asyncio.Event()

    async def push_async(self, meta, k, v, payload) -> None:
        await self._abandon.wait()
        raise TransferError("abandoned", f"transfer {meta.transfer_id}: abandoned")

    def abandon(self, meta, payload) -> None:
        self.abandoned.append(meta.transfer_id)
        self._abandon.set()


def _prefill_worker(model: str, pipeline: bool = True, backend=_ScriptedPaged, **engine):
    from prefill_worker.worker import PrefillWorker

    config = EngineConfig(model=model, block_size=16, **{"num_kv_blocks": 32, **engine})
    # A lease far past the test's patience: blocks freed by its expiry would time the test out.
    transfer = TransferConfig(backend="inprocess", lease_s=3600.0, pipeline=pipeline)
    worker = PrefillWorker("prefill-0", config, transfer)
    worker.backend = backend()
    return worker


@pytest.mark.parametrize(
    "pipeline, backend", [(False, _ScriptedPaged), (True, _ScriptedPaged), (False, _ScriptedPush)],
    ids=["read", "pipelined", "pushed"],
)
def test_an_abort_frees_the_blocks_a_prefill_worker_holds_for_a_reader_that_never_answers(
    tiny_model, pipeline, backend
):
    """The router aborts an attempt on the prefill workers when its decode worker died;
    a call to a dead receiver may hang until the lease (60 s) runs out, and a push to it
    until it is abandoned. The abort must end the hand-off at once: blocks free, the
    send no longer waiting, and the blocks released once (the prefill's own end
    releases nothing more)."""
    from engine.wire.messages import Reservation

    worker = _prefill_worker(tiny_model, pipeline, backend)
    decode = _FakeDecodeHandle(answers=False)

    async def main():
        reservation = Reservation("a", [1, 2, 3], worker.layout, "", time.time() + 3600)
        prefill = asyncio.ensure_future(worker.prefill("a", PROMPT, GREEDY, decode_worker=decode, reservation=reservation))
        try:
            await async_wait_for(lambda: decode.receive_kv.calls, PATIENCE_S, "the final offer to be sent")
            held = await _blocks_in_use(worker)
            assert held == 3, f"the prompt's 3 blocks are held for the reader, {held} in use"
            await worker.abort("a")
            freed = await _blocks_in_use(worker)  # the abort's release is queued before this call
            assert freed == 0, f"{freed} blocks still held after the abort (they wait for the lease)"
            result = await asyncio.wait_for(prefill, PATIENCE_S)
            return result, await _blocks_in_use(worker)
        finally:
            prefill.cancel()
            worker.async_engine.shutdown()

    result, in_use = asyncio.run(main())
    assert result.state == TransferState.FAILED and result.error == "aborted", result
    assert decode.transfer_failed.calls == [], "an abort is the router's to end, not a failed transfer"
    if backend is _ScriptedPush:
        assert worker.backend.abandoned, "the push to the dead receiver must be abandoned"
    assert len(worker.offers) == 0 and in_use == 0, f"{in_use} blocks in use at the end"


def test_an_abort_while_computing_ends_the_attempt_without_a_hand_off(tiny_model):
    """Aborted before its first token was handed over (the abort queues after the
    request's add: it aborts the request, or frees the blocks of one that just
    finished): nothing is offered and every block is freed."""
    from engine.wire.messages import Reservation

    worker = _prefill_worker(tiny_model, pipeline=False)
    decode = _FakeDecodeHandle(answers=False)

    async def main():
        reservation = Reservation("a", [1, 2, 3], worker.layout, "", time.time() + 3600)
        prefill = asyncio.ensure_future(worker.prefill("a", PROMPT, GREEDY, decode_worker=decode, reservation=reservation))
        await asyncio.sleep(0)  # the prefill begins and queues its request, then waits
        assert "a" in worker.offers
        await worker.abort("a")
        result = await asyncio.wait_for(prefill, PATIENCE_S)
        in_use = await _blocks_in_use(worker)
        worker.async_engine.shutdown()
        return result, in_use

    result, in_use = asyncio.run(main())
    assert result.state == TransferState.FAILED and result.error == "aborted", result
    assert decode.receive_kv.calls == [], "an aborted attempt offers nothing"
    assert len(worker.offers) == 0 and in_use == 0, f"{in_use} blocks in use at the end"


def test_a_prefill_whose_reservation_expired_is_dropped_before_it_is_computed(tiny_model):
    """The decode worker has given up on a reservation past its deadline: computing its
    prompt would be work for nobody."""
    from engine.wire.messages import Reservation

    worker = _prefill_worker(tiny_model)
    decode = _FakeDecodeHandle()

    async def main():
        reservation = Reservation("a", [1, 2, 3], worker.layout, "", time.time() - 1)
        result = await worker.prefill("a", PROMPT, GREEDY, decode_worker=decode, reservation=reservation)
        steps = await worker.async_engine.call(lambda: worker.engine.stats().num_steps)
        worker.async_engine.shutdown()
        return result, steps

    result, steps = asyncio.run(main())
    assert result.state == TransferState.FAILED and "deadline" in result.error
    assert steps == 0 and decode.transfer_failed.calls == [("a",)]
    assert len(worker.offers) == 0


class _Answers(_Recorder):
    """A Ray method whose answers the test gives (a read that is still running)."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: list[asyncio.Future] = []

    def remote(self, *args, **kwargs):
        self.calls.append(args)
        self.answers.append(asyncio.get_running_loop().create_future())
        return self.answers[-1]


def _blocks_held(worker, block_ids) -> list[int]:
    """Those of ``block_ids`` still out of the free pool (on the step thread, or stopped)."""
    pool = worker.engine.kv_manager.pool
    return [b for b in block_ids if pool.blocks[b].ref_cnt > 0]


@pytest.mark.parametrize("pipeline", [False, True], ids=["final-read", "part-read"])
def test_a_retiring_prefill_worker_frees_no_block_a_reader_is_still_reading(tiny_model, pipeline):
    """A role switch whose drain ran out while a decode worker reads an offer: the blocks
    it reads must stay as they are until it answers (freed and reset onto another prompt,
    the reader would land that prompt's KV and stream it with no error). Then every block
    comes back, the worker retires idle, and a reader whose KV will not come is told."""
    from engine.wire.messages import Reservation

    worker = _prefill_worker(tiny_model, pipeline, max_num_batched_tokens=16)  # a block a step
    decode = _FakeDecodeHandle()
    reads = decode.receive_kv_part if pipeline else decode.receive_kv
    reads.__class__ = _Answers
    reads.answers = []

    async def main():
        reservation = Reservation("a", RESERVED, worker.layout, "", time.time() + 3600)
        prefill = asyncio.ensure_future(worker.prefill("a", PROMPT, GREEDY, decode_worker=decode, reservation=reservation))
        await async_wait_for(lambda: reads.calls, PATIENCE_S, "the first read to be asked")
        being_read = list(reads.calls[0][1])  # the payload: the sender's blocks the reader reads
        retire = asyncio.ensure_future(worker.retire())
        for _ in range(20):  # the retire runs as far as it can while the read is unanswered
            await asyncio.sleep(0.01)
            if not retire.done():
                await worker.async_engine.call(lambda: None)
        retired_early = retire.done()  # then its step thread has stopped: the pool is read here
        held_during_read = (_blocks_held(worker, being_read) if retired_early
                            else await worker.async_engine.call(_blocks_held, worker, being_read))
        if not reads.answers[0].done():  # (a sender that stopped waiting has cancelled it)
            reads.answers[0].set_result(int(TransferState.DONE))
        idle = await asyncio.wait_for(retire, PATIENCE_S)
        return being_read, held_during_read, retired_early, idle, await asyncio.wait_for(prefill, PATIENCE_S)

    being_read, held_during_read, retired_early, idle, result = asyncio.run(main())
    assert not retired_early, "the worker retired (and could reset) while a read of its blocks was unanswered"
    assert held_during_read == being_read, f"blocks {being_read} were read, only {held_during_read} stayed held"
    assert idle and worker.engine.kv_manager.pool.num_used_blocks == 0, "every block comes back once answered"
    assert len(worker.offers) == 0
    if pipeline:  # the part landed, the rest never will: the reader must not wait for its deadline
        assert result.state == TransferState.FAILED and decode.transfer_failed.calls == [("a",)], result
        assert decode.receive_kv.calls == [], "no read is asked once the worker retires"
    else:  # the read it was waiting for was the whole hand-off
        assert result.state == TransferState.DONE and decode.transfer_failed.calls == [], result


def test_a_retiring_prefill_worker_tells_the_reader_of_a_prefill_it_drops(tiny_model):
    """A prefill still computing as its worker retires is dropped: its decode worker is
    told at once (it recomputes), not left to wait out the reservation's deadline."""
    from engine.wire.messages import Reservation

    worker = _prefill_worker(tiny_model, pipeline=False, max_num_batched_tokens=16)
    decode = _FakeDecodeHandle()

    async def main():
        reservation = Reservation("a", RESERVED, worker.layout, "", time.time() + 3600)
        prefill = asyncio.ensure_future(worker.prefill("a", PROMPT, GREEDY, decode_worker=decode, reservation=reservation))
        await asyncio.sleep(0)  # the prefill begins and queues its request
        idle = await asyncio.wait_for(worker.retire(), PATIENCE_S)
        return idle, await asyncio.wait_for(prefill, PATIENCE_S)

    idle, result = asyncio.run(main())
    assert result.state == TransferState.FAILED and "left its role" in result.error, result
    assert decode.transfer_failed.calls == [("a",)], "the reader must be told its KV will not come"
    assert decode.receive_kv.calls == [] and idle and worker.engine.kv_manager.pool.num_used_blocks == 0


def _raises(*_):
    raise RuntimeError("injected")


@pytest.mark.parametrize("step", ["checksum", "prepare", "send"])
def test_a_pipelined_part_that_raises_fails_its_attempt_and_unpins_every_part(tiny_model, monkeypatch, step):
    """A part whose checksums, payload or send raises must fail only its attempt: the
    reader told, the later parts never sent but unpinned, every block back (pinned for
    good, they would keep the worker from ever draining)."""
    from engine.wire.messages import Reservation

    worker = _prefill_worker(tiny_model, pipeline=True, max_num_batched_tokens=16)
    worker.transfer = dataclasses.replace(worker.transfer, checksums=True)
    decode = _FakeDecodeHandle()
    if step == "checksum":
        monkeypatch.setattr("kv_transfer.sharded.block_checksums", _raises)
    elif step == "prepare":
        worker.backend.prepare_blocks = _raises
    else:
        decode.receive_kv_part.remote = _raises

    async def main():
        reservation = Reservation("a", RESERVED, worker.layout, "", time.time() + 3600)
        result = await asyncio.wait_for(worker.prefill("a", PROMPT, GREEDY, decode_worker=decode, reservation=reservation), PATIENCE_S)
        in_use = await _blocks_in_use(worker)
        worker.async_engine.shutdown()
        return result, in_use

    result, in_use = asyncio.run(main())
    assert result.state == TransferState.FAILED, result
    assert decode.transfer_failed.calls[:1] == [("a",)], "the reader must be told at once"
    assert decode.receive_kv.calls == [], "an attempt whose part failed sends nothing more"
    assert len(worker.offers) == 0 and in_use == 0, f"{in_use} blocks still in use (pinned parts never unpinned?)"
