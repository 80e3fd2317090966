"""A decode worker's token channel: its step messages over a plain TCP connection.

Ray's streaming generators cost about a millisecond of CPU per message between the two
processes (the worker's report thread and gRPC, the router's object-ref machinery),
which at one message per engine step is more than the rest of the token path. A
decode worker therefore also serves its ``subscribe`` stream over TCP: the router
asks it once (a Ray call) for the address and a secret, connects, each side proves that
it holds the secret, the router says who it is, and from then on it reads the worker's
``StepMessage`` frames (``engine/wire/channel_wire.py``: authenticated, size-capped, of a fixed
schema). Ray still carries every request and control call; only the per-step messages
take this path.

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
router is too slow (``decode_worker/outbox.py``, ``decode_worker/worker.py``).

Liveness, both ways: each side sends something at least every ``heartbeat_s`` (the
worker a heartbeat frame when it had nothing to send; the router its acknowledgement
line) and treats ``heartbeat_timeout_s`` of silence as a dead connection, so a hung
peer with an open connection, or a vanished host, is noticed within the deadline.
``TCP_USER_TIMEOUT`` (Linux) also fails a socket whose sent data stays unacknowledged
that long, and TCP keepalive covers an idle one.

Trust: neither side believes an address. Every connection opens with the handshake of
``engine/wire/channel_wire.py``: the worker proves that it holds the secret before the router
sends anything but a nonce or reads a frame (another process on a dead worker's port, a
pod given its IP, is refused there: ``ChannelLost``), and the router proves it before
the worker serves it. Every frame after that carries a tag under a key of that
connection alone and its count on it, so nothing on the path can alter, replay or
reorder one unnoticed; a frame longer than ``max_frame_bytes`` is refused before it is
read; and a frame is MessagePack of a fixed schema, never a pickle. A frame that fails
any of these ends the router's stream with ``ChannelLost`` (logged), as a dead worker's.

On the wire, after the handshake (whose line names the subscriber and ``<resume>``:
``new``, or the number of the last message it got): the router sends that number (an
acknowledgement, and its heartbeat) every ``heartbeat_s`` and every ``ACK_EVERY``
messages, and ``END`` when it is done with the session (it ends at once, with no
grace). The worker sends numbered step messages and ``Notice``s; number 0 is a
heartbeat or a ``Notice`` of the channel's own, outside the numbering.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import socket
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, fields

from engine.wire import channel_wire as wire
from engine.wire.channel_wire import END, FrameRefused, HeartbeatFrame, Notice, NoticeFrame, NoticeKind, Seal
from engine.wire.messages import StepMessage

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0  # a peer that has not finished its handshake by then is closed on
ACK_EVERY = 64  # the router acknowledges at least this often, in messages
NEW = "new"
# A peer on a host that vanished while the connection was idle is noticed after
# about KEEPALIVE_IDLE_S + KEEPALIVE_PROBES * KEEPALIVE_INTERVAL_S (heartbeats usually first).
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_PROBES = 3
MIN_FRAME_BYTES = 1 << 20


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
    # The largest frame the router reads; a longer one's length ends the stream unread. A step
    # message with prompt logprobs (20 alternatives) of a 128k-token prompt is about 40 MiB.
    max_frame_bytes: int = 64 << 20

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
        if not self.max_frame_bytes >= MIN_FRAME_BYTES:
            raise ValueError(f"channel.max_frame_bytes must be >= {MIN_FRAME_BYTES} (1 MiB: a step message with "
                             f"logprobs can be that big), got {self.max_frame_bytes}")

    @classmethod
    def from_dict(cls, d: dict) -> ChannelConfig:
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown channel settings: {sorted(unknown)}")
        return cls(**d)


class ChannelLost(ConnectionError):
    """The session is over: the worker is gone, or no longer knows the subscriber."""


@dataclass(frozen=True)
class ChannelAddress:
    """Where a decode worker's token channel listens, and the secret that opens it."""

    host: str
    port: int
    secret: str


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


class _Link:
    """One connection of the router's side: its handshake, then it reads frames,
    acknowledges them and watches the deadline."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, config: ChannelConfig) -> None:
        self.reader, self.writer, self.config = reader, writer, config
        self.loop = asyncio.get_running_loop()
        self.heard = self.loop.time()
        self.got = 0  # number of the last message, to acknowledge
        self.timed_out = False
        self.incoming: Seal | None = None  # both set by the handshake
        self.outgoing: Seal | None = None
        self.ticker: asyncio.Task | None = None

    @classmethod
    async def open(cls, address: ChannelAddress, config: ChannelConfig) -> _Link:
        """Connect (``OSError`` when that fails); nothing is sent yet."""
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(address.host, address.port), config.heartbeat_timeout_s
        )
        keep_alive(writer, config.heartbeat_timeout_s)
        return cls(reader, writer, config)

    async def greet(self, secret: str, subscriber: str, resume: str) -> None:
        """The handshake (``FrameRefused``: the peer does not hold ``secret``; a
        ``ConnectionError`` when it hangs up or says nothing in ``heartbeat_timeout_s``)."""
        try:
            self.incoming, self.outgoing = await asyncio.wait_for(
                wire.router_handshake(self.reader, self.writer, secret, subscriber, resume),
                self.config.heartbeat_timeout_s,
            )
        except (asyncio.TimeoutError, EOFError) as e:
            raise ConnectionError(f"no answer to the handshake: {type(e).__name__}") from e
        self.heard = self.loop.time()
        self.ticker = self.loop.create_task(self._tick())

    async def read(self) -> bytes:
        """The next frame's body, its tag and size checked."""
        return await wire.read_frame(self.reader, self.incoming, self.config.max_frame_bytes)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            if self.loop.time() - self.heard > self.config.heartbeat_timeout_s:
                self.timed_out = True
                self.writer.transport.abort()  # the read ends with an EOF
                return
            self.writer.write(self.outgoing.ack(self.got))

    def acknowledge(self, number: int) -> None:
        self.got = number
        if number % ACK_EVERY == 0:
            self.writer.write(self.outgoing.ack(number))

    def close(self, end: bool = False) -> None:
        """Close the connection; ``end``: tell the worker the session is over (no reconnect)."""
        if self.ticker is not None:
            self.ticker.cancel()
        if end and self.outgoing is not None and not self.writer.is_closing():
            self.writer.write(self.outgoing.ack(END))
        self.writer.close()


async def connect(
    address: ChannelAddress, subscriber: str, config: ChannelConfig | None = None,
) -> AsyncGenerator[StepMessage | Notice, None]:
    """The router's side: connect and subscribe (an ``OSError`` when it cannot: nothing
    listens, no answer, or ``ChannelLost`` when the peer does not prove that it holds the
    secret); returns the worker's messages for ``subscriber`` (and ``Notice``s),
    reconnecting after a drop (a ``RESUMED`` notice says so); they end with
    ``ChannelLost`` when the session is over, or a frame is refused."""
    config = config or ChannelConfig()
    link = await _Link.open(address, config)
    try:
        await link.greet(address.secret, subscriber, NEW)
    except FrameRefused as e:
        link.close()
        raise _refused(address, e) from e
    except BaseException:
        link.close()
        raise
    return _messages(address, subscriber, config, link)


async def _messages(
    address: ChannelAddress, subscriber: str, config: ChannelConfig, link: _Link,
) -> AsyncGenerator[StepMessage | Notice, None]:
    got = 0
    try:
        while True:
            try:
                # Bound once per connection: this loop runs per step message.
                read = functools.partial(wire.read_frame, link.reader, link.incoming, config.max_frame_bytes)
                decode, now, acknowledge = wire.decode, link.loop.time, link.acknowledge
                while True:
                    frame = decode(await read())
                    link.heard = now()
                    if type(frame) is HeartbeatFrame:
                        continue
                    number = frame.number
                    if number == got + 1:
                        got = number
                        acknowledge(number)
                        yield wire.message_of(frame)
                    elif number == 0:  # the channel's own notice
                        if frame.kind is NoticeKind.GONE:
                            raise ChannelLost(f"the worker ended the session: {frame.detail}")
                        yield wire.message_of(frame)
                    elif number > got:
                        raise ChannelLost(f"message {got + 1} is missing (got {number})")
                    # else: sent again after a reconnect, and already had
            except FrameRefused as e:
                raise _refused(address, e) from e
            except (EOFError, ConnectionError) as e:
                if isinstance(e, ChannelLost):
                    raise
                why = "silent past the deadline" if link.timed_out else type(e).__name__
                link.close()
                link = await _reconnect(address, subscriber, config, got)
                yield Notice(NoticeKind.RESUMED, f"after {why}, from message {got}")
    finally:
        link.close(end=True)  # the consumer is done: the worker need not wait for a reconnect


def _refused(address: ChannelAddress, e: FrameRefused) -> ChannelLost:
    """Log the refusal of a peer or a frame; the stream ends as a dead worker's does."""
    log.warning("token channel %s:%d: %s; closing the connection", address.host, address.port, e)
    return ChannelLost(f"the token channel at {address.host}:{address.port} was refused: {e}")


async def _reconnect(address: ChannelAddress, subscriber: str, config: ChannelConfig, got: int) -> _Link:
    """Connect again within the grace, resuming after message ``got``, until the worker
    confirms; ``ChannelLost`` when nothing listens (the worker is gone), the peer does
    not prove that it holds the secret, the worker closes the connection unanswered or no
    longer knows the session, or the grace runs out (a worker that accepts but never
    answers, hung, counts as gone too)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.reconnect_grace_s
    delay = min(0.05, config.heartbeat_s)
    while True:
        try:
            link = await _Link.open(address, config)
        except ConnectionRefusedError as e:
            raise ChannelLost(f"nothing listens at {address.host}:{address.port}") from e
        except OSError as e:  # unreachable, timed out: the network, maybe only for now
            if loop.time() + delay > deadline:
                raise ChannelLost(f"no reconnect within {config.reconnect_grace_s}s: {e or type(e).__name__}") from e
            await asyncio.sleep(delay)
            delay = min(2 * delay, config.heartbeat_s)
            continue
        try:
            left_s = max(0.0, deadline - loop.time())
            answer = await asyncio.wait_for(_resume(link, address.secret, subscriber, got), left_s)
        except FrameRefused as e:
            link.close()
            raise _refused(address, e) from e
        except (asyncio.TimeoutError, EOFError, ConnectionError) as e:
            # Connected, then closed or silent: not the network but the worker (dying, hung).
            link.close()
            raise ChannelLost(f"the worker did not take the session back: {type(e).__name__}") from e
        if type(answer) is NoticeFrame and answer.kind is NoticeKind.RESUMED:
            return link
        link.close()
        detail = answer.detail if type(answer) is NoticeFrame else type(answer).__name__
        raise ChannelLost(f"the worker ended the session: {detail}")


async def _resume(link: _Link, secret: str, subscriber: str, got: int) -> wire.Frame:
    """The handshake of a reconnect, and the worker's first frame (a ``RESUMED`` notice if it takes
    the session back)."""
    await link.greet(secret, subscriber, str(got))
    return wire.decode(await link.read())
