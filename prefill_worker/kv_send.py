"""The parts of a prefill's KV send that hold no worker state.

``PrefillWorker`` (``prefill_worker.worker``, whose module docstring has a request's
lifecycle) sends each attempt's KV to its decode worker; what it needs besides its own
records is here: the queue a pipelined prefill's finished blocks take from the step
thread to the sender (``Parts``), the stretch of the reservation one send covers
(``stretch``), waiting out the receiver's answer within the lease (``answer_within``)
while the bytes are pushed (``push_until_answered``, for a backend that sends), the two
ways a send is cut short (``Aborted``, ``NotAsked``) and the reasons its ``stop`` future
is woken with (``ABORTED``, ``RETIRED``), and the result of a prefill that offered no KV
(``failed_result``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any

from engine.wire.messages import PrefillResult, TransferState
from kv_transfer import TransferMeta

if TYPE_CHECKING:
    from engine.output_processor import RequestOutput
    from kv_transfer.base import KVTransferBackend

__all__ = [
    "ABORTED", "RETIRED", "Aborted", "NotAsked", "Part", "Parts", "aborted", "answer_within", "failed_result",
    "kv_blocks", "push_until_answered", "stretch", "wake",
]


def failed_result(request_id: str, error: str) -> PrefillResult:
    """The result of a prefill refused or ended before its KV was offered."""
    return PrefillResult(
        request_id=request_id, first_token=-1, num_cached_tokens=0, state=int(TransferState.FAILED),
        queue_s=0.0, prefill_s=0.0, transfer_s=0.0, kv_bytes=0, error=error,
    )


class Aborted(Exception):
    """The attempt was aborted here while its send waited."""


class NotAsked(Exception):
    """No read may be asked: the worker is retiring (``Sender.ask_read``)."""


# Why a hand-off's send was woken early (its ``stop`` future's result).
ABORTED = "aborted"  # by the router: the reader is dead, or the client gone
RETIRED = "the prefill worker left its role"


def wake(stop: asyncio.Future[str] | None, why: str) -> None:
    """Wake a send waiting on ``stop`` with the reason ``why`` (once: a later wake keeps the first)."""
    if stop is not None and not stop.done():
        stop.set_result(why)


def aborted(stop: asyncio.Future[str]) -> bool:
    """The router aborted the attempt (not the worker's retiring)."""
    return stop.done() and stop.result() == ABORTED


def kv_blocks(out: RequestOutput) -> list[int]:
    """The blocks a prefill's output holds for its hand-off (``hold_kv``: its outputs name them)."""
    assert out.kv_blocks is not None, "a prefill's output names the blocks it holds"
    return out.kv_blocks


def stretch(meta: TransferMeta, first: int, num_blocks: int) -> TransferMeta:
    """The transfer of the reservation's blocks ``first`` to ``first + num_blocks``."""
    return dataclasses.replace(meta, num_blocks=num_blocks, dst_blocks=meta.dst_blocks[first : first + num_blocks])


Part = tuple[int, list[int], list[Any]]  # (first block, block ids, their pins)


class Parts:
    """A pipelined prefill's finished blocks on their way to its sender: parts in order,
    then None. The step thread puts them (``put_threadsafe``), the sender takes them on
    the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, first: int = 0) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Part | None] = asyncio.Queue()
        self.first = first  # the blocks before it are on the decode side already (the offer counts on)
        self.abandoned = False  # the prefill failed: unpin what comes, send nothing

    def put_threadsafe(self, part: Part) -> None:
        """From the step thread: queue one part for the sender, on its event loop."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, part)


async def answer_within(answer: asyncio.Future[int], stop: asyncio.Future[str], lease_s: float) -> TransferState:
    """The receiver's answer, waited for up to the lease; ``Aborted`` as soon as the
    attempt is aborted here (a dead receiver's call may never answer)."""
    either: list[asyncio.Future[Any]] = [answer, stop]
    await asyncio.wait(either, timeout=lease_s, return_when=asyncio.FIRST_COMPLETED)
    if not answer.done():
        answer.cancel()
        raise Aborted() if stop.done() else asyncio.TimeoutError()
    return TransferState(answer.result())


async def push_until_answered(
    backend: KVTransferBackend, meta: TransferMeta, payload: Any, ack: asyncio.Future[int], stop: asyncio.Future[str],
) -> None:
    """Push the bytes; stop early if the receiver answers that it will not take them,
    or the attempt is aborted. Nothing to do where the receiver reads them (no
    transfer thread is taken)."""
    if not backend.sends:
        return
    # A paged backend's push sends the payload's blocks: no packed K and V.
    push = asyncio.ensure_future(backend.push_async(meta, None, None, payload))  # type: ignore[arg-type]
    first: list[asyncio.Future[Any]] = [ack, push, stop]
    await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
    refused = ack.done() and (ack.exception() is not None or ack.result() != TransferState.DONE)
    if not push.done() and (refused or stop.done()):
        # Refused, gave up or aborted: without this the push waits for a receive that
        # never comes. (An abort has freed the blocks already; the payload is released
        # only once the push has ended.)
        backend.abandon(meta, payload)
    try:
        await push
    except Exception:
        if not ack.done() and not stop.done():
            raise
        # The receiver's answer (or the abort) says what happened; the push's own error adds nothing.
    if stop.done():
        ack.cancel()  # nobody waits for a dead receiver's answer now
        raise Aborted()
