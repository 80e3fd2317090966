"""Tensor parallelism between CPU processes of one host: the collectives through shared
memory.

``SharedMemoryGroup`` is the ``TPGroup`` (``engine.model.parallel``) of ranks that share a
host's memory, as the offline engine's spawned CPU ranks do. A decode step makes two
all-reduces a layer; over gloo each costs a hand-off to gloo's worker thread and a TCP round
trip, about 1 ms on a small busy host, more than a small model's layer takes. Here each
collective is rounds: in each, every rank copies its part into its own slot of a mapped
file, publishes the round's number in its counter and waits until every counter has
reached it; then it reads the slots: an all-reduce sums them in rank order (the same
additions on every rank, so the same bits), an all-gather copies them out, a broadcast
reads rank 0's (a pickle after its length). A part larger than a slot takes several rounds.

The slots come in two sets, used by turns: a rank writes round e's set only after every
rank has published round e - 1, which each does only after reading round e - 2 from that
set, so one wait a round suffices. Each counter has one writer, and x86 keeps a core's
stores, and another's loads, in program order (the data is seen before the counter that
announces it): no atomics are needed. Other processors may reorder them, so
``supported()`` says whether the group can be used there (elsewhere the ranks use gloo).

Waiting spins (yielding the core) for ``SPIN_S``, then polls, every ``POLL_S`` and after a
second every ``IDLE_POLL_S``, asking ``peers_alive`` as it goes, so a rank whose peer died
raises within ``CHECK_EVERY_S`` rather than at ``timeout_s``. A rank other than 0 waits for
the next broadcast (the next step, which may be hours away offline) without a deadline.

Life: rank 0 creates the file under /dev/shm and names it in the store ─▶ every rank maps
it and says so in the store ─▶ rank 0 unlinks the file (the mappings stay; no file
outlives the ranks, even after a crash) ─▶ collectives ─▶ close (unmapped).
"""

from __future__ import annotations

import os
import pickle
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

SLOT_BYTES = 2 << 20  # one rank's share of one round (a decode step's hidden states fit in one)
COUNTER_BYTES = 64  # one cache line per rank's counter
SPIN_S = 0.002
POLL_S = 50e-6
IDLE_POLL_S = 0.001  # after a second's wait: an idle rank's cost stays small
CHECK_EVERY_S = 0.05  # how often a long wait asks whether the peers are alive


def supported() -> bool:
    """Whether this processor keeps stores in order for the other cores (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class SharedMemoryGroup:
    """The ranks' group on CPU tensors through a shared mapping (module docstring). ``store``:
    a ``torch.distributed`` store every rank reaches; ``prefix`` keeps this group's keys
    apart; ``timeout_s`` bounds every wait but a non-zero rank's for the next broadcast;
    ``peers_alive``: whether the other ranks' processes still run, asked during long waits."""

    def __init__(
        self, store, rank: int, size: int, prefix: str = "tp", timeout_s: float = 60.0,
        peers_alive: Callable[[], bool] = lambda: True,
    ) -> None:
        self.rank, self.size = rank, size
        self.timeout_s = timeout_s
        self._peers_alive = peers_alive
        nbytes = size * COUNTER_BYTES + 2 * size * SLOT_BYTES
        key = f"{prefix}/shm/path"
        self._round = 0
        if rank != 0:
            path = store.get(key).decode()
            if not os.path.exists(path):  # (mapping it would make a new, private file)
                raise RuntimeError(
                    f"rank {rank} does not see rank 0's shared memory {path}: a shared-memory group "
                    "needs every rank on one host (ranks on several use gloo)"
                )
            self._map(path, nbytes)
            store.set(f"{prefix}/shm/mapped/{rank}", "1")
            return
        fd, path = tempfile.mkstemp(prefix="tandem-tp-", dir=_shm_dir())
        try:
            os.ftruncate(fd, nbytes)
            os.close(fd)
            self._map(path, nbytes)
            store.set(key, path)
            self._wait_mapped(store, [f"{prefix}/shm/mapped/{r}" for r in range(1, size)])
        finally:
            Path(path).unlink(missing_ok=True)  # the mappings stay; no file is left behind

    def _map(self, path: str, nbytes: int) -> None:
        self._mapping: torch.Tensor | None = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        self._counters = self._mapping[: self.size * COUNTER_BYTES].numpy().view(np.int64)[:: COUNTER_BYTES // 8]
        self._slots = self._mapping[self.size * COUNTER_BYTES :].view(2, self.size, SLOT_BYTES)

    def _wait_mapped(self, store, keys: list[str]) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not store.check(keys):
            if not self._peers_alive():
                raise RuntimeError("a rank's process exited before it joined the shared-memory group")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the ranks did not join the shared-memory group within {self.timeout_s:.0f} s")
            time.sleep(0.005)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over the ranks, in place (returned for chaining)."""
        if self.size == 1:
            return tensor
        flat = tensor.contiguous().view(-1)  # ``tensor`` itself when it is contiguous
        per = SLOT_BYTES // flat.element_size()
        for start in range(0, flat.numel(), per):
            part = flat[start : start + per]
            slots = self._publish(part)[:, : part.numel() * part.element_size()].view(part.dtype)
            torch.add(slots[0], slots[1], out=part)
            for r in range(2, self.size):
                part.add_(slots[r])
        if not tensor.is_contiguous():
            tensor.copy_(flat.view_as(tensor))
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' tensors concatenated along ``dim``, rank order."""
        flat = tensor.contiguous().view(-1)
        out = torch.empty((self.size, flat.numel()), dtype=flat.dtype)
        per = SLOT_BYTES // flat.element_size()
        for start in range(0, flat.numel(), per):
            part = flat[start : start + per]
            out[:, start : start + per].copy_(self._publish(part)[:, : part.numel() * part.element_size()]
                                              .view(part.dtype))
        return torch.cat(out.view(self.size, *tensor.shape).unbind(0), dim=dim)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank: its pickle, after an 8-byte length, a slot at a time.
        The other ranks wait for it without a deadline (the engine may be idle)."""
        if self.size == 1:
            return obj
        payload = None
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            payload = torch.frombuffer(bytearray(len(data).to_bytes(8, "little") + data), dtype=torch.uint8)
        total, received, offset = None, [], 0
        while total is None or offset < total:
            slots = self._publish(None if payload is None else payload[offset : offset + SLOT_BYTES],
                                  idle=offset == 0)
            if total is None:
                total = 8 + int.from_bytes(slots[0, :8].numpy().tobytes(), "little")
            if self.rank != 0:
                received.append(slots[0, : min(SLOT_BYTES, total - offset)].numpy().tobytes())
            offset += SLOT_BYTES
        return obj if self.rank == 0 else pickle.loads(b"".join(received)[8:])

    def _publish(self, part: torch.Tensor | None, idle: bool = False) -> torch.Tensor:
        """One round: ``part`` (bytes of any dtype, at most a slot) into this rank's slot,
        then, once every rank has published the round, every rank's slot as ``[size,
        SLOT_BYTES]`` bytes (read them before the next round)."""
        if self._mapping is None:
            raise RuntimeError("the shared-memory group is closed")
        self._round += 1
        slots = self._slots[self._round & 1]
        if part is not None and part.numel():
            raw = part.view(torch.uint8)
            slots[self.rank, : raw.numel()].copy_(raw)
        self._counters[self.rank] = self._round
        self._wait(self._round, idle and self.rank != 0)
        return slots

    def _wait(self, target: int, idle: bool) -> None:
        """Until every rank has published round ``target``: spinning at first, then polling
        (every ``IDLE_POLL_S`` after a second); ``idle`` waits have no deadline."""
        counters = self._counters
        if counters.min() >= target:
            return
        start = last_check = time.monotonic()
        while counters.min() < target:
            now = time.monotonic()
            if now - start < SPIN_S:
                os.sched_yield()
                continue
            time.sleep(POLL_S if now - start < 1.0 else IDLE_POLL_S)
            if now - last_check > CHECK_EVERY_S:
                last_check = now
                behind = [r for r in range(self.size) if counters[r] < target]
                if not self._peers_alive():
                    raise RuntimeError(f"rank {self.rank}: the process of a rank in {behind} is gone")
                if not idle and now - start > self.timeout_s:
                    raise TimeoutError(f"rank {self.rank}: ranks {behind} did not reach round {target} "
                                       f"within {self.timeout_s:.0f} s")

    def close(self) -> None:
        """Unmap the shared memory; every later collective raises."""
        self._mapping = None
        self._slots = self._counters = None  # type: ignore[assignment]
