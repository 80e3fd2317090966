"""The KV hand-off's state: one record per attempt on each side, in one pure state machine.

Pure: no torch, Ray or sockets, and no clock of its own (``now`` comes in, read from one
monotonic clock per side), so every interleaving of reads, deadlines, failures and aborts
can be driven by a test. Each side's table owns its records: a worker's event loop and
its step thread both ask it, so every transition takes the table's lock, and no worker
touches a record the table keeps (``Receiver.get`` hands out a copy, ``Sender.end`` the
record that left). The workers do the I/O a transition allows and report how it ended.

Receiver (the decode worker), one ``Receipt`` per attempt, in ``ReceiptState``::

    reserve ─▶ RESERVED ─▶ LANDING (parts read in order) ─▶ COMPLETE ─▶ released
                  │            │
                  ├── fail ────┴─▶ FAILED ──▶ released    (the worker applies its failure policy)
                  ├── deadline ───▶ EXPIRED ─▶ released   (the same)
                  └── a read that could not be stopped ─▶ QUARANTINED
                                     ─▶ released once the read has settled or its sender is gone

A read runs between ``next_read`` and ``end_read``, one at a time, each exactly where
the last one ended (``next_read`` hands it the block ids to read into and the time left
to the deadline). While one runs, nothing else ends the attempt (not a deadline, a
failure report or an abort): the read's own end decides, and an abort is remembered and
applied then. An attempt is COMPLETE only when exactly its reservation has landed: the
last read must end at the reservation's last block. ``sweep`` is the worker's periodic
look: attempts past their deadline expire, and those whose request no longer waits for
its KV (it ended some other way) are aborted.

Released is the record leaving the table: the caller gets back the ``pins`` it gave at
reservation (the blocks' extra references) and drops them, once. Nothing else frees
them, so no block is freed twice or while a read may still write into it.

Sender (the prefill worker), one ``Offer`` per attempt, in ``OfferState``::

    begin ─▶ COMPUTING ─computed─▶ HANDING_OVER ─▶ end(COMPLETE / FAILED): the record
                │                                   leaves, and the engine frees the
                │                                   blocks it held for the reader
                ├─ offer_parts (pipelined, until ``unwatch``): the blocks computed since
                │    the last part are offered, in order, each once
                └─ past its deadline ─expire─▶ EXPIRED (the receiver has given up: the
                                                prefill is aborted before more is computed)
      any live state ──abort (the reader is dead or the client gone)──▶ end(FAILED) at
          once: the worker wakes the send's ``stop`` and the lease is not waited out

Whoever ends the record (``end``, once) frees the blocks, so they are freed exactly once.
Each read of its blocks is asked through ``ask_read``; once the sender ``retire``s (its
worker leaves its role and its engine will be reset onto the same KV memory) no read is
asked any more, so the reads already asked are the last that can touch the blocks: the
worker waits for their answers before it ends the records.

A second attempt under an id whose record is still in either table is refused.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    import asyncio

P = TypeVar("P")  # a reservation's pins: kept and handed back, never looked into
W = TypeVar("W")  # the sender's handle on a pipelined prefill's parts: kept for it, never used here


class ReceiptState(enum.IntEnum):
    """A receipt's state (the receiver's side), ordered: a later state never goes back."""

    RESERVED = 0  # blocks reserved, nothing read yet
    LANDING = 1  # leading parts read
    COMPLETE = 2  # exactly its reservation landed, and the request took it
    FAILED = 3
    EXPIRED = 4
    QUARANTINED = 5  # a read that could not be stopped may still write into the blocks

    @property
    def live(self) -> bool:
        return self <= ReceiptState.LANDING


class HandoffError(Exception):
    """A read the record does not allow; ``reason`` is a short label for metrics."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Receipt(Generic[P]):
    """The receiver's record of one attempt (``Receiver.get`` hands out a copy)."""

    attempt_id: str
    block_ids: tuple[int, ...]  # the reservation, in token order
    deadline: float  # on the receiver's monotonic clock
    pins: P | None = None  # handed back, once, when the record is released
    sender: str = ""  # who reads into these blocks (a quarantine ends when it is gone)
    landed: int = 0  # leading blocks whose KV is here (those the prefix cache held count)
    reading: tuple[int, int] | None = None  # (first block, count) of the read in flight
    state: ReceiptState = ReceiptState.RESERVED
    aborted: bool = False  # the request ended during a read: release when it ends
    reason: str = ""  # why it failed, expired or was quarantined

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class Read:
    """A read ``next_read`` allows: into ``block_ids``, the reservation's from its
    ``first`` on, within ``time_left`` seconds (to the reservation's deadline)."""

    first: int
    block_ids: list[int]
    time_left: float


@dataclass(frozen=True)
class Ended(Generic[P]):
    """What a transition asks of the worker: ``release`` the pins (None: nothing to
    release), and whether the attempt ``failed`` (its failure policy runs now)."""

    attempt_id: str
    state: ReceiptState
    pins: P | None = None
    failed: bool = False
    reason: str = ""


class Receiver(Generic[P]):
    """The receiver's records, by attempt id. The decode worker's reads (on its event
    loop) and its step thread both ask: every method takes the records' lock."""

    def __init__(self) -> None:
        self._records: dict[str, Receipt[P]] = {}
        self._lock = threading.Lock()

    def __contains__(self, attempt_id: object) -> bool:
        with self._lock:
            return attempt_id in self._records

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def get(self, attempt_id: str) -> Receipt[P] | None:
        """A copy of the record as it is now (None: no record), to look at."""
        with self._lock:
            r = self._records.get(attempt_id)
            return None if r is None else dataclasses.replace(r)

    def states(self) -> dict[str, ReceiptState]:
        """Every record's state now, by attempt id."""
        with self._lock:
            return {aid: r.state for aid, r in self._records.items()}

    @property
    def num_quarantined(self) -> int:
        with self._lock:
            return sum(1 for r in self._records.values() if r.state == ReceiptState.QUARANTINED)

    def reserve(
        self, attempt_id: str, block_ids: Sequence[int], landed: int, deadline: float, pins: P | None = None
    ) -> None:
        """Record a reservation; ``landed``: leading blocks already here (prefix cache)."""
        with self._lock:
            if attempt_id in self._records:
                raise ValueError(f"attempt {attempt_id!r} already has a reservation here")
            if not 0 <= landed <= len(block_ids):
                raise ValueError(f"{landed} blocks landed of a reservation of {len(block_ids)}")
            self._records[attempt_id] = Receipt(attempt_id, tuple(block_ids), deadline, pins, landed=landed)

    def next_read(
        self, attempt_id: str, first: int | None, count: int, now: float, *, last: bool, sender: str = ""
    ) -> Read:
        """Allow a read of ``count`` blocks from the reservation's ``first`` on (None: where
        the last read ended). ``last``: the read that completes the reservation (it must
        end at its last block). Raises ``HandoffError`` (nothing recorded) otherwise."""
        with self._lock:
            r = self._records.get(attempt_id)
            if r is None or not r.state.live or r.aborted:
                raise HandoffError("expired", f"attempt {attempt_id}: no reservation to read into (ended or unknown)")
            if r.reading is not None:
                raise HandoffError("order", f"attempt {attempt_id}: a read is already in flight")
            if now > r.deadline:
                raise HandoffError("timeout", f"attempt {attempt_id}: the reservation's deadline has passed")
            start = r.landed if first is None else first
            if start != r.landed:
                raise HandoffError("order", f"attempt {attempt_id}: a part at block {start}, {r.landed} landed so far")
            end = start + count
            if count < 0 or end > r.num_blocks or (last and end != r.num_blocks):
                raise HandoffError(
                    "incomplete" if last and 0 <= end < r.num_blocks else "layout",
                    f"attempt {attempt_id}: {count} blocks from block {start} for a reservation of {r.num_blocks}"
                    + (" (the last part must end at its last block)" if last else ""),
                )
            r.reading = (start, count)
            if sender:
                r.sender = sender
            return Read(start, list(r.block_ids[start:end]), r.deadline - now)

    def end_read(self, attempt_id: str, error: str = "", *, stuck: bool = False) -> Ended[P] | None:
        """The read in flight ended: landed (``error`` empty), failed (``error`` names
        why) or ``stuck`` (it could not be stopped: the blocks stay out of use). Returns
        what the worker must do, or None while the attempt goes on."""
        with self._lock:
            r = self._records[attempt_id]
            if r.reading is None:
                raise HandoffError("no_read", f"no read of {attempt_id} is in flight")
            first, count = r.reading
            r.reading = None
            if stuck:
                r.state, r.reason = ReceiptState.QUARANTINED, error or "stuck"
                return Ended(attempt_id, r.state, failed=not r.aborted, reason=r.reason)
            if error:
                return self._end(r, ReceiptState.FAILED, error, failed=not r.aborted)
            r.landed = first + count
            if r.aborted:
                return self._end(r, ReceiptState.FAILED, "aborted", failed=False)
            r.state = ReceiptState.LANDING
            return None

    def complete(self, attempt_id: str) -> Ended[P]:
        """The request takes its KV: only when exactly its reservation has landed."""
        with self._lock:
            r = self._records.get(attempt_id)
            if r is None or not r.state.live or r.reading is not None or r.landed != r.num_blocks:
                have = "no reservation" if r is None else f"{r.landed} of {r.num_blocks} blocks landed"
                raise HandoffError("incomplete", f"attempt {attempt_id}: cannot complete ({have})")
            return self._end(r, ReceiptState.COMPLETE, "", failed=False)

    def fail(self, attempt_id: str, reason: str) -> Ended[P] | None:
        """The KV will not come (the sender, the router or a check said so). Ignored while
        a read runs (its own end decides) and for an attempt already ended."""
        with self._lock:
            r = self._records.get(attempt_id)
            if r is None or not r.state.live or r.reading is not None:
                return None
            return self._end(r, ReceiptState.FAILED, reason, failed=True)

    def abort(self, attempt_id: str) -> Ended[P] | None:
        """The request ended here (aborted, its subscriber gone): release its blocks now,
        or when the read in flight ends."""
        with self._lock:
            r = self._records.get(attempt_id)
            return None if r is None else self._abort(r)

    def expire(self, now: float) -> list[Ended[P]]:
        """Attempts past their deadline with no read in flight (a read keeps its own)."""
        with self._lock:
            return self._expire(now)

    def sweep(self, now: float, is_waiting: Callable[[str], bool]) -> list[Ended[P]]:
        """The periodic look: attempts past their deadline expire (``expire``), and those
        whose request no longer ``is_waiting`` for its KV here (it ended some other way)
        are aborted (``abort``)."""
        with self._lock:
            ended = self._expire(now)
            stale = [r for r in self._records.values() if r.state.live and not is_waiting(r.attempt_id)]
            return ended + [e for e in map(self._abort, stale) if e is not None]

    def settled(self, attempt_id: str) -> Ended[P] | None:
        """A quarantined read is confirmed over: its blocks may be used again."""
        with self._lock:
            r = self._records.get(attempt_id)
            if r is None or r.state != ReceiptState.QUARANTINED:
                return None
            return self._release(r)

    def sender_gone(self, sender: str) -> list[Ended[P]]:
        """``sender`` is gone (dead, or its memory deregistered): nothing it was read from
        can still land, so its quarantined attempts are released."""
        with self._lock:
            gone = [r for r in self._records.values() if r.state == ReceiptState.QUARANTINED and r.sender == sender]
            return [self._release(r) for r in gone]

    # The helpers below run under the lock, which the public method took.

    def _abort(self, r: Receipt[P]) -> Ended[P] | None:
        if not r.state.live:
            return None
        if r.reading is not None:
            r.aborted = True
            return None
        return self._end(r, ReceiptState.FAILED, "aborted", failed=False)

    def _expire(self, now: float) -> list[Ended[P]]:
        due = [r for r in self._records.values() if r.state.live and r.reading is None and now > r.deadline]
        return [self._end(r, ReceiptState.EXPIRED, "timeout", failed=True) for r in due]

    def _end(self, r: Receipt[P], state: ReceiptState, reason: str, failed: bool) -> Ended[P]:
        r.state, r.reason = state, reason
        ended = self._release(r)
        return Ended(r.attempt_id, state, ended.pins, failed, reason)

    def _release(self, r: Receipt[P]) -> Ended[P]:
        del self._records[r.attempt_id]
        pins, r.pins = r.pins, None
        return Ended(r.attempt_id, r.state, pins, reason=r.reason)


class OfferState(enum.IntEnum):
    """An offer's state (the sender's side), ordered: a later state never goes back."""

    COMPUTING = 0  # the prefill runs; pipelined, its finished blocks are offered as parts
    HANDING_OVER = 1  # computed: the rest of the KV and the first token offered, the answer awaited
    COMPLETE = 2  # the receiver took it
    FAILED = 3  # the hand-over failed, or the attempt was aborted
    EXPIRED = 4  # still computing past the deadline: the receiver has given up

    @property
    def live(self) -> bool:
        return self <= OfferState.HANDING_OVER


@dataclass
class Offer(Generic[W]):
    """The sender's record of one attempt (``Sender.end`` hands it back as it leaves)."""

    attempt_id: str
    state: OfferState = OfferState.COMPUTING
    offered: int = 0  # leading blocks offered to the receiver so far
    watch: W | None = None  # the worker's handle on a pipelined prefill's parts (None: none, or no more)
    deadline: float = math.inf  # on the sender's monotonic clock: past it, the receiver has given up
    stop: asyncio.Future[str] | None = None  # wakes the worker's send when the record ends early (abort, retire)


class Sender(Generic[W]):
    """The sender's records, by attempt id. The prefill worker's event loop begins and
    ends them while its step thread expires and watches them: every method takes the
    records' lock (iterating them from the step thread while the loop added one killed
    that thread: "dictionary changed size during iteration")."""

    def __init__(self) -> None:
        self._records: dict[str, Offer[W]] = {}
        self._retiring = False  # no read is asked any more (``retire``)
        self._lock = threading.Lock()

    def __contains__(self, attempt_id: object) -> bool:
        with self._lock:
            return attempt_id in self._records

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def states(self) -> dict[str, OfferState]:
        """Every record's state now, by attempt id."""
        with self._lock:
            return {aid: o.state for aid, o in self._records.items()}

    def stops(self) -> list[asyncio.Future[str]]:
        """The ``stop`` handles of every record now (to wake each send as the worker retires)."""
        with self._lock:
            return [o.stop for o in self._records.values() if o.stop is not None]

    @property
    def retiring(self) -> bool:
        """Whether the sender has retired: no read is asked any more."""
        return self._retiring

    def begin(
        self, attempt_id: str, offered: int = 0, watch: W | None = None, deadline: float = math.inf,
        stop: asyncio.Future[str] | None = None,
    ) -> None:
        """A prefill for this attempt starts; ``offered``: leading blocks the receiver
        has already (its prefix cache); ``watch``: where its parts go (pipelined);
        ``stop``: woken by the worker if the record ends early."""
        with self._lock:
            if attempt_id in self._records:
                raise ValueError(f"attempt {attempt_id!r} is already being prefilled or sent here")
            self._records[attempt_id] = Offer(attempt_id, offered=offered, watch=watch, deadline=deadline, stop=stop)

    def expire(self, now: float) -> list[str]:
        """Attempts still computing past their deadline: the receiver has given up on
        them, so their work is dropped (each id is returned once)."""
        with self._lock:
            due = [o for o in self._records.values() if o.state == OfferState.COMPUTING and now > o.deadline]
            for offer in due:
                offer.state = OfferState.EXPIRED
        return [o.attempt_id for o in due]

    def watched(self) -> list[tuple[str, W]]:
        """The pipelined attempts whose parts are still offered, with their handles."""
        with self._lock:
            return [(o.attempt_id, o.watch) for o in self._records.values() if o.watch is not None]

    def offer_parts(self, attempt_id: str, computed: Sequence[int]) -> tuple[int, list[int]] | None:
        """``computed``: the attempt's finished blocks so far, in token order. Returns the
        first of those not offered yet and the blocks from it on, now offered (each block
        once, in order); None when none is new or the attempt is not watched."""
        with self._lock:
            offer = self._records.get(attempt_id)
            if offer is None or offer.watch is None or len(computed) <= offer.offered:
                return None
            first, offer.offered = offer.offered, len(computed)
        return first, list(computed[first:])

    def unwatch(self, attempt_id: str) -> None:
        """No part is offered after this: what is left goes with the first token."""
        with self._lock:
            offer = self._records.get(attempt_id)
            if offer is not None:
                offer.watch = None

    def computed(self, attempt_id: str) -> None:
        """The prefill finished: what is left is the hand-over itself."""
        with self._lock:
            offer = self._records.get(attempt_id)
            if offer is not None and offer.state == OfferState.COMPUTING:
                offer.state = OfferState.HANDING_OVER

    def ask_read(self, attempt_id: str) -> bool:
        """Whether the receiver may be asked to read (part of) this attempt's blocks now:
        only while its record is live and the sender is not retiring."""
        with self._lock:
            offer = self._records.get(attempt_id)
            return not self._retiring and offer is not None and offer.state.live

    def retire(self) -> None:
        """No read is asked from now on (the worker leaves its role): the reads asked so
        far are the last that may touch the blocks."""
        with self._lock:
            self._retiring = True

    def end(self, attempt_id: str, state: OfferState) -> Offer[W] | None:
        """The receiver answered (or the transfer failed, or the attempt was aborted):
        the record leaves in ``state``; the caller frees the blocks held for the reader,
        once, and wakes its ``stop`` if it ended early."""
        with self._lock:
            offer = self._records.pop(attempt_id, None)
            if offer is not None:
                offer.state = state
        return offer
