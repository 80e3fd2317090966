"""The token channel: step messages from a worker to a router over TCP."""

import asyncio
import dataclasses
import socket
import struct

import pytest

from engine import token_channel
from engine.token_channel import ChannelServer


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


def test_a_subscriber_reads_its_messages_in_order_and_a_hang_up_ends_its_serving():
    async def main():
        worker = Worker()
        server = ChannelServer(worker.serve)
        address = await server.start()
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
        worker = Worker()
        server = ChannelServer(worker.serve)
        address = await server.start()
        messages = await token_channel.connect(address, "router-1")
        await _until(lambda: "router-1" in worker.queues)
        worker.queues["router-1"].put_nowait((None, [("r", [1], "", True)]))
        worker.queues["router-1"].put_nowait(None)  # the worker ends the stream (it is going away)
        assert await anext(messages) == (None, [("r", [1], "", True)])
        with pytest.raises(asyncio.IncompleteReadError):
            await anext(messages)
        server.close()

    asyncio.run(main())


def test_a_wrong_secret_or_a_missing_subscriber_is_turned_away_unserved():
    async def main():
        worker = Worker()
        server = ChannelServer(worker.serve)
        address = await server.start()
        forged = dataclasses.replace(address, secret="0" * len(address.secret))
        for target, subscriber in [(forged, "intruder"), (address, "")]:
            messages = await token_channel.connect(target, subscriber)
            with pytest.raises(asyncio.IncompleteReadError):
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


def test_a_subscriber_that_resets_its_connection_is_dropped_too():
    async def main():
        worker = Worker()
        server = ChannelServer(worker.serve)
        address = await server.start()
        reader, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(f"{address.secret} router-4\n".encode())
        await _until(lambda: worker.served == ["router-4"])
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
        writer.transport.abort()
        await _until(lambda: worker.left == ["router-4"])
        server.close()

    asyncio.run(main())
