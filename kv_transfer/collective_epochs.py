"""The collective backend's channel registries: which pair channels each side has, by
epoch, and which it closed (``kv_transfer.collective`` keeps one ``Outgoing`` per receiver
endpoint and one ``Incoming``).

Channel lifecycle (sender view)::

    first push to endpoint ─▶ build(epoch) ─▶ open ─▶ send, send, ... ─▶ a channel failure
       ─▶ close, epoch += 1 ─▶ next push builds(epoch) ...
    open ─▶ tags would pass TAG_LIMIT ─▶ epoch += 1 (tags from 0); the old channel stays
       open for the transfers prepared on it and closes when the last is released

Each payload names the sender's live epochs (``live``); the receiver closes that sender's
older channels not among them, and refuses payloads of an epoch it has closed.
"""

from __future__ import annotations

import threading
from collections import Counter

from kv_transfer.base import TransferError
from kv_transfer.collective_channels import TAG_LIMIT, PairChannel


class Outgoing:
    """The sender's state towards one receiver endpoint: its live epochs (each with its
    channel once built), the next tag of the current one, and its transfers by state.

    Epoch lifecycle::

        current ─▶ (tags would pass TAG_LIMIT) rotated: its transfers finish, no new ones
                       ─▶ its last transfer released ─▶ closed
        current or rotated ─▶ (a push failed on it, or was abandoned mid-send) dropped,
                       closed at once; a new current epoch if it was the current one

    Every transfer takes its tags from its epoch's own count, so a tag is never reused on
    a channel: gloo matches a message by (peer, tag), and a receive posted for an older
    transfer would take a newer one's bytes. ``state`` guards all of it and is never held
    while a channel builds or closes (``building`` serializes builds), so ``take``,
    ``abandon`` and ``drop``, which run on event loops, never wait for a build.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.next_tag = 0
        self.live: dict[int, PairChannel | None] = {0: None}
        self.outstanding: Counter = Counter()  # epoch -> transfers prepared, not released
        self.posted: set[tuple[int, int]] = set()  # (epoch, first tag) of pushes whose sends are posted
        self.abandoned: set[tuple[int, int]] = set()  # abandoned before their push posted
        self.building = threading.Lock()
        self.state = threading.Lock()

    def take(self, count: int) -> tuple[dict, list[PairChannel]]:
        """Epoch and tags for one transfer (a payload's part), and channels to close."""
        if count > TAG_LIMIT:
            raise TransferError("layout", f"a transfer of {count} messages passes the {TAG_LIMIT} tags of a channel")
        closing = []
        with self.state:
            if self.next_tag + count > TAG_LIMIT:
                # Rather than wrap: a receive of an older transfer may still be posted
                # (or be posted later) on any tag of this channel.
                old, self.epoch, self.next_tag = self.epoch, self.epoch + 1, 0
                self.live[self.epoch] = None
                closing = self._retire_if_done(old)
            first, self.next_tag = self.next_tag, self.next_tag + count
            self.outstanding[self.epoch] += 1
            part = {"epoch": self.epoch, "tag": first, "live": tuple(sorted(self.live))}
        return part, closing

    def release(self, epoch: int, tag: int) -> list[PairChannel]:
        with self.state:
            self.abandoned.discard((epoch, tag))
            if self.outstanding[epoch] > 0:
                self.outstanding[epoch] -= 1
            return self._retire_if_done(epoch)

    def _retire_if_done(self, epoch: int) -> list[PairChannel]:
        if epoch == self.epoch or self.outstanding[epoch] > 0 or epoch not in self.live:
            return []
        del self.outstanding[epoch]
        channel = self.live.pop(epoch)
        return [channel] if channel is not None else []

    def drop(self, epoch: int) -> list[PairChannel]:
        """The epoch's channel failed or cannot be trusted: closed, never used again."""
        with self.state:
            channel = self.live.pop(epoch, None)
            self.outstanding.pop(epoch, None)
            if epoch == self.epoch:
                self.epoch, self.next_tag = self.epoch + 1, 0
                self.live[self.epoch] = None
        return [channel] if channel is not None else []


class Incoming:
    """The receiver's channels by (sender id, epoch), the builds under way, and the
    epochs it closed (never built again: the sender has moved on from them)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.channels: dict[tuple[str, int], PairChannel] = {}
        self._building: dict[tuple[str, int], threading.Lock] = {}
        self._closed: set[tuple[str, int]] = set()

    def enter(self, key: tuple[str, int], live: tuple[int, ...]) -> tuple[threading.Lock, list[PairChannel]]:
        """The build lock of ``key``'s channel, and the sender's older channels it gave up
        (not among ``live``), closed here from now on."""
        sender, epoch = key
        with self.lock:
            if key in self._closed:
                raise TransferError("channel_closed", "the channel this transfer was prepared on closed")
            given_up = [k for k in self.channels if k[0] == sender and k[1] < epoch and k[1] not in live]
            self._closed.update(given_up)
            return self._building.setdefault(key, threading.Lock()), [self.channels.pop(k) for k in given_up]

    def built(self, key: tuple[str, int]) -> PairChannel | None:
        """``key``'s channel if built; raises if its build failed meanwhile."""
        with self.lock:
            if key in self.channels:
                return self.channels[key]
            if key in self._closed:
                raise TransferError("channel_closed", f"no channel from {key[0]}: its build failed")
            return None

    def add(self, key: tuple[str, int], channel: PairChannel) -> None:
        with self.lock:
            self.channels[key] = channel
            self._building.pop(key, None)

    def failed(self, key: tuple[str, int]) -> None:
        """``key``'s build failed: closed for good."""
        with self.lock:
            self._closed.add(key)
            self._building.pop(key, None)

    def drop(self, key: tuple[str, int]) -> PairChannel | None:
        """``key``'s channel failed: closed for good; the channel to close, if built."""
        with self.lock:
            self._closed.add(key)
            return self.channels.pop(key, None)

    def clear(self) -> list[PairChannel]:
        with self.lock:
            channels = list(self.channels.values())
            self.channels.clear()
        return channels
