"""A pool worker switching roles in this process (no Ray): its model and KV cache stay,
every block comes back, and calls made by an out-of-date view of it are refused before
anything is done (``StalePlacement``)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from cluster.pool_worker import PoolWorker
from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.wire.messages import DecodeLoad, PrefillLoad, StalePlacement
from kv_transfer.config import TransferConfig
from tests.helpers import PATIENCE_S

PROMPT = list(range(5, 45))
SHORT = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def configs(tiny_model) -> dict[str, EngineConfig]:
    decode = EngineConfig(model=tiny_model, num_kv_blocks=64, max_num_seqs=4)
    return {"prefill": dataclasses.replace(decode, max_num_batched_tokens=256, max_num_seqs=2), "decode": decode}


@pytest.fixture(scope="module")
def reference(configs) -> list[int]:
    engine = LLMEngine(configs["decode"])
    engine.add_request(PROMPT, SHORT, request_id="ref")
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.token_ids
    return tokens


async def _run(worker: PoolWorker, rid: str, params: SamplingParams, epoch: int, stop_after: int | None = None):
    """Submit a whole request and read its tokens from the worker's stream; with
    ``stop_after``, return (the tokens so far, the stream) after that many messages."""
    stream = worker.subscribe(f"router-{rid}")
    await worker.submit(rid, PROMPT, params, subscriber=f"router-{rid}", epoch=epoch)
    tokens, finished = [], False
    async for _, deltas in stream:
        for delta in deltas:
            tokens += delta[1]
            finished = finished or delta[3]
        if finished:
            await stream.aclose()
            return tokens, None
        if stop_after is not None and (stop_after := stop_after - 1) == 0:
            return tokens, stream
    return tokens, None


def test_a_worker_switches_roles_in_place_and_refuses_what_was_placed_by_an_older_view(configs, reference):
    actor_class = type("PoolWorker", (PoolWorker,), {})  # Ray's subclass in the actor's process, its own

    async def scenario():
        worker = actor_class("decode", "decode-0", configs, TransferConfig(backend="inprocess"))
        await worker.ready()
        assert type(worker).__name__ == "decode-0:DecodeWorker", "ps shows ray::<its class name> between calls"
        engine, model = worker.worker.engine, worker.worker.engine.model
        assert isinstance(await worker.load(epoch=0), DecodeLoad)
        assert (await _run(worker, "a", SHORT, epoch=0))[0] == reference
        with pytest.raises(StalePlacement, match="decode worker at epoch 0"):
            await worker.prefill("p", PROMPT, SHORT, decode_worker=None, reservation=None, epoch=0)  # not a prefill worker
        with pytest.raises(StalePlacement, match="made for epoch 3"):
            await worker.reserve("r", PROMPT, SHORT, subscriber="router-r", epoch=3)

        # Switched while a long request streams (its drain ran out): the stream ends, the
        # request is aborted, and every block comes back before the engine resets.
        partial, stream = await _run(worker, "b", LONG, epoch=0, stop_after=2)
        assert 0 < len(partial) < LONG.max_tokens
        info = await worker.switch_role("prefill", "prefill-1")
        assert info["epoch"] == 1 and info["worker_id"] == "prefill-1" and not info["idle"]
        assert type(worker).__name__ == "prefill-1:PrefillWorker" and PoolWorker.__name__ == "PoolWorker"
        assert [m async for m in stream] == [], "the old role's stream ends once it has retired"
        assert worker.worker.engine is engine and engine.model is model, "nothing is reloaded"
        assert engine.kv_manager.pool.num_used_blocks == 0 and engine.kv_manager.pool.num_cached_blocks == 0
        assert engine.scheduler.config.max_num_seqs == 2, "the prefill role's scheduler settings"
        assert isinstance(await worker.load(epoch=1), PrefillLoad)
        with pytest.raises(StalePlacement):
            await worker.load(epoch=0)  # a router's poll by its old view: no decode load from a prefill worker
        with pytest.raises(StalePlacement):
            await worker.submit("c", PROMPT, SHORT, subscriber="router-c", epoch=1)  # no such call for prefill

        # And back: the same greedy tokens, from an empty prefix cache.
        assert (await worker.switch_role("decode", "decode-2"))["epoch"] == 2
        assert (await _run(worker, "d", SHORT, epoch=2))[0] == reference
        assert (await worker.stats())["prefix_cache_hits"] == 0

        await worker.drain()  # leaving its pool: placements are refused, polls answered
        with pytest.raises(StalePlacement, match="draining"):
            await worker.submit("e", PROMPT, SHORT, subscriber="router-e", epoch=2)
        assert isinstance(await worker.load(epoch=2), DecodeLoad)
        assert (await worker.stats())["num_blocks_in_use"] == 0
        await worker.worker.async_engine.stop()

    asyncio.run(scenario())


def test_a_call_during_a_switch_waits_until_the_new_role_is_ready(configs):
    """A call that arrives while the worker switches reaches the new role only once that
    role is ready (its step thread and, for decode, its token channel started): before,
    a reservation could land on a decode worker whose channel was not listening yet."""

    async def scenario():
        worker = PoolWorker("prefill", "prefill-0", configs, TransferConfig(backend="inprocess"))
        await worker.ready()
        gate, readied = asyncio.Event(), asyncio.Event()
        make = worker._make

        def gated_make(*args, **kwargs):
            new = make(*args, **kwargs)
            ready = new.ready

            async def gated_ready():
                readied.set()
                await gate.wait()
                return await ready()

            new.ready = gated_ready
            return new

        worker._make = gated_make
        switch = asyncio.ensure_future(worker.switch_role("decode", "decode-1"))
        await asyncio.wait_for(readied.wait(), PATIENCE_S)
        poll = asyncio.ensure_future(worker.load(epoch=1))
        for _ in range(20):
            await asyncio.sleep(0.01)
        answered_before_ready = poll.done()
        gate.set()
        info, load = await asyncio.wait_for(asyncio.gather(switch, poll), PATIENCE_S)
        await worker.worker.async_engine.stop()
        return answered_before_ready, info, load

    answered_before_ready, info, load = asyncio.run(scenario())
    assert not answered_before_ready, "a call reached the new role before it was ready"
    assert info["epoch"] == 1 and isinstance(load, DecodeLoad)


def test_every_call_of_each_role_is_declared_on_the_pool_worker_with_its_parameters_and_the_epoch():
    """grep finds each call a router or the cluster makes on a pool worker, and a role's new
    public method cannot be left unreachable: each is declared on ``PoolWorker`` with the
    role's parameters, in order, of the same kind (keyword-only where the role's are) and
    default, and a keyword-only ``epoch`` last. ``retire`` is the switch's own."""
    import inspect

    from cluster.pool_worker import ROLE_CLASSES

    def parameters(fn) -> list[tuple[str, object, object]]:
        # (Ray's tracing adds a _ray_trace_ctx parameter to actor classes' methods in place.)
        return [(p.name, p.kind, p.default) for p in list(inspect.signature(fn).parameters.values())[1:]
                if not p.name.startswith("_ray")]

    calls = {name: fn for cls in ROLE_CLASSES.values()
             for name, fn in inspect.getmembers(cls, inspect.iscoroutinefunction) if not name.startswith("_")}
    internal = {"retire", "drain"}  # drain is the pool worker's own too (it fences placements first)
    epoch = ("epoch", inspect.Parameter.KEYWORD_ONLY, None)
    for name, fn in sorted(calls.items()):
        if name in internal:
            continue
        declared = vars(PoolWorker).get(name)
        assert declared is not None, f"PoolWorker does not declare the role call {name}"
        assert parameters(declared) == [*parameters(fn), epoch], (
            f"{name}: {parameters(declared)} != the role's {parameters(fn)} + {epoch}")
    assert "retire" not in vars(PoolWorker), "a caller must not retire a role but through switch_role"
