"""The token channel: step messages from a worker to a router over TCP."""

import asyncio
import dataclasses
import pickle
import socket
import struct

import msgspec
import pytest

from engine.wire import channel_wire as wire
from engine.wire import token_channel
from engine.wire.messages import DecodeLoad, StreamDelta
from engine.wire.token_channel import ChannelConfig, ChannelLost, ChannelServer, Notice, NoticeKind

# Timings small enough for a test to see each deadline pass, large enough for a loaded machine.
FAST = ChannelConfig(heartbeat_s=0.05, heartbeat_timeout_s=1.0, reconnect_grace_s=1.0)


def _step(rid: str, tokens: list[int], text: str = "", finished: bool = False, load=None) -> tuple:
    """One step message (a ``StepMessage``) with one request's delta."""
    return load, [StreamDelta(rid, tokens, text, finished)]


async def _greeted(address, subscriber: str, resume: str = "new"):
    """A raw connection that has done the router's handshake: (reader, writer, incoming seal,
    outgoing seal)."""
    reader, writer = await asyncio.open_connection(address.host, address.port)
    incoming, outgoing = await wire.router_handshake(reader, writer, address.secret, subscriber, resume)
    return reader, writer, incoming, outgoing


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
        big = _step("r2", list(range(10_000)), "x" * 200_000)  # more than a socket buffer holds
        load = DecodeLoad("decode-0", free_blocks=3, total_blocks=9, running=1, waiting=0, waiting_for_kv=0)
        sent = [_step("r1", [5], "a"), big, (load, [])]
        for message in sent:
            queue.put_nowait(message)
        messages = await token_channel.connect(address, "router-0")
        got = [await anext(messages) for _ in range(3)]
        assert got == sent
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
        worker.queues["router-1"].put_nowait(_step("r", [1], finished=True))
        worker.queues["router-1"].put_nowait(None)  # the worker ends the stream (it is going away)
        assert await anext(messages) == _step("r", [1], finished=True)
        with pytest.raises(ChannelLost):  # it tries to resume; the worker no longer knows the session
            await anext(messages)
        server.close()

    asyncio.run(main())


def test_a_wrong_secret_or_a_missing_subscriber_is_turned_away_unserved():
    async def main():
        worker, server, address = await _listening()
        forged = dataclasses.replace(address, secret="0" * len(address.secret))
        with pytest.raises(ChannelLost, match="does not hold the channel's secret"):
            await token_channel.connect(forged, "intruder")  # the worker's proof fails the router's check
        messages = await token_channel.connect(address, "")
        with pytest.raises(ChannelLost):
            await anext(messages)
        assert worker.served == []
        server.close()

    asyncio.run(main())


def test_a_stranger_without_the_secret_is_closed_on_unserved_after_its_proof():
    """The worker answers anyone's nonce with its proof, but serves only a router that proves
    it holds the secret too."""

    async def main():
        worker, server, address = await _listening()
        reader, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(wire.MAGIC + b"n" * wire.NONCE_BYTES)
        await reader.readexactly(wire.NONCE_BYTES + wire.PROOF_BYTES)
        writer.write(b"\0" * wire.PROOF_BYTES + b"stranger new\n")
        rest = await reader.read()
        writer.close()
        server.close()
        return worker.served, rest

    served, rest = asyncio.run(main())
    assert rest == b"" and served == [], f"a stranger must get nothing and no session: {served}, {rest[:40]!r}"


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
        worker = Worker()
        server = ChannelServer(worker.serve)
        address = await server.start("0.0.0.0", advertise="127.0.0.1")
        assert address.host == "127.0.0.1"
        messages = await token_channel.connect(address, "router-3")
        await _until(lambda: "router-3" in worker.queues)
        worker.queues["router-3"].put_nowait(_step("r", [1]))
        assert await anext(messages) == _step("r", [1])
        await messages.aclose()
        await _until(lambda: worker.left == ["router-3"])
        server.close()

    asyncio.run(main())


def test_a_subscriber_that_resets_its_connection_is_dropped_once_the_grace_has_passed():
    async def main():
        worker = Worker()
        server = ChannelServer(worker.serve, FAST)
        address = await server.start()
        reader, writer, _, _ = await _greeted(address, "router-4")
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
        _queue(worker, "router-5", [_step("r", [i]) for i in range(1, 6)])
        got = [await anext(messages)]
        await _until(lambda: server._sessions["router-5"].sent == 5)  # all five written, four unread
        server.disconnect("router-5")  # the blip: what was in flight is gone with the connection
        _queue(worker, "router-5", [_step("r", [i], finished=i == 8) for i in range(6, 9)])
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
        reader, writer, incoming, _ = await _greeted(address, "router-6")  # then nothing, ever
        await _until(lambda: worker.served == ["router-6"])
        await _until(lambda: server.state("router-6") == "detached")
        await _until(lambda: worker.left == ["router-6"])
        frames = []
        with pytest.raises(asyncio.IncompleteReadError):
            while True:
                frames.append(wire.decode(await wire.read_frame(reader, incoming, FAST.max_frame_bytes)))
        writer.close()
        server.close()
        return frames

    frames = asyncio.run(main())
    assert frames and all(type(f) is wire.HeartbeatFrame for f in frames), \
        f"the idle worker must have sent heartbeats, and nothing else: {frames[:3]}"


def test_a_worker_that_goes_silent_ends_the_routers_stream_after_the_deadline_and_grace():
    """A hung worker: its connection stays open, and it even accepts new ones, but says
    nothing. The router notices by the heartbeat deadline, cannot resume, and gives up."""

    async def main():
        held = []

        async def hung(reader, writer):
            held.append(writer)  # keep the connection open and never answer (after the handshake, once)
            if len(held) == 1:
                await wire.worker_handshake(reader, writer, address.secret)

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
        reader, writer, incoming, _ = await _greeted(address, "router-9", "12")  # a session it never had
        notice = wire.decode(await wire.read_frame(reader, incoming, FAST.max_frame_bytes))
        rest = await reader.read()
        writer.close()
        server.close()
        return notice, rest

    notice, rest = asyncio.run(main())
    assert type(notice) is wire.NoticeFrame and notice.number == 0 and notice.kind is NoticeKind.GONE, notice
    assert rest == b"", "the worker must close the connection after the GONE notice"


def test_channel_settings_are_checked():
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        ChannelConfig(heartbeat_s=2, heartbeat_timeout_s=1)
    with pytest.raises(ValueError, match="max_pending_outputs"):
        ChannelConfig(max_pending_outputs=0)
    with pytest.raises(ValueError, match="unknown channel settings"):
        ChannelConfig.from_dict({"heartbeat": 1})
    with pytest.raises(ValueError, match=r"channel.max_frame_bytes must be >= 1048576"):
        ChannelConfig(max_frame_bytes=1000)


def test_the_topologys_channel_settings_reach_the_workers_and_the_routers():
    from cluster.config import ClusterConfig

    cluster = ClusterConfig.from_dict({"channel": {"heartbeat_s": 0.5, "reconnect_grace_s": 3}})
    assert cluster.channel == ChannelConfig(heartbeat_s=0.5, reconnect_grace_s=3)
    assert cluster.dispatch_settings()["channel"] is cluster.channel, "the routers must get the same settings"


# -- trust: the handshake, sealed frames, the frame cap, the schema --------------------------

DETONATED: list[str] = []


def _detonate(what: str) -> tuple:
    """What the impostor's pickle runs when unpickled: it records that it ran."""
    DETONATED.append(what)
    return 1, (None, [])


class _PickleBomb:
    def __reduce__(self):
        return _detonate, ("ran in the router " + "x" * 64,)  # long enough to fill any answer the router awaits


def test_an_impostor_at_the_workers_address_is_refused_before_a_byte_of_it_is_unpickled():
    """Another process on a dead worker's port (or a pod given its IP) answers with a pickle
    (today's frame: a 4-byte length and the pickle); the router must refuse it before
    parsing anything of it, having sent it nothing secret."""

    async def main():
        heard: list[bytes] = []
        hung_up = asyncio.Event()

        async def impostor(reader, writer):
            bomb = pickle.dumps(_PickleBomb(), protocol=5)
            writer.write(struct.pack("<I", len(bomb)) + bomb)
            while chunk := await reader.read(4096):
                heard.append(chunk)
            hung_up.set()

        server = await asyncio.start_server(impostor, "127.0.0.1", 0)
        address = token_channel.ChannelAddress("127.0.0.1", server.sockets[0].getsockname()[1], "s3cret" * 5)
        with pytest.raises(ChannelLost, match="does not hold the channel's secret"):
            messages = await token_channel.connect(address, "router-10", FAST)
            await asyncio.wait_for(anext(messages), 5)  # (where the old router got the bomb)
        await asyncio.wait_for(hung_up.wait(), 5)
        server.close()
        return b"".join(heard), address.secret

    DETONATED.clear()
    heard, secret = asyncio.run(main())
    assert DETONATED == [], "the impostor's pickle ran in the router"
    assert secret.encode() not in heard and len(heard) == len(wire.MAGIC) + wire.NONCE_BYTES, \
        f"the router must send an impostor its nonce and nothing more, sent {heard!r}"


async def _fake_worker(frames) -> tuple[token_channel.ChannelAddress, list, asyncio.AbstractServer]:
    """A worker that holds the secret, does the handshake, then writes ``frames(outgoing
    seal)``'s bytes and waits; the list counts its connections."""
    secret = "s" * 32
    connections: list = []

    async def serve(reader, writer):
        connections.append(writer)
        _, _, _, outgoing = await wire.worker_handshake(reader, writer, secret)
        writer.write(frames(outgoing))
        await reader.read()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return token_channel.ChannelAddress("127.0.0.1", server.sockets[0].getsockname()[1], secret), connections, server


def test_an_oversized_frame_length_ends_the_stream_unread_with_a_log_line(monkeypatch, caplog):
    asked: list[int] = []
    readexactly = asyncio.StreamReader.readexactly

    async def spy(self, n):
        asked.append(n)
        return await readexactly(self, n)

    monkeypatch.setattr(asyncio.StreamReader, "readexactly", spy)

    async def main():
        address, connections, server = await _fake_worker(lambda seal: struct.pack("<I", 0xFFFF_FFF0) + bytes(16))
        messages = await token_channel.connect(address, "router-11", FAST)
        with pytest.raises(ChannelLost, match="max_frame_bytes"):
            await anext(messages)
        server.close()
        return len(connections)

    connections = asyncio.run(main())
    assert max(asked) <= FAST.max_frame_bytes, f"the router asked to read {max(asked)} bytes"
    assert connections == 1, "an oversized frame is not a blip to reconnect after"
    assert any("4294967280 bytes is over channel.max_frame_bytes" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


def _altered(seal: wire.Seal) -> bytes:
    good = seal.seal(wire.encode(_step("r", [1]), 1))
    bad = bytearray(seal.seal(wire.encode(_step("r", [2]), 2)))
    bad[-3] ^= 1
    return good + bytes(bad)


def _replayed(seal: wire.Seal) -> bytes:
    good = seal.seal(wire.encode(_step("r", [1]), 1))
    return good + good


def _reordered(seal: wire.Seal) -> bytes:
    first = seal.seal(wire.encode(_step("r", [1]), 1))
    second, third = seal.seal(wire.encode(_step("r", [2]), 2)), seal.seal(wire.encode(_step("r", [3]), 3))
    return first + third + second


@pytest.mark.parametrize("frames", [_altered, _replayed, _reordered])
def test_a_frame_altered_replayed_or_reordered_on_the_way_ends_the_stream_unread(frames):
    async def main():
        address, connections, server = await _fake_worker(frames)
        messages = await token_channel.connect(address, "router-12", FAST)
        got = [await anext(messages)]
        with pytest.raises(ChannelLost, match="failed its tag"):
            got.append(await anext(messages))
        server.close()
        return got, len(connections)

    got, connections = asyncio.run(main())
    assert got == [_step("r", [1])], f"only the frame before the bad one may come through: {got}"
    assert connections == 1


def test_every_message_kind_round_trips_the_wire_schema():
    from decode_worker.worker import _wire
    from engine.model.sampler import TokenLogprobs
    from engine.output_processor import RequestOutput

    lp = TokenLogprobs(7, -0.5, ((7, -0.5), (9, -1.25)))
    out = RequestOutput(request_id="r", prompt_token_ids=[1, 2], token_ids=[], text="", new_token_ids=[7],
                        new_text="hé", finished=True, finish_reason="error", num_cached_tokens=2, new_logprobs=[lp],
                        prompt_logprobs=[None, TokenLogprobs(2, -3.0, ((5, -0.1),), rank=4)], num_output_tokens=1)
    load = DecodeLoad("decode-0", free_blocks=3, total_blocks=9, running=1, waiting=2, waiting_for_kv=0)
    steps = [(load, [_wire("r", [out]), _wire("q", [RuntimeError("boom")]), _wire("s", [dataclasses.replace(
        out, finish_reason="length", new_logprobs=None, prompt_logprobs=None)])]), (None, [])]
    for number, step in enumerate(steps, 1):
        frame = wire.decode(wire.encode(step, number))
        assert (frame.number, wire.message_of(frame)) == (number, step), f"{step} came back as {frame}"
    for kind in NoticeKind:
        frame = wire.decode(wire.encode(Notice(kind, "why"), 5))
        assert (frame.number, wire.message_of(frame)) == (5, Notice(kind, "why"))
    assert type(wire.decode(wire.HEARTBEAT)) is wire.HeartbeatFrame
    sender, receiver = wire.Seal(b"k" * 32), wire.Seal(b"k" * 32)
    assert [receiver.open_ack(sender.ack(n)) for n in (0, 64, wire.END)] == [0, 64, wire.END]


@pytest.mark.parametrize("body", [
    pickle.dumps((1, (None, [])), protocol=5),  # a pickle is not MessagePack of the schema
    msgspec.msgpack.encode([1, 1, None, [["r", "not token ids", "", False]]]),  # a field of the wrong type
    msgspec.msgpack.encode([9, 1]),  # an unknown frame kind
])
def test_a_frame_that_does_not_fit_the_schema_is_refused(body):
    with pytest.raises(wire.FrameRefused, match="schema"):
        wire.decode(body)
