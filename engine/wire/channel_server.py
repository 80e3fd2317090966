"""The worker's end of a decode worker's token channel: ``ChannelServer`` accepts routers
and runs one numbered session per subscriber across its connections.

The protocol (the session's lifecycle, resume after a drop, liveness, trust) is described in
``engine/wire/token_channel.py``, which also has the router's end and re-exports
``ChannelServer``; the settings and address are in ``engine/wire/channel_config.py``, the
frames and handshake in ``engine/wire/channel_wire.py``. A session on the worker::

    hello "new" ──▶ ATTACHED ──connection lost / silent past heartbeat_timeout_s──▶ DETACHED
                       ▲                                                              │
                       └──────────── hello "<last seq>" within reconnect_grace_s ◀────┤
                                                                                      ▼
    serving returned (worker ends it, subscriber cut off) ─────────────────────────▶ ENDED
                                              grace passed, or a resume it cannot honour ┘
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import deque
from collections.abc import Awaitable, Callable

from engine.wire import channel_wire as wire
from engine.wire.channel_config import HELLO_TIMEOUT_S, NEW, ChannelAddress, ChannelConfig, keep_alive
from engine.wire.channel_wire import END, FrameRefused, Notice, NoticeKind, Seal

log = logging.getLogger("engine.wire.token_channel")  # one logger for both ends of the channel


class _Session:
    """One subscriber's numbered stream on the worker, across its connections."""

    def __init__(self, subscriber: str, config: ChannelConfig) -> None:
        self.subscriber = subscriber
        self.config = config
        self.loop = asyncio.get_running_loop()
        self.sent = 0  # number of the last message
        self.unacked: deque[tuple[int, bytes]] = deque()  # (number, frame body), sealed as written
        self.unacked_bytes = 0
        self.writer: asyncio.StreamWriter | None = None  # None: DETACHED (or ENDED)
        self.seal: Seal | None = None  # the connection's, for what the worker writes on it
        self.last_sent = self.loop.time()
        self.changed = asyncio.Event()  # attached, or acknowledged: a waiting send may go on
        self.task: asyncio.Task | None = None  # the serving
        self.expiry: asyncio.TimerHandle | None = None
        self.ended = False

    async def send(self, message) -> None:
        """Number, keep and write one message; waits while detached or too far ahead."""
        self.sent += 1
        body = wire.encode(message, self.sent)
        self.unacked.append((self.sent, body))
        self.unacked_bytes += len(body)
        if self.writer is not None:
            self.writer.write(self.seal.seal(body))
            self.last_sent = self.loop.time()
        while self.writer is None or self.unacked_bytes > self.config.max_unacked_bytes:
            self.changed.clear()
            await self.changed.wait()
        try:
            await self.writer.drain()
        except ConnectionError:
            pass  # the connection's watch detaches the session; the message stays to be sent again

    def heartbeat(self) -> None:
        if self.writer is not None:
            self.writer.write(self.seal.seal(wire.HEARTBEAT))
            self.last_sent = self.loop.time()

    def ack(self, number: int) -> None:
        unacked = self.unacked
        while unacked and unacked[0][0] <= number:
            self.unacked_bytes -= len(unacked.popleft()[1])
        self.changed.set()

    def can_resume(self, number: int) -> bool:
        """Whether everything after message ``number`` is still here to send."""
        first = self.unacked[0][0] if self.unacked else self.sent + 1
        return first - 1 <= number <= self.sent

    def attach(self, writer: asyncio.StreamWriter, seal: Seal, number: int) -> None:
        """A connection (``seal``: its own) takes the session over, from after message ``number``."""
        if self.expiry is not None:
            self.expiry.cancel()
            self.expiry = None
        old, self.writer, self.seal = self.writer, writer, seal
        if old is not None:
            old.close()
        self.ack(number)
        for _, body in self.unacked:
            writer.write(seal.seal(body))
        self.last_sent = self.loop.time()

    def detach(self, writer: asyncio.StreamWriter, end: Callable[[], None]) -> None:
        """``writer``'s connection is gone; ``end`` the session if none comes within the grace."""
        if self.writer is writer and not self.ended:
            self.writer = None
            self.expiry = self.loop.call_later(self.config.reconnect_grace_s, end)


class ChannelServer:
    """The worker's side: accepts subscribers and runs ``serve(subscriber, send)`` for
    each session (``send`` numbers and writes one message; the serving is cancelled when
    the session ends without it: no reconnect within the grace)."""

    def __init__(
        self, serve: Callable[[str, Callable[[object], Awaitable[None]]], Awaitable[None]],
        config: ChannelConfig | None = None,
    ) -> None:
        self._serve = serve
        self.config = config or ChannelConfig()
        self._secret = secrets.token_hex(16)
        self._server: asyncio.AbstractServer | None = None
        self._sessions: dict[str, _Session] = {}
        self.address: ChannelAddress | None = None
        self.num_resumed = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0, advertise: str | None = None) -> ChannelAddress:
        """Listen on ``host:port`` (0: any free port). ``advertise``: the host routers
        connect to, when ``host`` is a wildcard such as 0.0.0.0."""
        if self.address is None:
            self._server = await asyncio.start_server(self._accept, host, port)
            bound = self._server.sockets[0].getsockname()[1]
            self.address = ChannelAddress(advertise or host, bound, self._secret)
        return self.address

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    def state(self, subscriber: str) -> str | None:
        """``"attached"``, ``"detached"`` (waiting for a reconnect) or None (no session)."""
        session = self._sessions.get(subscriber)
        if session is None:
            return None
        return "detached" if session.writer is None else "attached"

    def disconnect(self, subscriber: str) -> None:
        """Fault injection: reset the subscriber's connection (a network blip), keeping
        its session."""
        session = self._sessions.get(subscriber)
        if session is not None and session.writer is not None:
            session.writer.transport.abort()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            subscriber, resume, incoming, outgoing = await asyncio.wait_for(
                wire.worker_handshake(reader, writer, self._secret), HELLO_TIMEOUT_S)
        except (asyncio.TimeoutError, EOFError, asyncio.LimitOverrunError, ConnectionError, FrameRefused):
            writer.close()  # silent, gone, or not a router that holds the secret
            return
        if not subscriber:
            writer.close()
            return
        keep_alive(writer, self.config.heartbeat_timeout_s)
        session = self._sessions.get(subscriber)
        if resume == NEW and session is None:
            session = self._sessions[subscriber] = _Session(subscriber, self.config)
            session.task = asyncio.get_running_loop().create_task(self._run(session))
            number = 0
        elif resume != NEW and resume.isdigit() and session is not None and session.can_resume(int(resume)):
            number = int(resume)
            self.num_resumed += 1
            notice = Notice(NoticeKind.RESUMED, f"after message {number}")
            writer.write(outgoing.seal(wire.encode(notice)))  # before the replay
        else:  # a name already in use, or a session this worker cannot carry on
            notice = Notice(NoticeKind.GONE, f"no session {subscriber!r} to resume from {resume}")
            writer.write(outgoing.seal(wire.encode(notice)))
            writer.close()
            return
        session.attach(writer, outgoing, number)
        said_end = False
        try:
            said_end = await self._watch(session, reader, writer, incoming)
        finally:
            if said_end:
                self._end(session)
            else:
                session.detach(writer, lambda: self._end(session))
            writer.close()

    async def _watch(
        self, session: _Session, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, incoming: Seal,
    ) -> bool:
        """Read the router's acknowledgements, send heartbeats when idle; return when the
        connection ends, is replaced, or the router has been silent past the deadline:
        True when the router said it is done with the session."""
        loop, heartbeat_s, timeout_s = session.loop, self.config.heartbeat_s, self.config.heartbeat_timeout_s
        heard = loop.time()
        while session.writer is writer:
            try:  # one fixed-size read, so a timeout never splits a frame (what came stays buffered)
                data = await asyncio.wait_for(reader.readexactly(wire.ACK_BYTES), heartbeat_s)
            except asyncio.TimeoutError:
                data = None
            except (ConnectionError, EOFError):
                return False  # reset, or hung up
            now = loop.time()
            if data is not None:
                try:
                    number = incoming.open_ack(data)
                except FrameRefused as e:
                    log.warning("token channel: subscriber %s: %s; closing the connection", session.subscriber, e)
                    return False
                if number == END:
                    return True
                heard = now
                session.ack(number)
            elif now - heard > timeout_s:
                return False  # the router hung, or its host vanished
            if now - session.last_sent >= heartbeat_s:
                session.heartbeat()
        return False

    async def _run(self, session: _Session) -> None:
        try:
            await self._serve(session.subscriber, session.send)
        except (asyncio.CancelledError, ConnectionError):
            pass  # the session ended without the serving
        finally:
            self._end(session)

    def _end(self, session: _Session) -> None:
        """ENDED: forget the session, cancel its serving, close its connection (after
        what it has written, a ``CUT`` notice say, goes out)."""
        if session.ended:
            return
        session.ended = True
        if self._sessions.get(session.subscriber) is session:
            del self._sessions[session.subscriber]
        if session.expiry is not None:
            session.expiry.cancel()
        if session.task is not None and session.task is not asyncio.current_task():
            session.task.cancel()
        writer, session.writer = session.writer, None
        if writer is not None:
            writer.close()
