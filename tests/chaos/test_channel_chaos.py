"""Chaos on the token channel: a decode worker that freezes, a router that stops reading.

Each scenario runs its own small service with short channel timings (the topology's
``channel:`` section) and ends as every chaos scenario does: each stream either
completed with the undisturbed greedy text (a single engine's, run on the same prompts)
or ended with a clear error, none hung past its deadline or ended silently short, and
afterwards every worker holds no KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import httpx
import ray

from engine.wire.clients import DecodeClient
from tests.chaos.streams import Outcome, blocks_after, difference, model_name, one_stream, workers
from tests.helpers import PATIENCE_S, async_wait_for, running_service

DEADLINE_S = 60.0  # per request: past this it counts as hung
WORDS = ["alpha", "beta", "gamma", "delta", "kv", "block", "stream", "token", "prefill", "decode"]


def _prompts(n: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice([6, 20, 40]))) for _ in range(n)]


def _reference(model: str, prompts: list[str], lengths: list[int]) -> list[str]:
    """The undisturbed greedy texts, from a single engine."""
    from engine import LLM, SamplingParams

    llm = LLM(model=model, num_kv_blocks=512)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths])
    return [o.text for o in outs]


async def _stream_all(url: str, model: str, prompts, lengths, concurrency: int, chaos,
                      more_until: asyncio.Event | None = None) -> list[Outcome]:
    """Every prompt as a streaming completion, ``concurrency`` at a time, while
    ``chaos(progress)`` runs beside them (it is awaited once they are all over). With
    ``more_until``, the prompts go round again until that event is set, so a chaos that
    waits for the service to reach some state never runs out of load first.
    ``progress``: "finished" and "in_flight" (counts)."""
    progress = {"finished": 0, "in_flight": 0}
    queue = list(range(len(prompts)))
    outcomes: list[Outcome] = []

    async def worker(client):
        while queue or (more_until is not None and not more_until.is_set()):
            if not queue:
                queue.extend(range(len(prompts)))
            i = queue.pop(0)
            progress["in_flight"] += 1
            outcomes.append(await one_stream(client, url, model, Outcome(i), prompts[i], lengths[i], DEADLINE_S))
            progress["in_flight"] -= 1
            progress["finished"] += 1

    async with httpx.AsyncClient(timeout=httpx.Timeout(DEADLINE_S, connect=10)) as client:
        chaos_task = asyncio.create_task(chaos(progress))
        try:
            await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        finally:
            progress["over"] = True
            await chaos_task
    return sorted(outcomes, key=lambda o: o.index)


def _judge(name: str, outcomes: list[Outcome], want: list[str], svc) -> None:
    """None hung, every one complete with the reference text (none may fail here), and
    no KV block left in use on any worker."""
    hung = [f"{o.index} ({o.chunks} chunks)" for o in outcomes if o.hung]
    errored = {o.index: o.error for o in outcomes if not o.hung and o.error is not None}
    wrong = [o for o in outcomes if not o.hung and o.error is None
             and (o.text != want[o.index] or o.finish_reason != "length")]
    leaked = blocks_after(svc)
    print(f"\nchaos[{name}]: sent {len(outcomes)}, completed {len(outcomes) - len(hung) - len(errored)}, "
          f"errored {len(errored)}, hung {len(hung)}, blocks leaked {leaked}")
    assert {o.index for o in outcomes} == set(range(len(want))), "a prompt was never sent"
    assert not hung, f"requests hung past {DEADLINE_S}s: {hung}"
    assert not wrong, "ended without error but not the reference text: " + "; ".join(
        difference(o, want[o.index]) for o in wrong)
    assert not errored, f"requests failed where they could have moved on: {errored}"
    assert leaked == 0, f"{leaked} KV blocks still in use: {svc.blocks_in_use()}"


# ------------------------------------------------------------------ a frozen decode worker

FROZEN = dict(
    prefill_workers=1, decode_workers=2, restart_workers=False,
    channel={"heartbeat_s": 0.2, "heartbeat_timeout_s": 2.0, "reconnect_grace_s": 2.0},
)


def test_a_frozen_decode_worker_s_streams_move_to_the_other_and_it_frees_their_blocks_when_thawed(
    ray_cluster, tiny_model, metrics_dir,
):
    """A decode worker stopped with SIGSTOP mid-stream (alive to Ray, its TCP port still
    accepting, but silent) is declared dead by the router within the channel's deadlines
    (heartbeat_timeout_s, then a reconnect that gets no answer within reconnect_grace_s);
    its streams move to the other decode worker and finish with the undisturbed text, and
    requests placed while it is frozen do not wait on it. Thawed (SIGCONT) at the end, it
    finds its subscriber gone and frees the blocks of the requests it lost."""
    from tests.helpers import metric_sum, scrape

    n, concurrency = 12, 6
    prompts = _prompts(n, seed=11)
    lengths = [48 + 4 * (i % 5) for i in range(n)]
    want = _reference(tiny_model, prompts, lengths)
    before = metric_sum(scrape(metrics_dir), "tandem:request_migrations_total")
    with running_service(tiny_model, **FROZEN) as svc:
        _, (victim, _) = workers(svc)
        pid = ray.get(victim.handle.ready.remote())["pid"]
        frozen = {"at": None}

        async def chaos(progress):
            async def streaming():
                load = await victim.handle.load.remote()
                return progress.get("over") or (progress["finished"] >= 2 and load.running >= 2)

            try:
                await async_wait_for(streaming, PATIENCE_S, "the victim streaming 2 requests", every_s=0.05)
                if progress.get("over"):
                    return
                os.kill(pid, signal.SIGSTOP)
                frozen["at"] = time.monotonic()
                while not progress.get("over"):  # frozen until every request is over (or hung)
                    await asyncio.sleep(0.1)
            finally:
                os.kill(pid, signal.SIGCONT)

        try:
            t0 = time.monotonic()
            outcomes = asyncio.run(_stream_all(svc.http_url, model_name(tiny_model), prompts, lengths,
                                               concurrency, chaos))
            took = time.monotonic() - t0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert frozen["at"] is not None, "the victim was never caught streaming"
        print(f"\nfrozen decode worker: the load took {took:.1f}s, "
              f"{took - (frozen['at'] - t0):.1f}s of it with the victim frozen")
        _judge("frozen decode worker", outcomes, want, svc)
        moved = metric_sum(scrape(metrics_dir), "tandem:request_migrations_total") - before
        assert moved > 0, "the freeze should have caught streams mid-way and moved them"


# ------------------------------------------------------------------ a router that stops reading

SLOW = dict(
    prefill_workers=1, decode_workers=1, restart_workers=False,
    # Small bounds: a subscriber that stops acknowledging holds up its sending after 32 KiB
    # unacknowledged; its outbox then passes 64 outputs, and after 1 s it is cut off.
    channel={"heartbeat_s": 0.2, "heartbeat_timeout_s": 5.0, "reconnect_grace_s": 2.0,
             "max_unacked_bytes": 32768, "max_pending_outputs": 64, "slow_subscriber_s": 1.0},
)


def test_a_router_that_stops_reading_is_cut_off_and_its_blocks_freed_while_the_real_router_s_streams_complete(
    ray_cluster, tiny_model,
):
    """A second "router" (this test) subscribes to the decode worker's token channel,
    routes 4 long requests to it (``submit``), reads a few step messages, then stops
    reading while its connection stays alive (its heartbeats keep coming). The worker
    holds its sending at ``max_unacked_bytes``; its outbox passes ``max_pending_outputs``
    and, after ``slow_subscriber_s``, the worker cuts it off: its requests are aborted
    (none finishes) and their blocks freed, and once it reads again its stream brings a
    CUT notice and then ends (the channel lost). Meanwhile the service's own router,
    streaming through the same worker, completes every request with the undisturbed text
    (its prompts go round until the cut lands, so its streams are running then)."""
    from engine import SamplingParams
    from engine.wire.token_channel import ChannelConfig, ChannelLost, Notice, NoticeKind, connect

    n, concurrency = 10, 4
    prompts = _prompts(n, seed=5)
    lengths = [40 + 4 * (i % 4) for i in range(n)]
    want = _reference(tiny_model, prompts, lengths)
    with running_service(tiny_model, **SLOW) as svc:
        _, (decode,) = workers(svc)
        address = ray.get(decode.handle.token_channel.remote())
        assert address is not None, "the decode worker has no token channel"
        tokenizer = _tokenizer(tiny_model)
        stalled = {f"stalled-{i}": tokenizer.encode(p) for i, p in enumerate(_prompts(4, seed=9))}
        cut_seen: asyncio.Event | None = None
        seen = {"messages": 0, "finished": [], "notices": [], "end": None, "progress": {}, "in_flight_at_cut": None}

        async def stalled_router(messages) -> None:
            """Read until tokens flow for every stalled request, stop reading until the
            worker cuts us off, then read what is left."""
            it = aiter(messages)

            async def read_one() -> None:
                message = await anext(it)
                if isinstance(message, Notice):
                    seen["notices"].append(message.kind)
                    return
                seen["messages"] += 1
                seen["finished"] += [item[0] for item in message[1] if item[3]]

            while seen["messages"] < 3:
                await read_one()

            async def cut() -> bool:
                return (await decode.handle.stats.remote())["subscribers_cut_off"] >= 1

            await async_wait_for(cut, PATIENCE_S, "the worker to cut the stalled router off", every_s=0.1)
            seen["in_flight_at_cut"] = seen["progress"].get("in_flight")
            cut_seen.set()
            try:
                while True:
                    await asyncio.wait_for(read_one(), PATIENCE_S)
            except (ChannelLost, StopAsyncIteration) as e:
                seen["end"] = type(e).__name__

        async def watch(progress) -> None:  # the real router's progress, for the stalled reader
            seen["progress"] = progress

        async def main():
            nonlocal cut_seen
            cut_seen = asyncio.Event()
            messages = await connect(address, "stalled-router",
                                     ChannelConfig(heartbeat_s=0.2, heartbeat_timeout_s=PATIENCE_S))
            params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
            for rid, ids in stalled.items():
                await DecodeClient(decode.handle).submit(rid, ids, params, subscriber="stalled-router")
            reader = asyncio.create_task(stalled_router(messages))
            try:
                outcomes = await _stream_all(svc.http_url, model_name(tiny_model), prompts, lengths,
                                             concurrency, watch, more_until=cut_seen)
                await asyncio.wait_for(reader, PATIENCE_S)
            finally:
                reader.cancel()
                await messages.aclose()
            return outcomes

        outcomes = asyncio.run(main())
        print(f"\nstalled router: {seen['messages']} step messages read, notices {seen['notices']}, "
              f"ended with {seen['end']}; cut off with {seen['in_flight_at_cut']} real requests in flight, "
              f"{len(outcomes)} sent in all")
        assert NoticeKind.CUT in seen["notices"], f"no CUT notice reached the stalled router: {seen['notices']}"
        assert seen["end"] == "ChannelLost", "the stalled router's stream should end once it is cut off"
        assert not seen["finished"], f"cut-off requests finished: {seen['finished']}"
        assert seen["in_flight_at_cut"], (
            f"the real router's streams should be running when the stalled router is cut off "
            f"({seen['in_flight_at_cut']} in flight then)")
        _judge("router stops reading", outcomes, want, svc)


def _tokenizer(model: str):
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(model)
