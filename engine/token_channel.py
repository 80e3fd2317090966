"""A decode worker's token channel: its step messages over a plain TCP connection.

Ray's streaming generators cost about a millisecond of CPU per message between the two
processes (the worker's report thread and gRPC, the router's object-ref machinery),
which at one message per engine step is more than the rest of the token path. A
decode worker therefore also serves its ``subscribe`` stream over TCP: the router
asks it once (a Ray call) for the address and a secret, connects, says who it is, and
from then on reads length-prefixed pickled ``StepMessage`` frames. Ray still carries
every request and control call; only the per-step messages take this path.

The connection is the subscription: when it closes the worker aborts that
subscriber's requests, and when the worker dies the router's read ends (the kernel
closes the socket of a killed process; TCP keepalive catches a vanished host), so it
behaves as the Ray stream did. The secret keeps anything but the router that asked
from subscribing; frames flow one way, from worker to router, which unpickles only
what the worker it placed requests on sends, as Ray itself does.

Wire format: the router sends one line, ``<secret> <subscriber>\\n``; the worker then
sends frames of a 4-byte little-endian length and a pickle (protocol 5).
"""

from __future__ import annotations

import asyncio
import hmac
import pickle
import secrets
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

_LENGTH = struct.Struct("<I")
HELLO_TIMEOUT_S = 5.0
MAX_HELLO_BYTES = 1024
# A router on a host that vanished without closing the connection is noticed after
# about KEEPALIVE_IDLE_S + KEEPALIVE_PROBES * KEEPALIVE_INTERVAL_S of silence.
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_PROBES = 3


@dataclass(frozen=True)
class ChannelAddress:
    """Where a decode worker's token channel listens, and the secret that opens it."""

    host: str
    port: int
    secret: str


def frame(message) -> bytes:
    """One message as it goes on the wire."""
    body = pickle.dumps(message, protocol=5)
    return _LENGTH.pack(len(body)) + body


def keep_alive(writer: asyncio.StreamWriter) -> None:
    """Turn on TCP keepalive, so a peer whose host vanished ends the connection."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        if hasattr(socket, name):  # Linux; elsewhere the system's defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class ChannelServer:
    """The worker's side: accepts subscribers and runs ``serve(subscriber, send)`` for
    each until the connection closes (``send`` writes one message; the serving task is
    cancelled when the subscriber hangs up)."""

    def __init__(self, serve: Callable[[str, Callable[[object], Awaitable[None]]], Awaitable[None]]) -> None:
        self._serve = serve
        self._secret = secrets.token_hex(16)
        self._server: asyncio.AbstractServer | None = None
        self.address: ChannelAddress | None = None

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

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await asyncio.wait_for(reader.readuntil(b"\n"), HELLO_TIMEOUT_S)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        secret, _, subscriber = hello[:MAX_HELLO_BYTES].decode(errors="replace").strip().partition(" ")
        if not subscriber or not hmac.compare_digest(secret, self._secret):
            writer.close()
            return
        keep_alive(writer)
        serving = asyncio.current_task()

        async def watch() -> None:
            try:
                while await reader.read(4096):  # the subscriber sends nothing more after its hello
                    pass
            except ConnectionError:
                pass
            serving.cancel()  # it hung up (a reset too)

        watcher = asyncio.get_running_loop().create_task(watch())

        async def send(message) -> None:
            writer.write(frame(message))
            await writer.drain()

        try:
            await self._serve(subscriber, send)
        except (asyncio.CancelledError, ConnectionError):
            pass  # the subscriber went away
        finally:
            watcher.cancel()
            writer.close()


async def connect(address: ChannelAddress, subscriber: str) -> AsyncIterator:
    """The router's side: connect (``OSError`` when it cannot) and subscribe; returns the
    worker's messages for ``subscriber``, which end with ``asyncio.IncompleteReadError``
    (an ``EOFError``) or ``ConnectionError`` when the worker goes away."""
    reader, writer = await asyncio.open_connection(address.host, address.port)
    keep_alive(writer)
    writer.write(f"{address.secret} {subscriber}\n".encode())
    return _messages(reader, writer)


async def _messages(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> AsyncIterator:
    try:
        unpack, loads, readexactly = _LENGTH.unpack, pickle.loads, reader.readexactly
        while True:
            (size,) = unpack(await readexactly(_LENGTH.size))
            yield loads(await readexactly(size))
    finally:
        writer.close()
