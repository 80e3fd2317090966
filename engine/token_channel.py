"""A decode worker's token channel: its step messages over a plain TCP connection.

Ray's streaming generators cost about a millisecond of CPU per message between the two
processes (the worker's report thread and gRPC, the router's object-ref machinery),
which at one message per engine step is more than the rest of the token path. A
decode worker therefore also serves its ``subscribe`` stream over TCP: the router
asks it once (a Ray call) for the address and a secret, connects, says who it is, and
from then on reads length-prefixed pickled ``StepMessage`` frames. Ray still carries
every request and control call; only the per-step messages take this path.

The subscription is a *session*, which outlives any one connection. A session's
lifecycle on the worker::

    hello "new" ──▶ ATTACHED ──connection lost / silent past heartbeat_timeout_s──▶ DETACHED
                       ▲                                                              │
                       └──────────── hello "<last seq>" within reconnect_grace_s ◀────┤
                                                                                      ▼
    serving returned (worker ends it, subscriber cut off) ─────────────────────────▶ ENDED
                                              grace passed, or a resume it cannot honour ┘

Only an ENDED session's serving is cancelled (the worker then aborts that subscriber's
requests and frees their blocks), so a network blip costs a reconnect, not every
stream of the worker. The router (``connect``) reconnects on its own within
``reconnect_grace_s``; a refused connection (nothing listens: the worker is gone), a
worker that no longer knows the session, or no connection within the grace ends its
iterator with ``ChannelLost``, which the router treats as the worker's death.

No message is lost or doubled across a reconnect: the worker numbers its messages and
keeps each until the router acknowledges it; the router's hello on a reconnect names
the last number it got, and the worker sends again everything after it (the router
drops a number it has had, should one come twice). Unacknowledged bytes are bounded
(``max_unacked_bytes``): past it the worker's sending waits, and the subscriber's
outputs wait in its outbox, whose own bound (``max_pending_outputs``) decides when a
router is too slow (``engine/async_engine.py``, ``decode_worker/worker.py``).

Liveness, both ways: each side sends something at least every ``heartbeat_s`` (the
worker a heartbeat frame when it had nothing to send; the router its acknowledgement
line) and treats ``heartbeat_timeout_s`` of silence as a dead connection, so a hung
peer with an open connection, or a vanished host, is noticed within the deadline.
``TCP_USER_TIMEOUT`` (Linux) also fails a socket whose sent data stays unacknowledged
that long, and TCP keepalive covers an idle one.

The secret keeps anything but the router that asked from subscribing; frames flow
one way, from worker to router, which unpickles only what the worker it placed
requests on sends, as Ray itself does; the router sends only text lines.

Wire format: the router sends one line, ``<secret> <subscriber> <resume>\\n``, where
``<resume>`` is ``new`` or the number of the last message it got; then a line with that
number (an acknowledgement, and its heartbeat) every ``heartbeat_s`` and every
``ACK_EVERY`` messages, and ``end`` when it is done with the session (it ends at once,
with no grace). The worker sends frames of a 4-byte little-endian length and a
pickle (protocol 5) of ``(number, message)``; number 0 is a heartbeat (message None)
or a ``Notice``, outside the numbering.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import logging
import pickle
import secrets
import socket
import struct
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, fields

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<I")
HELLO_TIMEOUT_S = 5.0
MAX_HELLO_BYTES = 1024
MAX_ACK_BYTES = 32
ACK_EVERY = 64  # the router acknowledges at least this often, in messages
NEW = "new"
_END = b"end\n"  # the router's last line when it is done with the session
_HEARTBEAT = None
# A peer on a host that vanished while the connection was idle is noticed after
# about KEEPALIVE_IDLE_S + KEEPALIVE_PROBES * KEEPALIVE_INTERVAL_S (heartbeats usually first).
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_PROBES = 3


@dataclass(frozen=True)
class ChannelConfig:
    """The token channel's timings and bounds (the router's and the workers' alike)."""

    heartbeat_s: float = 1.0  # each side sends something at least this often
    heartbeat_timeout_s: float = 10.0  # this long without a byte from the peer: the connection is dead
    reconnect_grace_s: float = 10.0  # a dropped session waits this long for its router to come back
    max_unacked_bytes: int = 8 << 20  # sent but not acknowledged; past it the worker's sending waits
    # Per subscriber, outputs not yet sent (the worker's outbox). Past it the router is
    # told; still past it after slow_subscriber_s (or past twice it at once) the
    # subscriber is cut off: its requests are aborted and their blocks freed.
    max_pending_outputs: int = 65536
    slow_subscriber_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("heartbeat_s", "heartbeat_timeout_s", "reconnect_grace_s", "slow_subscriber_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"channel.{name} must be > 0 seconds, got {getattr(self, name)}")
        if not self.heartbeat_timeout_s > self.heartbeat_s:
            raise ValueError(f"channel.heartbeat_timeout_s ({self.heartbeat_timeout_s}) must be more than "
                             f"channel.heartbeat_s ({self.heartbeat_s})")
        for name in ("max_unacked_bytes", "max_pending_outputs"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"channel.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_dict(cls, d: dict) -> ChannelConfig:
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown channel settings: {sorted(unknown)}")
        return cls(**d)


class NoticeKind(str, enum.Enum):
    """What a ``Notice`` says about the stream: a backlog (``SLOW``, ``CUT``), a connection resumed
    (``RESUMED``) or a session the worker no longer knows (``GONE``)."""

    SLOW = "slow"  # worker: this subscriber's pending outputs passed max_pending_outputs
    CUT = "cut"  # worker: the subscriber was too slow for too long; its requests were aborted
    RESUMED = "resumed"  # router side: the connection dropped and was re-established, nothing lost
    GONE = "gone"  # worker: it does not know the session any more (ended, or never began)


@dataclass(frozen=True)
class Notice:
    """A message about the stream itself, among the step messages (rare: logged, counted)."""

    kind: NoticeKind
    detail: str = ""


class ChannelLost(ConnectionError):
    """The session is over: the worker is gone, or no longer knows the subscriber."""


@dataclass(frozen=True)
class ChannelAddress:
    """Where a decode worker's token channel listens, and the secret that opens it."""

    host: str
    port: int
    secret: str


def frame(message, number: int = 0) -> bytes:
    """One message as it goes on the wire (``number`` 0: outside the numbering)."""
    body = pickle.dumps((number, message), protocol=5)
    return _LENGTH.pack(len(body)) + body


def keep_alive(writer: asyncio.StreamWriter, user_timeout_s: float | None = None) -> None:
    """Turn on TCP keepalive, so a peer whose host vanished ends the connection, and
    (Linux) ``TCP_USER_TIMEOUT``, so data the peer leaves unacknowledged that long fails it."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    options = [("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
               ("TCP_KEEPCNT", KEEPALIVE_PROBES)]
    if user_timeout_s is not None:
        options.append(("TCP_USER_TIMEOUT", max(1, int(user_timeout_s * 1000))))
    for name, value in options:
        if hasattr(socket, name):  # Linux; elsewhere the system's defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class _Session:
    """One subscriber's numbered stream on the worker, across its connections."""

    def __init__(self, subscriber: str, config: ChannelConfig) -> None:
        self.subscriber = subscriber
        self.config = config
        self.loop = asyncio.get_running_loop()
        self.sent = 0  # number of the last message
        self.unacked: deque[tuple[int, bytes]] = deque()
        self.unacked_bytes = 0
        self.writer: asyncio.StreamWriter | None = None  # None: DETACHED (or ENDED)
        self.last_sent = self.loop.time()
        self.changed = asyncio.Event()  # attached, or acknowledged: a waiting send may go on
        self.task: asyncio.Task | None = None  # the serving
        self.expiry: asyncio.TimerHandle | None = None
        self.ended = False

    async def send(self, message) -> None:
        """Number, keep and write one message; waits while detached or too far ahead."""
        self.sent += 1
        data = frame(message, self.sent)
        self.unacked.append((self.sent, data))
        self.unacked_bytes += len(data)
        if self.writer is not None:
            self.writer.write(data)
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
            self.writer.write(frame(_HEARTBEAT))
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

    def attach(self, writer: asyncio.StreamWriter, number: int) -> None:
        """A connection takes the session over, from after message ``number``."""
        if self.expiry is not None:
            self.expiry.cancel()
            self.expiry = None
        old, self.writer = self.writer, writer
        if old is not None:
            old.close()
        self.ack(number)
        for _, data in self.unacked:
            writer.write(data)
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
            hello = await asyncio.wait_for(reader.readuntil(b"\n"), HELLO_TIMEOUT_S)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        words = hello[:MAX_HELLO_BYTES].decode(errors="replace").strip().split(" ")  # one space apart: none empty
        secret, subscriber, resume = (words + ["", "", ""])[:3]
        resume = resume or NEW  # a two-word hello (an older router) starts a session
        if not subscriber or not hmac.compare_digest(secret, self._secret):
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
            writer.write(frame(Notice(NoticeKind.RESUMED, f"after message {number}")))  # before the replay
        else:  # a name already in use, or a session this worker cannot carry on
            writer.write(frame(Notice(NoticeKind.GONE, f"no session {subscriber!r} to resume from {resume}")))
            writer.close()
            return
        session.attach(writer, number)
        said_end = False
        try:
            said_end = await self._watch(session, reader, writer)
        finally:
            if said_end:
                self._end(session)
            else:
                session.detach(writer, lambda: self._end(session))
            writer.close()

    async def _watch(self, session: _Session, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Read the router's acknowledgements, send heartbeats when idle; return when the
        connection ends, is replaced, or the router has been silent past the deadline:
        True when the router said it is done with the session."""
        loop, heartbeat_s, timeout_s = session.loop, self.config.heartbeat_s, self.config.heartbeat_timeout_s
        heard = loop.time()
        while session.writer is writer:
            try:
                line = await asyncio.wait_for(reader.readline(), heartbeat_s)
            except asyncio.TimeoutError:
                line = None
            except (ConnectionError, ValueError):
                return False  # reset, or a line past the reader's limit
            now = loop.time()
            if line is not None:
                if line == _END:
                    return True
                if not line or len(line) > MAX_ACK_BYTES or not line.strip().isdigit():
                    return False  # hung up (or spoke out of turn)
                heard = now
                session.ack(int(line))
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


class _Link:
    """One connection of the router's side: reads frames, acknowledges, watches the deadline."""

    def __init__(self, reader, writer, config: ChannelConfig) -> None:
        self.reader, self.writer, self.config = reader, writer, config
        self.loop = asyncio.get_running_loop()
        self.heard = self.loop.time()
        self.got = 0  # number of the last message, to acknowledge
        self.timed_out = False
        self.ticker = self.loop.create_task(self._tick())

    @classmethod
    async def open(cls, address: ChannelAddress, subscriber: str, resume: str, config: ChannelConfig) -> _Link:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(address.host, address.port), config.heartbeat_timeout_s
        )
        keep_alive(writer, config.heartbeat_timeout_s)
        writer.write(f"{address.secret} {subscriber} {resume}\n".encode())
        return cls(reader, writer, config)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            if self.loop.time() - self.heard > self.config.heartbeat_timeout_s:
                self.timed_out = True
                self.writer.transport.abort()  # the read ends with an EOF
                return
            self.writer.write(b"%d\n" % self.got)

    def acknowledge(self, number: int) -> None:
        self.got = number
        if number % ACK_EVERY == 0:
            self.writer.write(b"%d\n" % number)

    def close(self, end: bool = False) -> None:
        """Close the connection; ``end``: tell the worker the session is over (no reconnect)."""
        self.ticker.cancel()
        if end and not self.writer.is_closing():
            self.writer.write(_END)
        self.writer.close()


async def connect(address: ChannelAddress, subscriber: str, config: ChannelConfig | None = None) -> AsyncIterator:
    """The router's side: connect (``OSError`` when it cannot) and subscribe; returns the
    worker's messages for ``subscriber`` (and ``Notice``s), reconnecting after a drop
    (a ``RESUMED`` notice says so); it ends with ``ChannelLost`` when the session is over."""
    config = config or ChannelConfig()
    link = await _Link.open(address, subscriber, NEW, config)
    return _messages(address, subscriber, config, link)


async def _messages(address: ChannelAddress, subscriber: str, config: ChannelConfig, link: _Link) -> AsyncIterator:
    got = 0
    try:
        while True:
            unpack, loads, readexactly = _LENGTH.unpack, pickle.loads, link.reader.readexactly
            now, acknowledge = link.loop.time, link.acknowledge
            try:
                while True:
                    (size,) = unpack(await readexactly(_LENGTH.size))
                    number, message = loads(await readexactly(size))
                    link.heard = now()
                    if number == got + 1:
                        got = number
                        acknowledge(number)
                        yield message
                    elif number == 0:
                        if message is None:
                            continue  # a heartbeat
                        if message.kind is NoticeKind.GONE:
                            raise ChannelLost(f"the worker ended the session: {message.detail}")
                        yield message
                    elif number > got:
                        raise ChannelLost(f"message {got + 1} is missing (got {number})")
                    # else: sent again after a reconnect, and already had
            except (EOFError, ConnectionError) as e:
                if isinstance(e, ChannelLost):
                    raise
                why = "silent past the deadline" if link.timed_out else type(e).__name__
                link.close()
                link = await _reconnect(address, subscriber, config, got)
                yield Notice(NoticeKind.RESUMED, f"after {why}, from message {got}")
    finally:
        link.close(end=True)  # the consumer is done: the worker need not wait for a reconnect


async def _reconnect(address: ChannelAddress, subscriber: str, config: ChannelConfig, got: int) -> _Link:
    """Connect again within the grace, resuming after message ``got``, until the worker
    confirms; ``ChannelLost`` when nothing listens (the worker is gone), the worker closes
    the connection unanswered or no longer knows the session, or the grace runs out (a
    worker that accepts but never answers, hung, counts as gone too)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.reconnect_grace_s
    delay = min(0.05, config.heartbeat_s)
    while True:
        try:
            link = await _Link.open(address, subscriber, str(got), config)
        except ConnectionRefusedError as e:
            raise ChannelLost(f"nothing listens at {address.host}:{address.port}") from e
        except OSError as e:  # unreachable, timed out: the network, maybe only for now
            if loop.time() + delay > deadline:
                raise ChannelLost(f"no reconnect within {config.reconnect_grace_s}s: {e or type(e).__name__}") from e
            await asyncio.sleep(delay)
            delay = min(2 * delay, config.heartbeat_s)
            continue
        try:
            _, answer = await asyncio.wait_for(_read_frame(link.reader), max(0.0, deadline - loop.time()))
        except (asyncio.TimeoutError, EOFError, ConnectionError) as e:
            # Connected, then closed or silent: not the network but the worker (dying, hung).
            link.close()
            raise ChannelLost(f"the worker did not take the session back: {type(e).__name__}") from e
        if isinstance(answer, Notice) and answer.kind is NoticeKind.RESUMED:
            return link
        link.close()
        raise ChannelLost(f"the worker ended the session: {getattr(answer, 'detail', answer)}")


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, object]:
    (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return pickle.loads(await reader.readexactly(size))
