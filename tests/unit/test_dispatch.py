"""The dispatcher's cancellation paths, with in-process stand-ins for worker actors."""

from __future__ import annotations

import asyncio
import math
from unittest import mock

import pytest

from engine.wire.messages import (
    DecodeLoad,
    ErrorKind,
    PrefillLoad,
    PrefillResult,
    StalePlacement,
    TransferState,
    request_of,
)
from engine.wire.sampling_params import SamplingParams
from engine.wire.token_channel import ChannelServer, Notice, NoticeKind
from router.dispatch import Affinity, DispatchConfig, Dispatcher, WorkerRef
from tests.helpers import PATIENCE_S, async_wait_for


class _Method:
    """``handle.method.remote(...)`` -> an awaitable, like a Ray actor method."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args, **kwargs):
        return asyncio.ensure_future(self.fn(*args, **kwargs))

    def options(self, **_):
        return self


async def _no_token_channel() -> None:
    """A stand-in's ``token_channel``: it has none (its stream comes over ``subscribe``)."""
    return None


# The fakes record requests by the client's id (``request_of`` the attempt id they get).


class _FakeDecode:
    """A decode worker that reserves on ``release_reserve``; with ``room``, it hands out a
    reservation (else None: no room now)."""

    def __init__(self, room: bool = False) -> None:
        self.room = room
        self.reserve_started = asyncio.Event()
        self.release_reserve = asyncio.Event()
        self.reserved: set[str] = set()
        self.priorities: dict[str, int] = {}  # request id -> the priority it was reserved with
        self.aborted: list[str] = []
        self.load = _Method(self._load)
        self.reserve = _Method(self._reserve)
        self.abort = _Method(self._abort)
        self.subscribe = _StreamingMethod(lambda subscriber: _Stream(asyncio.Queue()))
        self.token_channel = _Method(_no_token_channel)

    async def _load(self):
        return DecodeLoad("decode-0", free_blocks=100, total_blocks=100, running=0, waiting=0, waiting_for_kv=0)

    async def _reserve(self, rid, prompt, params, *, subscriber, resume_output=(), priority=0):
        self.reserve_started.set()
        await self.release_reserve.wait()
        self.reserved.add(request_of(rid))
        self.priorities[request_of(rid)] = priority
        return f"reservation-{request_of(rid)}" if self.room else None  # None: the dispatcher waits and tries again

    async def _abort(self, rid):
        self.aborted.append(request_of(rid))
        self.reserved.discard(request_of(rid))


class _FakePrefill:
    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.prefilled: dict[str, tuple] = {}  # request id -> (reservation, priority)
        self.load = _Method(self._load)
        self.prefill = _Method(self._prefill)
        self.abort = _Method(self._abort)

    async def _prefill(self, rid, prompt, params, *, decode_worker, reservation, resume_output=(), priority=0):
        self.prefilled[request_of(rid)] = (reservation, priority)
        return PrefillResult(rid, 4, 0, int(self.state), 0.0, 0.0, 0.0, 0)

    state = TransferState.DONE  # how its hand-offs end

    async def _load(self):
        return PrefillLoad("prefill-0", 0, 0, 0, 0, 0)

    async def _abort(self, rid):
        self.aborted.append(request_of(rid))


def test_a_request_cancelled_while_its_blocks_are_being_reserved_is_aborted_on_every_worker():
    async def main():
        decode, prefill = _FakeDecode(), _FakePrefill()
        dispatcher = Dispatcher(
            lambda: [WorkerRef("prefill-0", prefill)], lambda: [WorkerRef("decode-0", decode)], DispatchConfig()
        )

        async def consume():
            async for _ in dispatcher.generate([1, 2, 3], SamplingParams(max_tokens=4), "r1"):
                pass

        task = asyncio.create_task(consume())
        await asyncio.wait_for(decode.reserve_started.wait(), 5)
        task.cancel()  # the client left while the decode worker was reserving
        decode.release_reserve.set()  # the reservation still lands on the worker
        await asyncio.gather(task, return_exceptions=True)
        # the aborts are fire-and-forget
        await _until(lambda: decode.aborted and prefill.aborted, "the aborts to reach both workers")
        dispatcher.close()
        return decode, prefill

    decode, prefill = asyncio.run(main())
    assert decode.aborted == ["r1"] and prefill.aborted == ["r1"]
    assert not decode.reserved, "the reservation must not outlive the request"


def _placed_once(prompt: list[int], priority: int = 0, wrap_hasher: bool = False):
    """Run one request on a prefill and a decode stand-in until its prefill is sent, then
    abort it. Returns (dispatcher, decode, prefill); ``wrap_hasher`` counts hash calls."""

    async def main():
        decode, prefill = _FakeDecode(room=True), _FakePrefill()
        dispatcher = Dispatcher(
            lambda: [WorkerRef("prefill-0", prefill)], lambda: [WorkerRef("decode-0", decode)], DispatchConfig()
        )
        if wrap_hasher:
            dispatcher._hasher = mock.Mock(wraps=dispatcher._hasher)

        async def consume():
            async for _ in dispatcher.generate(prompt, SamplingParams(max_tokens=4), "r1", priority=priority):
                pass

        task = asyncio.create_task(consume())
        decode.release_reserve.set()
        await _until(lambda: "r1" in prefill.prefilled, "the prefill to be sent")
        assert dispatcher.abort("r1")
        await task
        dispatcher.close()
        return dispatcher, decode, prefill

    return asyncio.run(main())


def test_priority_reaches_the_decode_reservation_and_the_prefill():
    _, decode, prefill = _placed_once([1, 2, 3], priority=-7)
    assert decode.priorities == {"r1": -7}, "the decode worker must reserve with the request's priority"
    assert prefill.prefilled == {"r1": ("reservation-r1", -7)}, "the prefill worker must run it with it too"


def test_a_prompt_is_hashed_once_for_both_placements():
    prompt = list(range(40))
    dispatcher, _, _ = _placed_once(prompt, wrap_hasher=True)
    calls = dispatcher._hasher.hash_blocks.call_count
    assert calls == 1, f"the prompt should be hashed once for the decode and the prefill placement, not {calls} times"
    hashes = dispatcher.prefix_hashes(prompt)
    assert dispatcher.loads.prefill_prefixes.matched_blocks("prefill-0", hashes) == 2, "the prefill index records its 2 blocks"
    assert dispatcher.loads.decode_prefixes.matched_blocks("decode-0", hashes) == 2, "and so does the decode index"


# -- token delivery over the per-worker subscription -------------------------------


class _Stream:
    """What ``subscribe.options(num_returns="streaming").remote()`` returns: refs to await."""

    def __init__(self, queue: asyncio.Queue) -> None:
        self.queue = queue

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        ref = asyncio.get_running_loop().create_future()
        ref.set_result(item)
        return ref


class _StreamingMethod:
    def __init__(self, open_stream) -> None:
        self.open_stream = open_stream

    def options(self, **_):
        return self

    def remote(self, subscriber):
        return self.open_stream(subscriber)


class _FakeColocated:
    """A colocated worker whose step messages the test writes by hand."""

    def __init__(self, worker_id: str, alive: bool = True) -> None:
        self.worker_id = worker_id
        self.alive = alive  # whether the cluster lists it
        self.messages: asyncio.Queue = asyncio.Queue()
        self.subscribers: list[str] = []
        self.submitted: list[str] = []
        self.attempts: list[str] = []  # the ids the requests came under, in order
        self.aborted_attempts: list[str] = []
        self.resumed: list[list[int]] = []
        self.priorities: list[int] = []
        self.aborted: list[str] = []
        self.polls = 0  # load() calls
        self.load = _Method(self._load)
        self.submit = _Method(self._submit)
        self.abort = _Method(self._abort)
        self.subscribe = _StreamingMethod(self._subscribe)
        self.token_channel = _Method(_no_token_channel)

    def _subscribe(self, subscriber):
        self.subscribers.append(subscriber)
        return _Stream(self.messages)

    async def _load(self):
        self.polls += 1
        return self.report(free_blocks=100)

    def report(self, free_blocks: int) -> DecodeLoad:
        return DecodeLoad(self.worker_id, free_blocks=free_blocks, total_blocks=100, running=0, waiting=0, waiting_for_kv=0)

    async def _submit(self, rid, prompt, params, *, subscriber, resume_output=(), priority=0):
        self.submitted.append(request_of(rid))
        self.attempts.append(rid)
        self.resumed.append(list(resume_output))
        self.priorities.append(priority)

    async def _abort(self, rid):
        self.aborted.append(request_of(rid))
        self.aborted_attempts.append(rid)

    def step(self, *deltas: tuple, load: DecodeLoad | None = None) -> None:
        """One engine step's message: (request id, token ids, text, finished) per request,
        and the worker's ``load`` after the step (None: the message carries none)."""
        attempt = {request_of(aid): aid for aid in self.attempts}  # each request's latest here
        self.messages.put_nowait((
            load,
            [(attempt[rid], ids, text, done, "length" if done else None, 3, 0, 0, None, None, None, None)
             for rid, ids, text, done in deltas],
        ))


def _colocated_dispatcher(*workers: _FakeColocated, **config) -> Dispatcher:
    refs = [WorkerRef(w.worker_id, w) for w in workers]
    return Dispatcher(lambda: [], lambda: [r for r in refs if r.handle.alive], DispatchConfig(**config))


async def _collect(dispatcher: Dispatcher, rid: str, out: dict, priority: int = 0) -> None:
    """Read request ``rid``'s stream into ``out[rid]``, delta by delta as they arrive."""
    deltas = out.setdefault(rid, [])
    async for d in dispatcher.generate([1, 2, 3], SamplingParams(max_tokens=4), rid, priority=priority):
        deltas.append(d)


def _tokens_received(out: dict, rid: str) -> int:
    return sum(len(d.token_ids) for d in out.get(rid, ()))


def _stage(dispatcher: Dispatcher, loads: dict) -> None:
    """Loads as if the workers had reported them long ago (stale: the next placement polls)."""
    for worker_id, load in loads.items():
        dispatcher.loads.note(worker_id, load, -math.inf)


async def _until(cond, what: str) -> None:
    await async_wait_for(cond, PATIENCE_S, what)


async def _started(
    dispatcher: Dispatcher, worker: _FakeColocated, rid: str = "r0", priority: int = 0
) -> tuple[asyncio.Task, dict]:
    """Request ``rid`` read in a task, once ``worker`` has it; its deltas gather in the dict."""
    out: dict = {}
    task = asyncio.create_task(_collect(dispatcher, rid, out, priority))
    await _until(lambda: worker.submitted == [rid], f"{rid} to reach {worker.worker_id}")
    return task, out


def test_one_step_message_reaches_every_request_it_carries_over_one_stream():
    async def main():
        worker = _FakeColocated("decode-0")
        dispatcher = _colocated_dispatcher(worker)
        out: dict = {}
        tasks = [asyncio.create_task(_collect(dispatcher, f"r{i}", out)) for i in range(3)]
        await _until(lambda: len(worker.submitted) == 3, "the 3 requests to reach the worker")
        worker.step(("r0", [5], "a", False), ("r1", [6], "b", False), ("r2", [7], "c", True))
        worker.step(("r0", [8, 9], "de", True), ("r1", [10], "f", True))
        await asyncio.gather(*tasks)
        dispatcher.close()
        return worker, out

    worker, out = asyncio.run(main())
    assert len(worker.subscribers) == 1, "all requests on a worker must share one subscription stream"
    assert [d.token_ids for d in out["r0"]] == [[5], [8, 9]]
    assert [d.text for d in out["r1"]] == ["b", "f"]
    assert [d.finished for d in out["r2"]] == [True], "r2 finished in the first step"


async def _dies_and_the_request_moves(dispatcher: Dispatcher, doomed: _FakeColocated, spare: _FakeColocated) -> None:
    """``doomed`` dies as ``spare`` joins; request r0 moves to the spare."""
    from ray.exceptions import RayActorError

    doomed.alive, spare.alive = False, True
    await dispatcher.refresh_loads()
    doomed.messages.put_nowait(RayActorError())
    await _until(lambda: spare.submitted == ["r0"], "the request to move to the spare")


def test_a_worker_dying_before_any_token_reruns_the_request_elsewhere():
    async def main():
        # the spare joins after the death
        doomed, spare = _FakeColocated("decode-0"), _FakeColocated("decode-1", alive=False)
        dispatcher = _colocated_dispatcher(doomed, spare)
        task, out = await _started(dispatcher, doomed)
        await _dies_and_the_request_moves(dispatcher, doomed, spare)
        spare.step(("r0", [4, 5], "ok", True))
        await task
        dispatcher.close()
        return out

    out = asyncio.run(main())
    assert [(d.token_ids, d.error) for d in out["r0"]] == [([4, 5], None)], "the re-run must finish cleanly"
    assert {d.request_id for d in out["r0"]} == {"r0"}, "deltas go out under the client's id"


def test_a_worker_dying_mid_stream_moves_the_stream_on_with_the_tokens_sent():
    async def main():
        doomed, spare = _FakeColocated("decode-0"), _FakeColocated("decode-1", alive=False)
        dispatcher = _colocated_dispatcher(doomed, spare)
        task, out = await _started(dispatcher, doomed, priority=-2)
        doomed.step(("r0", [4], "x", False))
        doomed.step(("r0", [5, 6], "yz", False))
        await _until(lambda: _tokens_received(out, "r0") == 3, "the 3 tokens to reach the request")
        await _dies_and_the_request_moves(dispatcher, doomed, spare)
        spare.step(("r0", [7], "!", True))
        await task
        dispatcher.close()
        return doomed, spare, out

    doomed, spare, out = asyncio.run(main())
    assert spare.resumed == [[4, 5, 6]], "the new worker must recompute the tokens already sent"
    assert doomed.attempts[0] != spare.attempts[0], "the moved stream is a new attempt, with its own id"
    assert doomed.priorities == spare.priorities == [-2], "the moved stream must keep its priority"
    deltas = out["r0"]
    assert [t for d in deltas for t in d.token_ids] == [4, 5, 6, 7] and not any(d.error for d in deltas)
    assert deltas[-1].finished


class _ChannelColocated(_FakeColocated):
    """A colocated worker that serves its step messages over a token channel; an
    exception among them closes the connection, as the worker's death would."""

    def __init__(self, worker_id: str, alive: bool = True) -> None:
        super().__init__(worker_id, alive)
        self.server = ChannelServer(self._serve)
        self.channel_subscribers: list[str] = []
        self.token_channel = _Method(self.server.start)

    async def _serve(self, subscriber, send) -> None:
        self.channel_subscribers.append(subscriber)
        while not isinstance(message := await self.messages.get(), BaseException):
            await send(message)


def test_step_messages_come_over_a_token_channel_and_its_closing_moves_the_stream():
    async def main():
        doomed, spare = _ChannelColocated("decode-0"), _FakeColocated("decode-1", alive=False)
        dispatcher = _colocated_dispatcher(doomed, spare)
        task, out = await _started(dispatcher, doomed)
        doomed.step(("r0", [4], "x", False))
        await _until(lambda: _tokens_received(out, "r0") == 1, "the first token to come over the channel")
        doomed.alive, spare.alive = False, True
        await dispatcher.refresh_loads()
        doomed.messages.put_nowait(ConnectionResetError())  # the connection closes
        await _until(lambda: spare.submitted == ["r0"], "the request to move to the spare")
        spare.step(("r0", [7], "!", True))
        await task
        dispatcher.close()
        doomed.server.close()
        return doomed, spare, out

    doomed, spare, out = asyncio.run(main())
    assert len(doomed.channel_subscribers) == 1 and doomed.subscribers == [], "the channel, not Ray, must carry them"
    assert spare.resumed == [[4]], "a closed channel must count as the worker's death"
    assert [t for d in out["r0"] for t in d.token_ids] == [4, 7] and not any(d.error for d in out["r0"])


class _Events:
    """Router metrics that only count stream events."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.migrations = 0

    def on_stream_event(self, event: str) -> None:
        self.events.append(event)

    def on_migrated(self) -> None:
        self.migrations += 1


def test_a_dropped_token_channel_reconnects_and_the_stream_stays_on_its_worker():
    async def main():
        worker, spare = _ChannelColocated("decode-0"), _FakeColocated("decode-1", alive=False)
        metrics = _Events()
        refs = [WorkerRef(w.worker_id, w) for w in (worker, spare)]
        dispatcher = Dispatcher(lambda: [], lambda: [r for r in refs if r.handle.alive], DispatchConfig(), metrics)
        task, out = await _started(dispatcher, worker)
        worker.step(("r0", [4], "a", False))
        await _until(lambda: _tokens_received(out, "r0") == 1, "the first token to come over the channel")
        spare.alive = True  # somewhere the stream could move to, were the drop taken for a death
        await dispatcher.refresh_loads()
        worker.server.disconnect(worker.channel_subscribers[0])  # a network blip
        worker.step(("r0", [5], "b", False))
        worker.step(("r0", [6], "c", True))
        await task
        dispatcher.close()
        worker.server.close()
        return worker, spare, dispatcher, metrics, out

    worker, spare, dispatcher, metrics, out = asyncio.run(main())
    assert [t for d in out["r0"] for t in d.token_ids] == [4, 5, 6], "every token once, in order"
    assert not any(d.error for d in out["r0"]) and out["r0"][-1].finished
    assert spare.submitted == [] and worker.aborted == [], "a blip must not move or re-run the stream"
    assert dispatcher.num_migrations == 0 and metrics.migrations == 0
    assert metrics.events == ["resumed"], f"the reconnect must be counted once, got {metrics.events}"
    assert len(worker.channel_subscribers) == 1, "the same session must carry on"


def test_a_worker_that_cuts_the_router_off_ends_its_requests_with_an_error_not_a_move():
    async def main():
        worker, spare = _ChannelColocated("decode-0"), _FakeColocated("decode-1")
        metrics = _Events()
        refs = [WorkerRef(w.worker_id, w) for w in (worker, spare)]
        dispatcher = Dispatcher(lambda: [], lambda: [r for r in refs if r.handle.alive], DispatchConfig(), metrics)
        spare.alive = False
        task, out = await _started(dispatcher, worker)
        spare.alive = True
        worker.step(("r0", [4], "a", False))
        worker.messages.put_nowait(Notice(NoticeKind.SLOW, "behind"))
        worker.messages.put_nowait(Notice(NoticeKind.CUT, "cut off"))
        worker.messages.put_nowait(ConnectionResetError())  # the worker ends the session
        await task
        dispatcher.close()
        worker.server.close()
        return worker, spare, metrics, out

    worker, spare, metrics, out = asyncio.run(main())
    last = out["r0"][-1]
    assert last.finished and last.error_kind == ErrorKind.NO_CAPACITY and "cut off" in last.error, last
    assert spare.submitted == [], "a router too slow to read must not have its streams moved"
    assert metrics.events == ["slow", "cut"] and metrics.migrations == 0, metrics.events


def test_a_token_channel_the_router_cannot_reach_leaves_the_stream_on_ray():
    async def main():
        worker = _ChannelColocated("decode-0")
        await worker.server.start()
        worker.server.close()  # it advertises an address where nothing listens
        await worker.server._server.wait_closed()
        dispatcher = _colocated_dispatcher(worker)
        task, out = await _started(dispatcher, worker)
        worker.step(("r0", [4, 5], "ok", True))
        await task
        dispatcher.close()
        return worker, out

    worker, out = asyncio.run(main())
    assert len(worker.subscribers) == 1 and worker.channel_subscribers == []
    assert [(d.token_ids, d.error) for d in out["r0"]] == [([4, 5], None)]


def test_a_stream_that_outlives_max_migrations_ends_with_an_error():
    from ray.exceptions import RayActorError

    from engine.wire.messages import ErrorKind

    async def main():
        worker = _FakeColocated("decode-0")
        dispatcher = _colocated_dispatcher(worker, max_migrations=0)
        task, out = await _started(dispatcher, worker)
        worker.step(("r0", [4], "x", False))
        worker.messages.put_nowait(RayActorError())
        await task
        dispatcher.close()
        return out

    deltas = asyncio.run(main())["r0"]
    assert deltas[0].token_ids == [4]
    assert deltas[-1].finished and deltas[-1].error_kind == ErrorKind.WORKER_FAILED
    assert "after 1 tokens" in deltas[-1].error and "max_migrations" in deltas[-1].error, deltas[-1].error


def test_abort_ends_the_stream_with_abort_and_frees_the_request_on_the_worker():
    async def main():
        worker = _FakeColocated("decode-0")
        dispatcher = _colocated_dispatcher(worker)
        task, out = await _started(dispatcher, worker)
        worker.step(("r0", [4], "x", False))
        await _until(lambda: _tokens_received(out, "r0") == 1, "the token to reach the request before the abort")
        assert dispatcher.abort("r0")
        await task
        await _until(lambda: worker.aborted == ["r0"], "the abort to reach the worker")
        dispatcher.close()
        return out

    deltas = asyncio.run(main())["r0"]
    assert deltas[-1].finish_reason == "abort" and deltas[-1].num_output_tokens == 1


def test_a_stream_closed_at_its_finished_delta_sends_no_abort():
    async def main():
        worker = _FakeColocated("decode-0")
        dispatcher = _colocated_dispatcher(worker)
        stream = dispatcher.generate([1, 2, 3], SamplingParams(max_tokens=1), "r0")
        first = asyncio.ensure_future(stream.__anext__())
        await _until(lambda: worker.submitted == ["r0"], "r0 to reach the worker")
        worker.step(("r0", [4], "x", True))
        last = await first
        await stream.aclose()  # as a consumer that stops at the last delta does
        await asyncio.sleep(0.05)  # an abort would be fire-and-forget
        dispatcher.close()
        return worker, last

    worker, last = asyncio.run(main())
    assert last.finished
    assert worker.aborted == [], "a finished request must not be aborted on its worker"


def test_placement_uses_the_load_on_step_messages_and_polls_only_workers_not_heard_from():
    from engine.wire.messages import ErrorKind

    async def main():
        worker = _FakeColocated("decode-0")
        # reports stay fresh for the whole test; no capacity wait: a full worker refuses at once
        dispatcher = _colocated_dispatcher(worker, load_poll_s=60.0, capacity_wait_s=0.0)
        task, out = await _started(dispatcher, worker)  # nothing heard yet: one poll
        worker.step(("r0", [4], "x", False), load=worker.report(free_blocks=0))
        await _until(lambda: _tokens_received(out, "r0") == 1, "r0's first token")
        full: dict = {}
        await asyncio.wait_for(_collect(dispatcher, "r1", full), PATIENCE_S)  # the step said: no room
        worker.step(("r0", [5], "y", True), load=worker.report(free_blocks=100))
        await task
        later = asyncio.create_task(_collect(dispatcher, "r2", {}))  # the step said: room again
        await _until(lambda: worker.submitted == ["r0", "r2"], "r2 to reach decode-0")
        worker.step(("r2", [6], "z", True))
        await later
        dispatcher.close()
        return worker, full

    worker, full = asyncio.run(main())
    assert worker.polls == 1, "a worker that reports on its step messages must not be polled"
    (refused,) = full["r1"]
    assert refused.error_kind == ErrorKind.NO_CAPACITY, refused
    assert worker.submitted == ["r0", "r2"]


# -- affinity: the choices of one prompt go where its blocks are -----------------------


def test_requests_sharing_an_affinity_land_on_the_decode_worker_of_the_first():
    async def main(shared: bool):
        workers = [_FakeColocated(f"decode-{i}") for i in range(3)]
        dispatcher = _colocated_dispatcher(*workers)
        affinity = Affinity() if shared else None
        out: dict = {}

        async def collect(rid):
            async for d in dispatcher.generate([1, 2, 3], SamplingParams(max_tokens=4), rid, affinity):
                out.setdefault(rid, []).append(d)

        tasks = []
        for i in range(3):
            tasks.append(asyncio.create_task(collect(f"r{i}")))
            await _until(lambda: sum(len(w.submitted) for w in workers) == i + 1, f"r{i} to be placed")
        for w in workers:
            w.step(*[(rid, [4], "x", True) for rid in w.submitted])
        await asyncio.gather(*tasks)
        dispatcher.close()
        return [len(w.submitted) for w in workers], affinity

    placed, affinity = asyncio.run(main(shared=True))
    assert sorted(placed) == [0, 0, 3], f"all three must follow the first to its worker, got {placed}"
    assert affinity.decode == f"decode-{placed.index(3)}"
    assert sorted(asyncio.run(main(shared=False))[0]) == [1, 1, 1], "without one, ties rotate over the workers"


def test_an_affinity_sends_a_prompt_back_to_the_prefill_worker_that_computed_it():
    prefills = [WorkerRef(f"prefill-{i}", None) for i in range(2)]
    dispatcher = Dispatcher(lambda: prefills, lambda: [], DispatchConfig(placement="round_robin"))
    _stage(dispatcher, {w.worker_id: PrefillLoad(w.worker_id, 0, 0, 0, 0, 0) for w in prefills})
    plain = [dispatcher._choose_prefill([1] * 40).worker_id for _ in range(2)]
    assert plain == ["prefill-0", "prefill-1"], "round robin alternates without an affinity"
    affinity = Affinity()
    chosen = [dispatcher._choose_prefill([1] * 40, affinity).worker_id for _ in range(3)]
    assert chosen == [chosen[0]] * 3 and affinity.prefill == chosen[0], chosen
    affinity.prefill = "prefill-gone"
    assert dispatcher._choose_prefill([1] * 40, affinity).worker_id in {"prefill-0", "prefill-1"}, \
        "a worker no longer listed is passed over"


def test_requests_sharing_a_prefix_go_to_the_decode_worker_that_ran_it():
    async def main(prefix_affinity: bool) -> list[str]:
        workers = [_FakeColocated(f"decode-{i}") for i in range(2)]
        dispatcher = _colocated_dispatcher(*workers, prefix_affinity=prefix_affinity)
        system = list(range(100, 132))  # two full blocks of 16
        placed = []
        for i, prompt in enumerate([system + [1], system + [2], list(range(500, 540)), system + [3]]):
            rid = f"r{i}"

            async def run(prompt=prompt, rid=rid):
                async for _ in dispatcher.generate(prompt, SamplingParams(max_tokens=1), rid):
                    pass

            task = asyncio.create_task(run())
            await _until(lambda: any(rid in w.submitted for w in workers), f"{rid} to be placed")
            worker = next(w for w in workers if rid in w.submitted)
            worker.step((rid, [4], "x", True))
            await task
            placed.append(worker.worker_id)
        dispatcher.close()
        return placed

    placed = asyncio.run(main(prefix_affinity=True))
    assert placed[1] == placed[0] and placed[3] == placed[0], f"the shared prefix must stay where it ran: {placed}"
    assert len(set(asyncio.run(main(prefix_affinity=False)))) == 2, "without affinity, ties rotate over the workers"


class _DyingDecode(_FakeDecode):
    """A decode worker that reserves at once and streams from a queue the test controls."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(room=True)
        self.worker_id = worker_id
        self.release_reserve.set()
        self.messages: asyncio.Queue = asyncio.Queue()
        self.attempts: list[str] = []
        self.subscribe = _StreamingMethod(lambda subscriber: _Stream(self.messages))
        self.transfer_failed = _Method(self._noop)

    async def _reserve(self, rid, prompt, params, **kwargs):
        self.attempts.append(rid)
        return await super()._reserve(rid, prompt, params, **kwargs)

    async def _load(self):
        return DecodeLoad(self.worker_id, free_blocks=100, total_blocks=100, running=0, waiting=0, waiting_for_kv=0)

    async def _noop(self, *args):
        pass


class _AttemptPrefill(_FakePrefill):
    def __init__(self) -> None:
        super().__init__()
        self.attempts: list[str] = []  # ids prefilled, and aborted, as the worker sees them
        self.aborted_attempts: list[str] = []

    async def _prefill(self, rid, prompt, params, **kwargs):
        self.attempts.append(rid)
        await super()._prefill(rid, prompt, params, **kwargs)
        await asyncio.Event().wait()  # still prefilling (or holding blocks) when its reader dies

    async def _abort(self, rid):
        self.aborted_attempts.append(rid)
        await super()._abort(rid)


def test_a_decode_death_aborts_its_attempt_on_the_prefill_worker_and_the_rerun_gets_a_new_id():
    """A re-run must never share worker-side state with the attempt it replaces: the old
    attempt is aborted on the prefill worker, and the new one goes by another id."""
    from ray.exceptions import RayActorError

    async def main():
        prefill, doomed, spare = _AttemptPrefill(), _DyingDecode("decode-0"), _DyingDecode("decode-1")
        alive = {"decode-0": True, "decode-1": False}
        refs = [WorkerRef("decode-0", doomed), WorkerRef("decode-1", spare)]
        dispatcher = Dispatcher(
            lambda: [WorkerRef("prefill-0", prefill)],
            lambda: [r for r in refs if alive[r.worker_id]],
            DispatchConfig(),
        )
        out: dict = {}
        task = asyncio.create_task(_collect(dispatcher, "r0", out))
        await _until(lambda: len(prefill.attempts) == 1, "the first attempt to reach the prefill worker")
        alive["decode-1"] = True
        await dispatcher.refresh_loads()
        doomed.messages.put_nowait(RayActorError())
        await _until(lambda: len(prefill.attempts) == 2, "the re-run to reach the prefill worker")
        spare.messages.put_nowait((None, [(spare.attempts[0], [4], "x", True, "length", 3, 1, 0,
                                           None, None, None, None)]))
        await task
        dispatcher.close()
        return prefill, doomed, spare, out

    prefill, doomed, spare, out = asyncio.run(main())
    first, rerun = prefill.attempts
    assert first != rerun and request_of(first) == request_of(rerun) == "r0"
    assert doomed.attempts == [first] and spare.attempts == [rerun]
    assert prefill.aborted_attempts[0] == first, "the dead reader's attempt must be aborted on the prefill worker"
    assert rerun not in prefill.aborted_attempts, "the re-run must not be aborted along with it"
    assert [d.token_ids for d in out["r0"]] == [[4]] and out["r0"][-1].request_id == "r0"


def test_two_dispatchers_with_the_same_client_id_never_abort_each_others_attempts():
    """Client-chosen ids may repeat across router replicas: one's cancellation must not
    end the other's request."""

    async def main():
        worker = _FakeColocated("decode-0")
        one, two = _colocated_dispatcher(worker), _colocated_dispatcher(worker)
        out: dict = {}
        task_one = asyncio.create_task(_collect(one, "same", out))
        await _until(lambda: len(worker.attempts) == 1, "the first router's request to reach the worker")
        task_two = asyncio.create_task(_collect(two, "same", {}))
        await _until(lambda: len(worker.attempts) == 2, "the second router's request to reach the worker")
        task_two.cancel()
        await asyncio.gather(task_two, return_exceptions=True)
        await _until(lambda: worker.aborted, "the cancelled request's abort to reach the worker")
        task_one.cancel()
        one.close()
        two.close()
        return worker

    worker = asyncio.run(main())
    assert worker.attempts[0] != worker.attempts[1]
    assert worker.aborted == ["same"]
    assert worker.aborted_attempts == [worker.attempts[1]], "only the cancelled router's attempt is aborted"


class _FrozenColocated(_FakeColocated):
    """A worker alive to Ray but stopped (SIGSTOP): it takes calls and answers none,
    until ``thaw``."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(worker_id)
        self.thawed = asyncio.Event()

    async def _load(self):
        self.polls += 1
        await self.thawed.wait()
        return self.report(free_blocks=100)

    def thaw(self) -> None:
        self.thawed.set()


def test_a_decode_worker_that_answers_no_load_poll_holds_placement_up_once_at_most():
    from engine.wire.token_channel import ChannelConfig

    async def main():
        frozen, live = _FrozenColocated("decode-0"), _FakeColocated("decode-1")
        dispatcher = _colocated_dispatcher(
            frozen, live, channel=ChannelConfig(heartbeat_s=0.05, heartbeat_timeout_s=2.0),
        )
        loop = asyncio.get_running_loop()
        took = []
        for rid in ("r0", "r1", "r2"):
            t0 = loop.time()
            task, _ = await asyncio.wait_for(_started(dispatcher, live, rid), 10.0)
            took.append(loop.time() - t0)
            live.submitted.clear()
            live.step((rid, [4], "x", True))
            await task
        polls_while_frozen = frozen.polls
        frozen.thaw()  # its unanswered poll answers at last: it takes requests again
        await _until(lambda: "decode-0" in dispatcher.loads.reports(), "the thawed worker's load")
        dispatcher.close()
        return took, polls_while_frozen

    took, polls = asyncio.run(main())
    assert took[0] < 8.0, f"the first placement waited {took[0]:.1f}s on the frozen worker's poll"
    assert max(took[1:]) < 1.0, f"later placements waited on the frozen worker again: {took}"
    assert polls == 1, f"the frozen worker was polled {polls} times, though its first poll never answered"


class _HungColocated(_FakeColocated):
    """A worker that reports room, then hangs before taking the request: the call never
    answers, and its stream ends (its channel's deadline passed)."""

    async def _load(self):
        self.polls += 1
        return self.report(free_blocks=100)

    async def _submit(self, rid, prompt, params, *, subscriber, resume_output=(), priority=0):
        self.submitted.append(request_of(rid))
        self.messages.put_nowait(ConnectionError("silent past the deadline"))
        await asyncio.Event().wait()


def test_a_request_whose_decode_worker_hangs_before_taking_it_is_placed_elsewhere_when_its_stream_ends():
    class _Busier(_FakeColocated):
        async def _load(self):
            return self.report(free_blocks=50)  # so the hung worker is picked first

    async def main():
        hung, live = _HungColocated("decode-0"), _Busier("decode-1")
        dispatcher = _colocated_dispatcher(hung, live)
        task, out = await asyncio.wait_for(_started(dispatcher, live, "r0"), 10.0)
        live.step(("r0", [4], "x", True))
        await asyncio.wait_for(task, 10.0)
        dispatcher.close()
        return hung, out

    hung, out = asyncio.run(main())
    assert hung.submitted == ["r0"], "the hung worker should have been tried first"
    assert out["r0"][-1].finished and out["r0"][-1].error is None, out["r0"]


@pytest.mark.parametrize("placement", ["round_robin", "load"])
def test_nothing_new_is_placed_on_a_draining_worker_even_with_an_affinity_or_a_prefix_there(placement):
    """A worker leaving its pool (``WorkerRef.draining``) is passed over by both
    placements, also where an affinity or a cached prefix points at it."""
    prefills = [WorkerRef("prefill-0", None, draining=True), WorkerRef("prefill-1", None)]
    decodes = [WorkerRef("decode-0", None, draining=True), WorkerRef("decode-1", None)]
    dispatcher = Dispatcher(lambda: prefills, lambda: decodes, DispatchConfig(placement=placement))
    _stage(dispatcher, {w.worker_id: PrefillLoad(w.worker_id, 0, 0, 0, 0, 0) for w in prefills})
    _stage(dispatcher, {w.worker_id: DecodeLoad(w.worker_id, 100, 100, 0, 0, 0) for w in decodes})
    hashes = dispatcher.prefix_hashes(list(range(64)))
    dispatcher.loads.prefill_prefixes.record("prefill-0", hashes)
    dispatcher.loads.decode_prefixes.record("decode-0", hashes)
    for _ in range(4):
        affinity = Affinity(decode="decode-0", prefill="prefill-0")
        assert dispatcher._choose_decode(1, set(), affinity, hashes)[0].worker_id == "decode-1"
        assert dispatcher._choose_prefill(list(range(64)), affinity, hashes).worker_id == "prefill-1"
    prefills[1] = WorkerRef("prefill-1", None, draining=True)
    decodes[1] = WorkerRef("decode-1", None, draining=True)
    assert dispatcher._choose_decode(1, set()) is None and dispatcher._choose_prefill([1] * 40) is None


# -- per-request disaggregation ------------------------------------------------------


class _LocalDecode(_FakeDecode):
    """A decode stand-in that also runs requests whole (``submit``), reporting ``waiting``."""

    def __init__(self, waiting: int = 0) -> None:
        super().__init__(room=True)
        self.release_reserve.set()
        self.waiting = waiting
        self.submitted: list[str] = []
        self.submit = _Method(self._submit)

    async def _load(self):
        return DecodeLoad("decode-0", free_blocks=100, total_blocks=100, running=0, waiting=self.waiting,
                          waiting_for_kv=0)

    async def _submit(self, rid, prompt, params, *, subscriber, resume_output=(), priority=0):
        self.submitted.append(request_of(rid))


class _QueuedPrefill(_FakePrefill):
    def __init__(self, queued: int) -> None:
        super().__init__()
        self.queued = queued

    async def _load(self):
        return PrefillLoad("prefill-0", self.queued, 0, 0, 0, 0)


def _place(prompts: dict[str, list[int]], decode: _LocalDecode, prefill: _FakePrefill, cached: list[int] = (),
           **config) -> Dispatcher:
    """Place each request (in order) until its decode worker took it, then abort it."""

    async def main():
        dispatcher = Dispatcher(lambda: [WorkerRef("prefill-0", prefill)], lambda: [WorkerRef("decode-0", decode)],
                                DispatchConfig(**config))
        if cached:  # the decode worker ran (or received) this prompt before
            dispatcher.loads.decode_prefixes.record(WorkerRef("decode-0", decode).key, dispatcher.prefix_hashes(cached))
        for rid, prompt in prompts.items():
            async def consume():
                async for _ in dispatcher.generate(prompt, SamplingParams(max_tokens=4), rid):
                    pass

            task = asyncio.create_task(consume())
            await _until(lambda: rid in decode.submitted or rid in prefill.prefilled, f"{rid} to be placed")
            assert dispatcher.abort(rid)
            await task
        dispatcher.close()
        return dispatcher

    return asyncio.run(main())


def test_a_short_or_mostly_cached_prompt_is_computed_by_its_decode_worker():
    decode, prefill = _LocalDecode(), _FakePrefill()
    system = list(range(96))  # six blocks the decode worker holds
    prompts = {"short": [7] * 20, "long": list(range(500, 600)), "cached": system + [1, 2, 3, 4]}
    dispatcher = _place(prompts, decode, prefill, cached=system, local_prefill_tokens=32)
    assert decode.submitted == ["short", "cached"], "20 and 4 uncached tokens are computed where they decode"
    assert list(prefill.prefilled) == ["long"] and decode.reserved == set()
    assert dispatcher.num_local_prefills == {"short": 2}


def test_a_busy_prefill_pool_sends_prompts_to_a_decode_worker_with_nothing_waiting():
    prompt = {"r": list(range(200))}
    decode = _LocalDecode()
    dispatcher = _place(prompt, decode, _QueuedPrefill(5000), local_prefill_backlog_tokens=4000)
    assert decode.submitted == ["r"] and dispatcher.num_local_prefills == {"prefill_busy": 1}
    prefill = _QueuedPrefill(5000)  # a decode worker with requests waiting takes none more
    _place(prompt, _LocalDecode(waiting=1), prefill, local_prefill_backlog_tokens=4000)
    assert list(prefill.prefilled) == ["r"]
    prefill = _QueuedPrefill(3000)  # under the backlog: disaggregated as usual
    _place(prompt, _LocalDecode(), prefill, local_prefill_backlog_tokens=4000)
    assert list(prefill.prefilled) == ["r"]


def test_every_request_is_disaggregated_with_both_rules_off():
    decode, prefill = _LocalDecode(), _FakePrefill()
    _place({"a": [1] * 3, "b": [2] * 40}, decode, prefill)
    assert decode.submitted == [] and list(prefill.prefilled) == ["a", "b"]


# -- workers that switched roles -----------------------------------------------------


class _SwitchedDecode(_FakeDecode):
    """A decode stand-in now at epoch ``epoch``: a reservation made for another epoch is
    refused untouched; its load (polled before it switched) says it has the most room."""

    def __init__(self, epoch: int, free: int = 100) -> None:
        super().__init__(room=True)
        self.release_reserve.set()
        self.epoch, self.free = epoch, free

    async def _load(self, epoch=None):
        return DecodeLoad("decode-x", free_blocks=self.free, total_blocks=200, running=0, waiting=0, waiting_for_kv=0)

    async def _reserve(self, rid, prompt, params, *, epoch=None, **kwargs):
        if epoch != self.epoch:
            raise StalePlacement(f"placed for epoch {epoch}, the worker is at {self.epoch}")
        return await super()._reserve(rid, prompt, params, **kwargs)


class _SwitchedPrefill(_FakePrefill):
    def __init__(self, epoch: int, queued: int) -> None:
        super().__init__()
        self.epoch, self.queued, self.refused = epoch, queued, 0

    async def _load(self, epoch=None):
        return PrefillLoad("prefill-x", self.queued, 0, 0, 0, 0)

    async def _prefill(self, rid, prompt, params, *, epoch=None, **kwargs):
        if epoch != self.epoch:
            self.refused += 1
            raise StalePlacement(f"placed for epoch {epoch}, the worker is at {self.epoch}")
        await super()._prefill(rid, prompt, params, **kwargs)


def test_placements_refused_as_stale_by_switched_workers_go_to_the_next_worker_of_each_role():
    """A router whose list is older than two switches places by it: the decode worker and
    the prefill worker it would choose refuse (their epochs moved on), and the request's
    reservation and prefill land on the next of each, exactly once."""
    stale_decode, decode = _SwitchedDecode(epoch=1, free=190), _SwitchedDecode(epoch=0)
    stale_prefill, prefill = _SwitchedPrefill(epoch=1, queued=0), _SwitchedPrefill(epoch=0, queued=500)
    prefills = [WorkerRef("prefill-0", stale_prefill, epoch=0), WorkerRef("prefill-1", prefill, epoch=0)]
    decodes = [WorkerRef("decode-0", stale_decode, epoch=0), WorkerRef("decode-1", decode, epoch=0)]

    async def main():
        dispatcher = Dispatcher(lambda: prefills, lambda: decodes, DispatchConfig())

        async def consume():
            async for _ in dispatcher.generate(list(range(40)), SamplingParams(max_tokens=4), "r1"):
                pass

        task = asyncio.create_task(consume())
        await _until(lambda: "r1" in prefill.prefilled, "the prefill to reach the worker that is still one")
        assert dispatcher.abort("r1")
        await task
        dispatcher.close()
        return dispatcher

    dispatcher = asyncio.run(main())
    assert stale_prefill.refused == 1 and not stale_prefill.prefilled
    assert not stale_decode.priorities and list(decode.priorities) == ["r1"], "reserved once, on the worker that is one"
    assert prefill.prefilled["r1"][0] == "reservation-r1", "the reservation of the decode worker that took it"
    assert dispatcher.num_stale_placements == 2


@pytest.mark.parametrize("state", [TransferState.DONE, TransferState.FAILED])
def test_a_prefill_that_ends_without_handing_over_its_kv_tells_the_decode_worker(state):
    """A prefill worker's failed result (one that retired, refused the prompt or could not
    send) is no exception, but its KV will not come either: the decode worker is told at
    once instead of waiting out the reservation's deadline."""

    async def main():
        prefill, decode = _FakePrefill(), _DyingDecode("decode-0")
        prefill.state = state
        failed: list[str] = []

        async def transfer_failed(aid):
            failed.append(aid)

        decode.transfer_failed = _Method(transfer_failed)
        dispatcher = Dispatcher(
            lambda: [WorkerRef("prefill-0", prefill)], lambda: [WorkerRef("decode-0", decode)], DispatchConfig()
        )
        task = asyncio.create_task(_collect(dispatcher, "r1", {}))
        await _until(lambda: "r1" in prefill.prefilled, "the prefill to be sent")
        for _ in range(5):
            await asyncio.sleep(0)  # its result reaches the dispatcher
        dispatcher.abort("r1")
        await task
        dispatcher.close()
        return decode, failed

    decode, failed = asyncio.run(main())
    told = [request_of(a) for a in failed]
    assert told == (["r1"] if state == TransferState.FAILED else []), f"transfer_failed calls: {failed}"
    assert failed == decode.attempts[: len(failed)], "the attempt the decode worker reserved is the one told"
