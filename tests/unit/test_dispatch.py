"""The dispatcher's cancellation paths, with in-process stand-ins for worker actors."""

from __future__ import annotations

import asyncio

from decode_worker.worker import DecodeLoad
from engine.sampling_params import SamplingParams
from prefill_worker.worker import PrefillLoad
from router.dispatch import DispatchConfig, Dispatcher, WorkerRef


class _Method:
    """``handle.method.remote(...)`` -> an awaitable, like a Ray actor method."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return asyncio.ensure_future(self.fn(*args))

    def options(self, **_):
        return self


class _FakeDecode:
    def __init__(self) -> None:
        self.reserve_started = asyncio.Event()
        self.release_reserve = asyncio.Event()
        self.reserved: set[str] = set()
        self.aborted: list[str] = []
        self.load = _Method(self._load)
        self.reserve = _Method(self._reserve)
        self.abort = _Method(self._abort)

    async def _load(self):
        return DecodeLoad("decode-0", free_blocks=100, total_blocks=100, running=0, waiting=0, waiting_for_kv=0)

    async def _reserve(self, rid, prompt, params):
        self.reserve_started.set()
        await self.release_reserve.wait()
        self.reserved.add(rid)
        return None  # no room: the dispatcher would wait and try again

    async def _abort(self, rid):
        self.aborted.append(rid)
        self.reserved.discard(rid)


class _FakePrefill:
    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.load = _Method(self._load)
        self.abort = _Method(self._abort)

    async def _load(self):
        return PrefillLoad("prefill-0", 0, 0, 0, 0, 0)

    async def _abort(self, rid):
        self.aborted.append(rid)


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
        for _ in range(50):  # the aborts are fire-and-forget
            await asyncio.sleep(0.01)
        dispatcher.close()
        return decode, prefill

    decode, prefill = asyncio.run(main())
    assert decode.aborted == ["r1"] and prefill.aborted == ["r1"]
    assert not decode.reserved, "the reservation must not outlive the request"
