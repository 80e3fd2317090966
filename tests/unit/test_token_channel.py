"""The token channel: step messages from a worker to a router over TCP."""

import asyncio
import dataclasses
import pickle
import socket
import struct

import pytest

from engine import token_channel
from engine.token_channel import ChannelConfig, ChannelLost, ChannelServer, Notice, NoticeKind

# Timings small enough for a test to see each deadline pass, large enough for a loaded machine.
FAST = ChannelConfig(heartbeat_s=0.05, heartbeat_timeout_s=1.0, reconnect_grace_s=1.0)


class Worker:
    """Serves each subscriber the messages queued for it, and records who came and went."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue] = {}
        self.served: list[str] = []
        self.left: list[str] = []

    async def serve(self, subscriber, send) -> None:
        self.served.append(subscriber)
        queue = self.queues.setdefault(subscriber, asyncio.Queue())
        try:
            while (message := await queue.get()) is not None:
                await send(message)
        finally:
            self.left.append(subscriber)


async def _until(condition, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _listening() -> tuple[Worker, ChannelServer, token_channel.ChannelAddress]:
    """A ``Worker``'s channel server, started."""
    worker = Worker()
    server = ChannelServer(worker.serve)
    return worker, server, await server.start()


def test_a_subscriber_reads_its_messages_in_order_and_a_hang_up_ends_its_serving():
    async def main():
        worker, server, address = await _listening()
        assert address.host == "127.0.0.1" and address.port > 0
        worker.queues["router-0"] = queue = asyncio.Queue()
        big = ("x" * 200_000, list(range(10_000)))  # more than a socket buffer holds
        for message in [(None, [("r1", [5], "a", False)]), big, ({"load": 3}, [])]:
            queue.put_nowait(message)
        messages = await token_channel.connect(address, "router-0")
        got = [await anext(messages) for _ in range(3)]
        assert got == [(None, [("r1", [5], "a", False)]), big, ({"load": 3}, [])]
        assert worker.served == ["router-0"] and worker.left == []
        await messages.aclose()  # the router goes away
        await _until(lambda: worker.left == ["router-0"])
        server.close()

    asyncio.run(main())


def test_the_router_sees_the_end_of_the_stream_when_the_worker_stops_serving_it():
    async def main():
        worker, server, address = await _listening()
        messages = await token_channel.connect(address, "router-1")
        await _until(lambda: "router-1" in worker.queues)
        worker.queues["router-1"].put_nowait((None, [("r", [1], "", True)]))
        worker.queues["router-1"].put_nowait(None)  # the worker ends the stream (it is going away)
        assert await anext(messages) == (None, [("r", [1], "", True)])
        with pytest.raises(ChannelLost):  # it tries to resume; the worker no longer knows the session
            await anext(messages)
        server.close()

    asyncio.run(main())


def test_a_wrong_secret_or_a_missing_subscriber_is_turned_away_unserved():
    async def main():
        worker, server, address = await _listening()
        forged = dataclasses.replace(address, secret="0" * len(address.secret))
        for target, subscriber in [(forged, "intruder"), (address, "")]:
            messages = await token_channel.connect(target, subscriber)
            with pytest.raises(ChannelLost):
                await anext(messages)
        assert worker.served == []
        server.close()

    asyncio.run(main())


def test_connecting_where_nothing_listens_raises_oserror_at_once():
    async def main():
        server = ChannelServer(Worker().serve)
        address = await server.start()
        server.close()
        await server._server.wait_closed()
        with pytest.raises(OSError):
            await token_channel.connect(address, "router-2")

    asyncio.run(main())


def test_a_wildcard_listener_advertises_the_address_routers_should_use():
    async def main():
        server = ChannelServer(Worker().serve)
        address = await server.start("0.0.0.0", advertise="127.0.0.1")
        assert address.host == "127.0.0.1"
        messages = await token_channel.connect(address, "router-3")
        await messages.aclose()
        server.close()

    asyncio.run(main())


def test_a_subscriber_that_resets_its_connection_is_dropped_once_the_grace_has_passed():
    async def main():
        worker = Worker()
        server = ChannelServer(worker.serve, FAST)
        address = await server.start()
        reader, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(f"{address.secret} router-4 new\n".encode())
        await _until(lambda: worker.served == ["router-4"])
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
        writer.transport.abort()
        await _until(lambda: server.state("router-4") == "detached")
        assert worker.left == [], "a dropped connection must wait for a reconnect, not end the serving at once"
        await _until(lambda: worker.left == ["router-4"])  # reconnect_grace_s later
        assert server.state("router-4") is None
        server.close()

    asyncio.run(main())


def _queue(worker: Worker, subscriber: str, messages: list) -> None:
    for message in messages:
        worker.queues[subscriber].put_nowait(message)


async def _subscribed(subscriber: str) -> tuple[Worker, ChannelServer, object]:
    """A worker serving on a fast channel, and ``subscriber``'s messages from it once served."""
    worker = Worker()
    server = ChannelServer(worker.serve, FAST)
    address = await server.start()
    messages = await token_channel.connect(address, subscriber, FAST)
    await _until(lambda: subscriber in worker.queues)
    return worker, server, messages


def test_a_dropped_connection_is_resumed_with_nothing_lost_or_repeated():
    async def main():
        worker, server, messages = await _subscribed("router-5")
        _queue(worker, "router-5", [(None, [("r", [i], "", False)]) for i in range(1, 6)])
        got = [await anext(messages)]
        await _until(lambda: server._sessions["router-5"].sent == 5)  # all five written, four unread
        server.disconnect("router-5")  # the blip: what was in flight is gone with the connection
        _queue(worker, "router-5", [(None, [("r", [i], "", i == 8)]) for i in range(6, 9)])
        while len(got) < 9:
            got.append(await anext(messages))
        await messages.aclose()
        await _until(lambda: worker.left == ["router-5"])
        server.close()
        return got, worker.served

    got, served = asyncio.run(main())
    notices = [m for m in got if isinstance(m, Notice)]
    tokens = [m[1][0][1][0] for m in got if not isinstance(m, Notice)]
    assert [n.kind for n in notices] == [NoticeKind.RESUMED], f"one resume expected, got {notices}"
    assert tokens == list(range(1, 9)), f"every message once, in order: got {tokens}"
    assert served == ["router-5"], "the serving must carry on across the reconnect, not start again"


def test_a_router_that_goes_silent_is_dropped_by_the_heartbeat_deadline():
    """A router host that vanished (or a hung router) keeps its connection open but sends
    no acknowledgements: the worker gives up on it after heartbeat_timeout_s (and the grace)."""

    async def main():
        worker = Worker()
        server = ChannelServer(worker.serve, FAST)
        address = await server.start()
        reader, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(f"{address.secret} router-6 new\n".encode())  # then nothing, ever
        await _until(lambda: worker.served == ["router-6"])
        frames = []
        await _until(lambda: server.state("router-6") == "detached")
        await _until(lambda: worker.left == ["router-6"])
        while (data := await reader.read(65536)):
            frames.append(data)
        writer.close()
        server.close()
        return b"".join(frames)

    sent = asyncio.run(main())
    assert sent == token_channel.frame(None) * (len(sent) // len(token_channel.frame(None))) and sent, \
        "the idle worker must have sent heartbeats, and nothing else"


def test_a_worker_that_goes_silent_ends_the_routers_stream_after_the_deadline_and_grace():
    """A hung worker: its connection stays open, and it even accepts new ones, but says
    nothing. The router notices by the heartbeat deadline, cannot resume, and gives up."""

    async def main():
        held = []

        async def hung(reader, writer):
            held.append(writer)  # keep the connection open and never answer

        server = await asyncio.start_server(hung, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        address = token_channel.ChannelAddress("127.0.0.1", port, "s")
        loop = asyncio.get_running_loop()
        messages = await token_channel.connect(address, "router-7", FAST)
        t0 = loop.time()
        with pytest.raises(ChannelLost):
            await anext(messages)
        waited = loop.time() - t0
        server.close()
        return waited, len(held)

    waited, connections = asyncio.run(main())
    assert connections == 2, "the router must try once to resume before it gives up"
    assert FAST.heartbeat_timeout_s <= waited < 5, f"gave up after {waited:.2f}s"


def test_heartbeats_keep_an_idle_connection_open():
    async def main():
        worker, server, messages = await _subscribed("router-8")
        idle = 3 * FAST.heartbeat_timeout_s  # several deadlines with nothing to send either way
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(anext(messages), idle)
        # Cancelling the read closed the iterator; the session ended with it, never dropped before.
        await _until(lambda: worker.left == ["router-8"])
        server.close()
        return server.num_resumed

    assert asyncio.run(main()) == 0, "an idle connection must never have been dropped and resumed"


def test_a_resume_the_worker_cannot_honour_is_refused_with_a_gone_notice():
    async def main():
        server = ChannelServer(Worker().serve, FAST)
        address = await server.start()
        reader, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(f"{address.secret} router-9 12\n".encode())  # a session it never had
        data = await reader.read()
        writer.close()
        server.close()
        return data

    data = asyncio.run(main())
    number, notice = pickle.loads(data[4:])
    assert number == 0 and notice.kind is NoticeKind.GONE, notice


def test_channel_settings_are_checked():
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        ChannelConfig(heartbeat_s=2, heartbeat_timeout_s=1)
    with pytest.raises(ValueError, match="max_pending_outputs"):
        ChannelConfig(max_pending_outputs=0)
    with pytest.raises(ValueError, match="unknown channel settings"):
        ChannelConfig.from_dict({"heartbeat": 1})


def test_the_topologys_channel_settings_reach_the_workers_and_the_routers():
    from cluster.config import ClusterConfig

    cluster = ClusterConfig.from_dict({"channel": {"heartbeat_s": 0.5, "reconnect_grace_s": 3}})
    assert cluster.channel == ChannelConfig(heartbeat_s=0.5, reconnect_grace_s=3)
    assert cluster.dispatch_settings()["channel"] is cluster.channel, "the routers must get the same settings"
