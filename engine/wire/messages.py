"""The messages that cross process boundaries between the router and the workers.

Plain data, no torch: the router process unpickles every one of these (load reports,
reservations, prefill results, token deltas), and a process that only routes should
not load a tensor library to do so. Workers build them; the router reads them.

Token deltas travel as plain tuples in ``StreamDelta``'s field order, one list of them
per engine step and subscriber (``StepDeltas``): a tuple pickles several times faster
than any class instance, and this is the path every streamed token takes. Each such
message also carries the decode worker's load after the step (``StepMessage``). Over a
decode worker's token channel they go as MessagePack decoded against ``StreamDelta`` and
``DecodeLoad`` (``engine/wire/channel_wire.py``), so their annotations are that wire's schema.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1}


class ErrorKind(str, enum.Enum):
    """Why a request failed, so that each edge can answer with the right status."""

    NO_CAPACITY = "no_capacity"  # no decode worker had room in time (retryable: 503)
    WORKER_FAILED = "worker_failed"  # a worker died or broke mid request (500)
    TRANSFER_FAILED = "transfer_failed"  # the KV did not come and the policy is "fail" (500)
    INVALID = "invalid"  # the request itself was wrong (400)


class StreamDelta(NamedTuple):
    """Everything one request produced since its previous delta."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None  # (token, logprob, top) per new token
    error: str | None = None
    error_kind: ErrorKind | None = None
    # On the first delta of a request that asked: one entry per prompt token, None first,
    # then (token, logprob, rank, [(id, logprob), ...]).
    prompt_logprobs: list[tuple[int, float, int | None, list[tuple[int, float]]] | None] | None = None

    @classmethod
    def failure(cls, request_id: str, kind: ErrorKind, message: str) -> StreamDelta:
        return cls(request_id, [], "", True, "error", error=message, error_kind=kind)


# One engine step's deltas for one subscriber: plain tuples, ``StreamDelta._make`` each.
StepDeltas = list[tuple]


def attempt_id(request_id: str, router: str, attempt: int) -> str:
    """The id one attempt of a request goes by on the workers.

    Every placement of a request (the first, a re-run after a decode worker died, a
    migration) is a new attempt with its own id, unique across router replicas and
    attempts: an attempt still held somewhere (a prefill worker finishing a transfer for
    a dead reader, say) never shares worker-side state with the next one, and a router
    aborting its own attempt never touches another replica's request of the same
    client id. ``request_of`` recovers the client's id.
    """
    return f"{request_id}@{router}.{attempt}"


def request_of(attempt: str) -> str:
    """The client's request id of a worker-side ``attempt_id`` (itself if it is none)."""
    return attempt.rpartition("@")[0] or attempt


class TransferState(enum.IntEnum):
    """How a KV hand-off ended: the decode worker has the prompt's KV (DONE), or it does not and
    recomputes or fails the request by ``transfer.failure_policy`` (FAILED). It crosses processes
    as an int (``PrefillResult.state``)."""

    FAILED = 0
    DONE = 1


@dataclass(frozen=True)
class KVLayout:
    """Shape of one side's paged KV; both sides of a transfer must agree on it.

    ``layer_windows``: per layer, how many latest keys it attends to (0: all of them; empty:
    no layer slides). When every layer slides, the blocks wholly behind the widest window
    at a prompt's end are read by no later step: the decode worker keeps no block for them
    and nothing sends them (``Reservation.unsent_blocks`` counts them)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    layer_windows: tuple[int, ...] = ()

    def packed_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def nbytes(self, num_blocks: int) -> int:
        """Bytes of K and V together for ``num_blocks`` blocks."""
        n = DTYPE_SIZES[self.dtype]
        for d in self.packed_shape(num_blocks):
            n *= d
        return 2 * n


@dataclass(frozen=True)
class DecodeLoad:
    """A decode worker's load report for placement: free KV blocks and requests by state. It rides
    on every step message of the worker's token stream and answers ``load`` polls."""

    worker_id: str
    free_blocks: int
    total_blocks: int
    running: int
    waiting: int
    waiting_for_kv: int


# What a decode worker's ``subscribe`` stream sends per engine step: its load after the
# step (None from a worker that reports none), then the subscriber's deltas.
StepMessage = tuple[DecodeLoad | None, StepDeltas]


@dataclass(frozen=True)
class PrefillLoad:
    """A prefill worker's load report, which the router polls at placement: queued prompt tokens,
    requests running and waiting, prefix-cache counters and transfers in flight."""

    worker_id: str
    queued_prefill_tokens: int
    running_chunks: int
    waiting: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    sending: int = 0  # KV transfers in flight from this worker


@dataclass(frozen=True)
class Reservation:
    """Blocks a decode worker holds for a request's KV, and where to send it."""

    request_id: str
    block_ids: list[int]
    layout: KVLayout
    endpoint: str  # where the prefill worker opens its channel to this worker ("" if none)
    deadline: float
    # Leading blocks not sent: the decode worker's prefix cache holds them, or they are behind
    # every layer's window at the prompt's end (``KVLayout.layer_windows``: none kept for them).
    unsent_blocks: int = 0
    # The LoRA adapter the decode worker runs the request under, by its key (name and a digest
    # of its files; None: the base model): a prefill worker whose own differs refuses to send.
    adapter_key: str | None = None


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill worker's ``prefill`` returns once the hand-off has ended: the first token,
    how far the transfer got (``state``), where the time went, and the error, if any."""

    request_id: str
    first_token: int
    num_cached_tokens: int
    state: int  # TransferState
    queue_s: float
    prefill_s: float
    transfer_s: float
    kv_bytes: int
    error: str | None = None


class StalePlacement(RuntimeError):
    """A worker refused a placement made by an out-of-date view of it: it has switched
    roles (or is switching, or draining) since the caller's worker list was made, so the
    caller's epoch for it is not the worker's. Nothing was done; place the request again."""


@dataclass(frozen=True)
class WorkerRef:
    """One worker as the router sees it: its id, its Ray actor handle, the incarnation that tells a
    replacement apart, and whether it is draining. The cluster makes one per actor it starts and
    hands them out in its worker lists."""

    worker_id: str
    handle: object  # a Ray actor handle
    incarnation: str = ""  # unique per actor and role: a replacement reuses worker_id, not this
    draining: bool = False  # leaving its pool: nothing new is placed on it
    epoch: int | None = None  # a worker that can switch roles: which of its roles this ref is

    @property
    def key(self) -> str:
        return self.incarnation or self.worker_id

    def fence(self) -> dict:
        """The keyword a placement call carries so that the worker refuses it if it has
        switched roles since this ref was made (``StalePlacement``)."""
        return {} if self.epoch is None else {"epoch": self.epoch}
