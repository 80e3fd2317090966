"""NIXL itself, for the ``nixl`` backend: the agent, the memory registered with it, and
the descriptors of what a receiver reads.

What is here keeps no table of transfers or peers: ``kv_transfer.nixl`` (``NixlBackend``)
owns those, the deadlines and the lock, and calls these pieces; ``kv_transfer.nixl_heads``
reads a share of a block's heads (tensor parallelism) with them.

- Loading: ``load_nixl`` (ImportError naming the packages), ``unavailable_reason``
  (skips and checks), ``is_nixl_error`` (the bindings' errors share no base class).
- The agent: ``make_agent`` (UCX, a progress thread that sleeps between events),
  ``forget_remote`` (drop a sender's connection and the regions loaded from it).
- One READ: ``wait_for_read`` polls it to its deadline, ``release_read`` releases
  its handle (which cancels it) and says when it could not be cancelled.
- Registered memory: ``RegisteredCache`` (a worker's paged K and V, registered once)
  and ``RegisteredStaging`` (receive buffers for packed and staged reads, reused).
- What a sender offers and how it is checked and read: ``NixlPayload`` (packed: two
  regions; ``checked_descs``, ``packed_views``), ``PagedPayload`` (block ids of a
  registered cache; ``check_blocks``, ``block_descs``: one descriptor a stretch of
  blocks, per layer, K and V).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kv_transfer.base import TransferError, TransferMeta

INSTALL_HINT = (
    "kv transfer backend 'nixl' needs the nixl packages: "
    "pip install 'nixl-cu12==1.5.1' && pip install --no-deps 'nixl==1.5.1' (scripts/install does this)"
)
POLL_MAX_S = 0.001  # longest sleep between state checks: 16 MiB reads take ~3-5 ms
PROGRESS_POLL_US = 1000  # the agent's progress thread wakes on events or after this
_AGENT_CREATION = threading.Lock()  # guards the brief swap of nixl's config class


def load_nixl():
    """The ``nixl._api`` module, or ImportError naming the packages to install."""
    try:
        from nixl import _api
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return _api


def unavailable_reason() -> str | None:
    """Why this process cannot use NIXL, or None when it can (for skips and checks)."""
    try:
        load_nixl()
    except Exception as e:  # a broken native library raises more than ImportError
        return str(e)
    return None


def is_nixl_error(e: BaseException) -> bool:
    """Whether ``e`` was raised by the nixl bindings (a failed read or connection)."""
    # The bindings' errors (nixlBackendError, nixlRemoteDisconnectError, ...) share no base class.
    return type(e).__module__.endswith("_bindings") and type(e).__name__.startswith("nixl")


@dataclass(frozen=True)
class NixlPayload:
    """What the receiver needs to read one transfer; small and picklable."""

    agent: str  # the sender's agent name
    metadata: bytes  # its connection info and the two regions of this transfer
    descs: bytes  # serialized descriptors of K and V, in that order
    nbytes: tuple[int, int]  # bytes of K and of V


@dataclass(frozen=True)
class PagedPayload:
    """What the receiver needs to read one prompt's blocks out of the sender's cache."""

    agent: str  # the sender's agent name
    metadata: bytes  # its connection info and its registered cache (the same every time)
    base: tuple[int, int]  # addresses of the sender's paged K and V
    num_blocks: int  # blocks per layer in the sender's cache: the layer stride
    device: int  # the cache's device index (0 for host memory)
    block_ids: tuple[int, ...]  # the prompt's blocks, in prompt order
    heads: int = 0  # KV heads a token holds in the sender's cache (a rank's share at tensor_parallel_size > 1)


@dataclass(frozen=True)
class RegisteredCache:
    """A worker's paged K and V, registered once."""

    k: torch.Tensor
    v: torch.Tensor
    registration: object = field(repr=False)
    metadata: bytes = field(repr=False)

    @property
    def mem_type(self) -> str:
        """NIXL's memory type of the cache: VRAM on a GPU, else DRAM."""
        return "VRAM" if self.k.is_cuda else "DRAM"

    @property
    def device(self) -> int:
        """The cache's device index (0 for host memory)."""
        return (self.k.device.index or 0) if self.k.is_cuda else 0

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer of K (or V)."""
        return self.k[0, 0].numel() * self.k.element_size()


def block_descs(base: tuple[int, int], num_blocks: int, layers: int, block_bytes: int, device: int,
                runs: np.ndarray) -> np.ndarray:
    """Nx3 (address, length, device) rows for ``runs`` of blocks in every layer of K then V.

    ``runs``: (first block, number of blocks) rows. The cache is ``[layers, num_blocks,
    ...]``, so block ``b`` of layer ``l`` starts at ``base + (l * num_blocks + b) * block_bytes``.
    """
    layer_starts = np.arange(layers, dtype=np.int64)[:, None] * num_blocks  # [L, 1]
    starts = (layer_starts + runs[None, :, 0]) * block_bytes  # [L, R] offsets
    lengths = np.broadcast_to(runs[None, :, 1] * block_bytes, starts.shape)
    rows = []
    for addr in base:
        rows.append(np.stack([addr + starts, lengths, np.full_like(starts, device)], axis=-1).reshape(-1, 3))
    return np.concatenate(rows)


def check_blocks(meta: TransferMeta, payload, block_ids: list[int], cache: RegisteredCache) -> None:
    """The offer fits this transfer and this cache; nothing is read before."""
    if not isinstance(payload, PagedPayload):
        kind = type(payload).__name__
        raise TransferError("layout", f"transfer {meta.transfer_id}: not a paged nixl payload ({kind})")
    counts = {len(payload.block_ids), len(block_ids)}
    if counts != {meta.num_blocks}:
        raise TransferError(
            "layout",
            f"transfer {meta.transfer_id}: {len(payload.block_ids)} blocks offered and "
            f"{len(block_ids)} reserved for a transfer of {meta.num_blocks}",
        )
    if meta.num_blocks and not 0 <= min(payload.block_ids) <= max(payload.block_ids) < payload.num_blocks:
        raise TransferError("layout", f"transfer {meta.transfer_id}: block ids outside the sender's cache")
    if meta.num_blocks and not 0 <= min(block_ids) <= max(block_ids) < cache.k.shape[1]:
        raise TransferError("layout", f"transfer {meta.transfer_id}: block ids outside this cache")


def checked_descs(agent, meta: TransferMeta, payload) -> object:
    """The sender's descriptors, once they match the layout; nothing is read before."""
    if not isinstance(payload, NixlPayload):
        kind = type(payload).__name__
        raise TransferError("layout", f"transfer {meta.transfer_id}: not a nixl payload ({kind})")
    expected = meta.layout.nbytes(meta.num_blocks)
    if list(payload.nbytes) != [expected // 2] * 2:
        raise TransferError(
            "layout",
            f"transfer {meta.transfer_id}: sender offers K+V of {payload.nbytes} bytes, "
            f"{meta.num_blocks} blocks of {meta.layout} need {expected // 2} each",
        )
    descs = agent.deserialize_descs(payload.descs)
    # Indexing past descCount() returns garbage instead of raising: count first.
    lengths = [descs[i][1] for i in range(descs.descCount())] if descs.descCount() == 2 else []
    if lengths != list(payload.nbytes):
        raise TransferError(
            "layout", f"transfer {meta.transfer_id}: descriptors {lengths} disagree with sizes {payload.nbytes}"
        )
    return descs


def packed_views(meta: TransferMeta, staging: torch.Tensor, nbytes: tuple[int, int]):
    """K and V of a packed transfer read into ``staging``, as the layout's dtype and shape."""
    dtype = getattr(torch, meta.layout.dtype)
    shape = meta.layout.packed_shape(meta.num_blocks)
    kn = nbytes[0]
    return staging[:kn].view(dtype).view(shape), staging[kn : 2 * kn].view(dtype).view(shape)


def wait_for_read(agent, meta: TransferMeta, handle, read_timeout_s: float) -> None:
    """Poll the READ ``handle`` until it is DONE; TransferError when it ends otherwise or
    passes the transfer's deadline (or ``read_timeout_s``, whichever comes first)."""
    limit = time.time() + read_timeout_s
    deadline = min(meta.deadline, limit) if meta.deadline else limit
    state, delay = agent.transfer(handle), 1e-4
    while state == "PROC":
        if time.time() > deadline:
            raise TransferError("timeout", f"transfer {meta.transfer_id} passed its deadline mid-read")
        time.sleep(delay)
        delay = min(2 * delay, POLL_MAX_S)
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise TransferError("read_failed", f"transfer {meta.transfer_id}: read ended in state {state}")
    if meta.deadline and time.time() > meta.deadline:
        # Whoever awaited this has given up and will not recycle the staging buffer.
        raise TransferError("timeout", f"transfer {meta.transfer_id} finished after its deadline")


def release_read(handle, done: bool, unfinished) -> None:
    """Release a READ's handle, which cancels it if still running; ``unfinished()`` when a
    read that had not ended could not be released (it may still write its destination)."""
    try:
        handle.release()  # cancels a read still running
    except Exception:
        if not done:
            unfinished()  # the read may still write into its destination


def make_agent(name: str):
    """A UCX agent whose progress thread sleeps between events.

    nixl's Python wrapper hard-codes the progress thread's poll timeout to 0, so the
    thread spins: a full core per process when idle (measured 2.6 CPU-seconds in 3 s).
    The sender needs that thread (a READ completes only when the sender's side takes
    the notification), so it stays, with a 1 ms timeout: idle cost ~1% of a core, a
    small READ with notification 0.08 ms median (0.12 ms spinning). The wrapper gives
    no setting for it, so the config class it instantiates is swapped for the call.
    """
    api = load_nixl()
    bind, base = api.nixlBind, api.nixlBind.nixlAgentConfig

    class Config(base):
        @property
        def pthrDelay(self):
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value):
            base.pthrDelay.__set__(self, max(value, PROGRESS_POLL_US))

    config = api.nixl_agent_config(backends=["UCX"], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
    with _AGENT_CREATION:
        bind.nixlAgentConfig = Config
        try:
            return api.nixl_agent(name, config)
        finally:
            bind.nixlAgentConfig = base


def forget_remote(agent, name: str) -> None:
    """Drop the agent ``name``'s connection and every region loaded from it."""
    try:
        agent.remove_remote_agent(name)
    except Exception as e:
        if not is_nixl_error(e):
            raise  # not found is fine: a failed first load leaves nothing behind


@dataclass
class _Buffer:
    tensor: torch.Tensor
    registration: object = field(repr=False)


class RegisteredStaging:
    """Receive buffers registered with the agent once and reused, smallest fit first.

    Registering is cheap, but a fresh buffer costs a page fault per 4 KiB on its first
    read, which measured slower than the read itself. Keeps at most ``max_free`` idle.
    """

    def __init__(self, agent_fn, max_free: int) -> None:
        self._agent_fn = agent_fn
        self.max_free = max_free
        self._lock = threading.Lock()
        self._free: list[_Buffer] = []
        self._lent: dict[int, _Buffer] = {}  # storage address -> buffer
        self._quarantined: list[_Buffer] = []

    def take(self, nbytes: int) -> torch.Tensor:
        """A registered buffer of at least ``nbytes``, lent until ``give`` or ``quarantine``."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.tensor.numel() >= nbytes]
            # Among equal fits the latest returned: its pages are likeliest still in cache.
            best = min(fits, key=lambda i: (self._free[i].tensor.numel(), -i), default=None)
            buf = self._free.pop(best) if best is not None else None
        if buf is None:
            tensor = torch.zeros(max(nbytes, 1), dtype=torch.uint8)  # zeros: touch the pages now
            buf = _Buffer(tensor, self._agent_fn().register_memory(tensor))
        with self._lock:
            self._lent[buf.tensor.data_ptr()] = buf
        return buf.tensor[:nbytes]

    def give(self, view: torch.Tensor) -> None:
        """Return the buffer ``view`` lies in; views of unknown memory are ignored."""
        with self._lock:
            buf = self._lent.pop(view.untyped_storage().data_ptr(), None)
            if buf is None:
                return
            self._free.append(buf)
            evicted = None
            if len(self._free) > self.max_free:
                smallest = min(range(len(self._free)), key=lambda i: self._free[i].tensor.numel())
                evicted = self._free.pop(smallest)
        if evicted is not None:
            self._agent_fn().deregister_memory(evicted.registration)

    def drop_all(self, agent) -> None:
        """Deregister the idle buffers and forget every buffer: lent ones, registered with
        this agent, must not come back into a pool that a new agent will use."""
        with self._lock:
            free, self._free, self._lent = self._free, [], {}
        for buf in free:
            agent.deregister_memory(buf.registration)

    @property
    def num_lent(self) -> int:
        """Buffers lent out and not yet given back."""
        return len(self._lent)

    def quarantine(self, view: torch.Tensor) -> None:
        """Keep the buffer ``view`` lies in out of use for good: a read into it could not
        be cancelled."""
        with self._lock:
            buf = self._lent.pop(view.untyped_storage().data_ptr(), None)
            if buf is not None:
                self._quarantined.append(buf)
