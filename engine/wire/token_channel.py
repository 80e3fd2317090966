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

Where the parts live: this module is the router's end (``connect``) and the channel's
door (every name below is imported from here); ``engine/wire/channel_server.py`` is the
worker's end (``ChannelServer`` and its sessions); ``engine/wire/channel_config.py`` has
the settings, the address and the socket options both ends use; ``engine/wire/channel_wire.py``
the handshake and the frames.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator

from engine.wire import channel_wire as wire
from engine.wire.channel_config import ACK_EVERY, NEW, ChannelAddress, ChannelConfig, ChannelLost, keep_alive
from engine.wire.channel_server import ChannelServer
from engine.wire.channel_wire import END, FrameRefused, HeartbeatFrame, Notice, NoticeFrame, NoticeKind, Seal
from engine.wire.messages import StepMessage

# The channel's names, wherever they are defined, are imported from here.
__all__ = [
    "ChannelAddress", "ChannelConfig", "ChannelLost", "ChannelServer", "Notice", "NoticeKind", "connect", "keep_alive",
]

log = logging.getLogger(__name__)


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
