"""The token channel's settings, its address and the socket options both of its ends use.

``engine/wire/token_channel.py`` has the protocol (sessions, resume, liveness, trust) and
the router's end; ``engine/wire/channel_server.py`` the worker's. Both stand on this
module: ``ChannelConfig`` (timings and bounds, the router's and the workers' alike),
``ChannelAddress`` (where a worker listens, and its secret), ``ChannelLost`` (a session
is over) and ``keep_alive`` (TCP keepalive and ``TCP_USER_TIMEOUT``).
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, fields

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

