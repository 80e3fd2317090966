"""The KV hand-off's state: one record per attempt on each side, in one pure state machine.

Pure: no torch, Ray or sockets, and no clock of its own (``now`` comes in, read from one
monotonic clock per side), so every interleaving of reads, deadlines, failures and aborts
can be driven by a test. The workers ask it instead of keeping maps and flags of their
own; they do the I/O it allows and report how it ended.

Receiver (the decode worker), one ``Receipt`` per attempt::

    reserve ─▶ RESERVED ─▶ LANDING (parts read in order) ─▶ COMPLETE ─▶ released
                  │            │
                  ├── fail ────┴─▶ FAILED ──▶ released    (the worker applies its failure policy)
                  ├── deadline ───▶ EXPIRED ─▶ released   (the same)
                  └── a read that could not be stopped ─▶ QUARANTINED
                                     ─▶ released once the read has settled or its sender is gone

A read runs between ``begin_read`` and ``end_read``, one at a time, each exactly where
the last one ended. While one runs, nothing else ends the attempt (not a deadline, a
failure report or an abort): the read's own end decides, and an abort is remembered and
applied then. An attempt is COMPLETE only when exactly its reservation has landed: the
last read must end at the reservation's last block.

Released is the record leaving the table: the caller gets back the ``pins`` it gave at
reservation (the blocks' extra references) and drops them, once. Nothing else frees
them, so no block is freed twice or while a read may still write into it.

Sender (the prefill worker), one ``Offer`` per attempt::

    begin ─▶ RESERVED (computing; finished blocks offered as parts) ─computed─▶ LANDING
          ─▶ end(COMPLETE / FAILED): the record leaves, and the engine frees the blocks
             it held for the reader
    RESERVED past its deadline ─expire─▶ EXPIRED (the receiver has given up: the prefill
                                          is aborted before more of it is computed)
      any live state ──abort (the reader is dead or the client gone)──▶ FAILED, released
          at once: the send stops waiting for the answer and the lease is not waited out

Whoever ends the record (``end``, once) frees the blocks, so they are freed exactly once.
Each read of its blocks is asked through ``ask_read``; once the sender ``retire``s (its
worker leaves its role and its engine will be reset onto the same KV memory) no read is
asked any more, so the reads already asked are the last that can touch the blocks: the
worker waits for their answers before it ends the records.

A second attempt under an id whose record is still in either table is refused.
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class HandoffState(enum.IntEnum):
    """Ordered: a later state never goes back to an earlier one."""

    RESERVED = 0  # receiver: blocks reserved, nothing read yet; sender: computing
    LANDING = 1  # receiver: leading parts read; sender: parts or the whole offered
    COMPLETE = 2  # receiver: exactly its reservation landed; sender: the receiver took it
    FAILED = 3
    EXPIRED = 4
    QUARANTINED = 5  # a read that could not be stopped may still write into the blocks

    @property
    def live(self) -> bool:
        return self <= HandoffState.LANDING


class HandoffError(Exception):
    """A read the record does not allow; ``reason`` is a short label for metrics."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Receipt:
    """The receiver's record of one attempt."""

    attempt_id: str
    block_ids: tuple[int, ...]  # the reservation, in token order
    deadline: float  # on the receiver's monotonic clock
    pins: Any = None  # handed back, once, when the record is released
    sender: str = ""  # who reads into these blocks (a quarantine ends when it is gone)
    landed: int = 0  # leading blocks whose KV is here (those the prefix cache held count)
    reading: tuple[int, int] | None = None  # (first block, count) of the read in flight
    state: HandoffState = HandoffState.RESERVED
    aborted: bool = False  # the request ended during a read: release when it ends
    reason: str = ""  # why it failed, expired or was quarantined

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class Ended:
    """What a transition asks of the worker: ``release`` the pins (None: nothing to
    release), and whether the attempt ``failed`` (its failure policy runs now)."""

    attempt_id: str
    state: HandoffState
    pins: Any = None
    failed: bool = False
    reason: str = ""


@dataclass
class Receiver:
    """The receiver's records, by attempt id."""

    records: dict[str, Receipt] = field(default_factory=dict)

    def __contains__(self, attempt_id: str) -> bool:
        return attempt_id in self.records

    def __len__(self) -> int:
        return len(self.records)

    def get(self, attempt_id: str) -> Receipt | None:
        return self.records.get(attempt_id)

    def reserve(
        self, attempt_id: str, block_ids: Sequence[int], landed: int, deadline: float, pins: Any = None
    ) -> Receipt:
        """Record a reservation; ``landed``: leading blocks already here (prefix cache)."""
        if attempt_id in self.records:
            raise ValueError(f"attempt {attempt_id!r} already has a reservation here")
        if not 0 <= landed <= len(block_ids):
            raise ValueError(f"{landed} blocks landed of a reservation of {len(block_ids)}")
        receipt = Receipt(attempt_id, tuple(block_ids), deadline, pins, landed=landed)
        self.records[attempt_id] = receipt
        return receipt

    def begin_read(self, attempt_id: str, first: int, count: int, now: float, *, last: bool, sender: str = ""
                   ) -> list[int]:
        """Allow a read of ``count`` blocks from the reservation's ``first`` on; returns the
        block ids to read into. ``last``: the read that completes the reservation (it must
        end at its last block). Raises ``HandoffError`` (nothing recorded) otherwise."""
        r = self.records.get(attempt_id)
        if r is None or not r.state.live or r.aborted:
            raise HandoffError("expired", f"attempt {attempt_id}: no reservation to read into (ended or unknown)")
        if r.reading is not None:
            raise HandoffError("order", f"attempt {attempt_id}: a read is already in flight")
        if now > r.deadline:
            raise HandoffError("timeout", f"attempt {attempt_id}: the reservation's deadline has passed")
        if first != r.landed:
            raise HandoffError("order", f"attempt {attempt_id}: a part at block {first}, {r.landed} landed so far")
        end = first + count
        if count < 0 or end > r.num_blocks or (last and end != r.num_blocks):
            raise HandoffError(
                "incomplete" if last and 0 <= end < r.num_blocks else "layout",
                f"attempt {attempt_id}: {count} blocks from block {first} for a reservation of {r.num_blocks}"
                + (" (the last part must end at its last block)" if last else ""),
            )
        r.reading = (first, count)
        if sender:
            r.sender = sender
        return list(r.block_ids[first:end])

    def end_read(self, attempt_id: str, error: str = "", *, stuck: bool = False) -> Ended | None:
        """The read in flight ended: landed (``error`` empty), failed (``error`` names
        why) or ``stuck`` (it could not be stopped: the blocks stay out of use). Returns
        what the worker must do, or None while the attempt goes on."""
        r = self.records[attempt_id]
        if r.reading is None:
            raise HandoffError("no_read", f"no read of {attempt_id} is in flight")
        first, count = r.reading
        r.reading = None
        if stuck:
            r.state, r.reason = HandoffState.QUARANTINED, error or "stuck"
            return Ended(attempt_id, r.state, failed=not r.aborted, reason=r.reason)
        if error:
            return self._end(r, HandoffState.FAILED, error, failed=not r.aborted)
        r.landed = first + count
        if r.aborted:
            return self._end(r, HandoffState.FAILED, "aborted", failed=False)
        r.state = HandoffState.LANDING
        return None

    def complete(self, attempt_id: str) -> Ended:
        """The request takes its KV: only when exactly its reservation has landed."""
        r = self.records.get(attempt_id)
        if r is None or not r.state.live or r.reading is not None or r.landed != r.num_blocks:
            have = "no reservation" if r is None else f"{r.landed} of {r.num_blocks} blocks landed"
            raise HandoffError("incomplete", f"attempt {attempt_id}: cannot complete ({have})")
        return self._end(r, HandoffState.COMPLETE, "", failed=False)

    def fail(self, attempt_id: str, reason: str) -> Ended | None:
        """The KV will not come (the sender, the router or a check said so). Ignored while
        a read runs (its own end decides) and for an attempt already ended."""
        r = self.records.get(attempt_id)
        if r is None or not r.state.live or r.reading is not None:
            return None
        return self._end(r, HandoffState.FAILED, reason, failed=True)

    def abort(self, attempt_id: str) -> Ended | None:
        """The request ended here (aborted, its subscriber gone): release its blocks now,
        or when the read in flight ends."""
        r = self.records.get(attempt_id)
        if r is None or not r.state.live:
            return None
        if r.reading is not None:
            r.aborted = True
            return None
        return self._end(r, HandoffState.FAILED, "aborted", failed=False)

    def expire(self, now: float) -> list[Ended]:
        """Attempts past their deadline with no read in flight (a read keeps its own)."""
        due = [r for r in self.records.values() if r.state.live and r.reading is None and now > r.deadline]
        return [self._end(r, HandoffState.EXPIRED, "timeout", failed=True) for r in due]

    def settled(self, attempt_id: str) -> Ended | None:
        """A quarantined read is confirmed over: its blocks may be used again."""
        r = self.records.get(attempt_id)
        if r is None or r.state != HandoffState.QUARANTINED:
            return None
        return self._release(r)

    def sender_gone(self, sender: str) -> list[Ended]:
        """``sender`` is gone (dead, or its memory deregistered): nothing it was read from
        can still land, so its quarantined attempts are released."""
        gone = [r for r in self.records.values() if r.state == HandoffState.QUARANTINED and r.sender == sender]
        return [self._release(r) for r in gone]

    @property
    def num_quarantined(self) -> int:
        return sum(1 for r in self.records.values() if r.state == HandoffState.QUARANTINED)

    def _end(self, r: Receipt, state: HandoffState, reason: str, failed: bool) -> Ended:
        r.state, r.reason = state, reason
        ended = self._release(r)
        return Ended(r.attempt_id, state, ended.pins, failed, reason)

    def _release(self, r: Receipt) -> Ended:
        del self.records[r.attempt_id]
        pins, r.pins = r.pins, None
        return Ended(r.attempt_id, r.state, pins, reason=r.reason)


@dataclass
class Offer:
    """The sender's record of one attempt."""

    attempt_id: str
    state: HandoffState = HandoffState.RESERVED
    offered: int = 0  # leading blocks offered to the receiver so far
    watch: Any = None  # the worker's handle on a pipelined prefill's parts
    deadline: float = math.inf  # on the sender's monotonic clock: past it, the receiver has given up
    stop: Any = None  # the worker's handle that wakes its send when the record ends early (abort)


@dataclass
class Sender:
    """The sender's records, by attempt id. The prefill worker's event loop begins and
    ends them while its step thread expires and watches them: every method takes the
    records' lock (iterating them from the step thread while the loop added one killed
    that thread: "dictionary changed size during iteration")."""

    records: dict[str, Offer] = field(default_factory=dict)
    retiring: bool = False  # no read is asked any more (``retire``)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __contains__(self, attempt_id: str) -> bool:
        return attempt_id in self.records

    def __len__(self) -> int:
        return len(self.records)

    def offers(self) -> list[Offer]:
        """Every record now (a copy: safe to walk while the other thread changes them)."""
        with self._lock:
            return list(self.records.values())

    def get(self, attempt_id: str) -> Offer | None:
        return self.records.get(attempt_id)

    def begin(
        self, attempt_id: str, offered: int = 0, watch: Any = None, deadline: float = math.inf, stop: Any = None
    ) -> Offer:
        """A prefill for this attempt starts; ``offered``: leading blocks the receiver
        has already (its prefix cache)."""
        with self._lock:
            if attempt_id in self.records:
                raise ValueError(f"attempt {attempt_id!r} is already being prefilled or sent here")
            offer = self.records[attempt_id] = Offer(attempt_id, offered=offered, watch=watch, deadline=deadline,
                                                     stop=stop)
        return offer

    def expire(self, now: float) -> list[Offer]:
        """Attempts still computing past their deadline: the receiver has given up on
        them, so their work is dropped (each is returned once)."""
        with self._lock:
            due = [o for o in self.records.values() if o.state == HandoffState.RESERVED and now > o.deadline]
            for offer in due:
                offer.state = HandoffState.EXPIRED
        return due

    def computed(self, attempt_id: str) -> None:
        """The prefill finished: what is left is the hand-over itself."""
        with self._lock:
            offer = self.records.get(attempt_id)
            if offer is not None and offer.state == HandoffState.RESERVED:
                offer.state = HandoffState.LANDING

    def ask_read(self, attempt_id: str) -> bool:
        """Whether the receiver may be asked to read (part of) this attempt's blocks now:
        only while its record is live and the sender is not retiring."""
        with self._lock:
            offer = self.records.get(attempt_id)
            return not self.retiring and offer is not None and offer.state.live

    def retire(self) -> None:
        """No read is asked from now on (the worker leaves its role): the reads asked so
        far are the last that may touch the blocks."""
        with self._lock:
            self.retiring = True

    def end(self, attempt_id: str, state: HandoffState) -> Offer | None:
        """The receiver answered (or the transfer failed): the record leaves; the caller
        frees the blocks held for the reader, once."""
        with self._lock:
            offer = self.records.pop(attempt_id, None)
            if offer is not None:
                offer.state = state
        return offer
