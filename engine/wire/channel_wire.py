"""The token channel's wire: its handshake, each connection's keys, sealed frames, and the
fixed schema of what the frames carry (``engine/wire/token_channel.py`` and
``engine/wire/channel_server.py`` run the sessions on it).

Nothing here unpickles. A frame's body is MessagePack of one of the frame structs below,
decoded against that schema (msgspec): ints, strings, floats and lists of them where the
schema has them, or the frame is refused. The step message's deltas are ``StreamDelta``s,
in its field order (``engine/wire/messages.py``: the decode worker's ``_wire`` builds them).

The handshake (R the router, W the decode worker, s the secret R got from W over Ray)::

    R ─▶ W   MAGIC, nonce_r                                  (32 random bytes; nothing secret)
    W ─▶ R   nonce_s, HMAC(s, "worker proof" ‖ nonce_r ‖ nonce_s)
             R checks it before it sends anything more or parses a byte more: whatever
             answers on a worker's old address without the secret is refused here
    R ─▶ W   HMAC(s, "router proof" ‖ nonce_r ‖ nonce_s ‖ line), line = "<subscriber> <resume>\\n"
             W checks it and closes on a peer that does not hold the secret

Each direction then has a key of its own for this connection, HMAC(s, label ‖ nonce_r ‖
nonce_s). A frame from W is a 4-byte little-endian body length, a 16-byte tag and the
body; the tag is HMAC-SHA256, truncated, of the frame's count on the connection (1, 2, ...,
never sent) and its body. The reader refuses a length over its cap before it reads the
body, and a tag that does not match (the frame altered, replayed, dropped or reordered)
before it decodes anything. A frame from R is fixed: an 8-byte number (the last message it
got, or ``END``: it is done with the session) and its tag, counted the same way.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass

import msgspec

from engine.wire.messages import DecodeLoad, StepMessage, StreamDelta

MAGIC = b"tandem-channel/2"  # the router's first bytes: this protocol, this version
NONCE_BYTES = 32
PROOF_BYTES = 32  # HMAC-SHA256
TAG_BYTES = 16  # HMAC-SHA256 truncated: a forger's chance per frame is 2**-128
MAX_HELLO_BYTES = 1024  # the router's line: subscriber and resume
END = 2**64 - 1  # the router's number when it is done with the session (no reconnect)
_HEADER = struct.Struct("<I16s")  # body length, tag
_NUMBER = struct.Struct("<Q")
ACK_BYTES = _NUMBER.size + TAG_BYTES


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


class FrameRefused(ValueError):
    """The peer does not hold the secret, or sent a frame that is too big, fails its tag or
    does not fit the schema: the connection is not to be read any further."""


# -- the schema ---------------------------------------------------------------------------


class StepFrame(msgspec.Struct, array_like=True, gc=False, tag=1):
    """A numbered ``StepMessage``: the worker's load after the step, and the subscriber's deltas."""

    number: int
    load: DecodeLoad | None
    deltas: list[StreamDelta]


class NoticeFrame(msgspec.Struct, array_like=True, gc=False, tag=2):
    """A ``Notice``: numbered when the serving sent it, 0 when the channel itself did."""

    number: int
    kind: NoticeKind
    detail: str


class HeartbeatFrame(msgspec.Struct, array_like=True, gc=False, tag=0):
    """Nothing to say: the worker is alive (outside the numbering)."""


Frame = StepFrame | NoticeFrame | HeartbeatFrame
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Frame).decode
HEARTBEAT = _encode(HeartbeatFrame())


def encode(message: Notice | StepMessage, number: int = 0) -> bytes:
    """The body of one message's frame: a ``Notice``, or a ``StepMessage`` (load, deltas)."""
    if isinstance(message, Notice):
        return _encode(NoticeFrame(number, message.kind, message.detail))
    load, deltas = message
    return _encode(StepFrame(number, load, deltas))


def decode(body: bytes) -> Frame:
    """One frame's body, checked against the schema (``FrameRefused`` where it does not fit)."""
    try:
        frame: Frame = _decode(body)
    except msgspec.MsgspecError as e:
        raise FrameRefused(f"a frame that does not fit the schema: {e}") from e
    return frame


def message_of(frame: StepFrame | NoticeFrame) -> StepMessage | Notice:
    """What the channel's reader gets: a ``StepMessage`` tuple, as over Ray, or a ``Notice``."""
    if isinstance(frame, StepFrame):
        return frame.load, frame.deltas
    return Notice(frame.kind, frame.detail)


# -- sealed frames --------------------------------------------------------------------------


class Seal:
    """One direction of one connection: each frame's tag is an HMAC, under that direction's
    key, of the frame's count and body; the writer and the reader count alike."""

    __slots__ = ("_mac", "count")

    def __init__(self, key: bytes) -> None:
        self._mac = hmac.new(key, digestmod=hashlib.sha256)  # keyed once; copied per frame
        self.count = 0

    def tag(self, body: bytes) -> bytes:
        """The tag of the next frame (each call counts one)."""
        self.count += 1
        mac = self._mac.copy()
        mac.update(_NUMBER.pack(self.count))
        mac.update(body)
        return mac.digest()[:TAG_BYTES]

    def seal(self, body: bytes) -> bytes:
        """A worker's frame as it goes on the wire."""
        return _HEADER.pack(len(body), self.tag(body)) + body

    def ack(self, number: int) -> bytes:
        """A router's frame: the last message it got (or ``END``)."""
        body = _NUMBER.pack(number)
        return body + self.tag(body)

    def open_ack(self, data: bytes) -> int:
        """The number in a router's frame (``ACK_BYTES`` long); ``FrameRefused`` if forged."""
        body = data[:_NUMBER.size]
        if not hmac.compare_digest(self.tag(body), data[_NUMBER.size:]):
            raise FrameRefused("a frame from the router failed its tag")
        return int(_NUMBER.unpack(body)[0])


async def read_frame(reader: asyncio.StreamReader, seal: Seal, max_bytes: int) -> bytes:
    """The next frame's body from a worker, its tag checked; a length over ``max_bytes`` is
    refused before anything of that size is read."""
    size, tag = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > max_bytes:
        raise FrameRefused(f"a frame of {size} bytes is over channel.max_frame_bytes ({max_bytes})")
    body = await reader.readexactly(size)
    if not hmac.compare_digest(seal.tag(body), tag):
        raise FrameRefused("a frame failed its tag (altered, replayed, dropped or out of order)")
    return body


# -- the handshake --------------------------------------------------------------------------


def _mac(secret: str, label: bytes, *parts: bytes) -> bytes:
    return hmac.digest(secret.encode(), b"".join((MAGIC, b" ", label, b"\0", *parts)), "sha256")


def _seals(secret: str, nonce_r: bytes, nonce_s: bytes) -> tuple[Seal, Seal]:
    """(worker to router, router to worker) for the connection of these nonces."""
    return (Seal(_mac(secret, b"worker-to-router key", nonce_r, nonce_s)),
            Seal(_mac(secret, b"router-to-worker key", nonce_r, nonce_s)))


async def router_handshake(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: str, subscriber: str, resume: str,
) -> tuple[Seal, Seal]:
    """The router's side: (incoming, outgoing) seals. ``FrameRefused`` when the peer does
    not prove that it holds ``secret``; by then it has been sent only a nonce."""
    nonce_r = secrets.token_bytes(NONCE_BYTES)
    writer.write(MAGIC + nonce_r)
    answer = await reader.readexactly(NONCE_BYTES + PROOF_BYTES)
    nonce_s, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _mac(secret, b"worker proof", nonce_r, nonce_s)):
        raise FrameRefused("the peer at the worker's address does not hold the channel's secret")
    line = f"{subscriber} {resume}\n".encode()
    writer.write(_mac(secret, b"router proof", nonce_r, nonce_s, line) + line)
    return _seals(secret, nonce_r, nonce_s)


async def worker_handshake(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: str,
) -> tuple[str, str, Seal, Seal]:
    """The worker's side: (subscriber, resume, incoming seal, outgoing seal). ``FrameRefused``
    when the peer does not speak this protocol or does not prove that it holds ``secret``."""
    hello = await reader.readexactly(len(MAGIC) + NONCE_BYTES)
    if not hello.startswith(MAGIC):
        raise FrameRefused("not a router of this channel's protocol")
    nonce_r, nonce_s = hello[len(MAGIC):], secrets.token_bytes(NONCE_BYTES)
    writer.write(nonce_s + _mac(secret, b"worker proof", nonce_r, nonce_s))
    proof = await reader.readexactly(PROOF_BYTES)
    line = await reader.readuntil(b"\n")
    if len(line) > MAX_HELLO_BYTES or not hmac.compare_digest(
        proof, _mac(secret, b"router proof", nonce_r, nonce_s, line)
    ):
        raise FrameRefused("the router does not hold the channel's secret")
    subscriber, _, resume = line.decode(errors="replace").strip().partition(" ")
    outgoing, incoming = _seals(secret, nonce_r, nonce_s)
    return subscriber, resume, incoming, outgoing
