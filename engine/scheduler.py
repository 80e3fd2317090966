"""The token-budget scheduler: which requests compute which tokens in the next step.

Pure Python (no torch): it sees requests as counters and blocks as integers, returns
a plain-data ``SchedulerOutput`` and takes plain-data results back in ``update``.

One step's budget (``max_num_batched_tokens``) is spent in this order:

1. running requests, each asking for ``num_tokens - num_computed_tokens`` tokens
   (1 while decoding, a chunk while prefilling);
2. swapped requests, brought back when nothing was preempted in this step;
3. waiting requests, after a prefix-cache lookup.

With ``batching="static"`` (a baseline for benchmarks) waiting requests are let in
only when nothing runs: then as many as fit (``max_num_seqs``, KV blocks for their
prompts) form a batch, whose prompts are computed over as many steps as the budget
needs, and the batch runs to its end before the next one forms.

When blocks run out the victim is the lowest-priority, latest-arrived running
request. It is preempted by recompute (blocks freed, request to the front of the
queue) or by swap (blocks copied to the CPU pool), as ``preemption_mode`` says.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.block_pool import KVCacheManager
from engine.request import Request, RequestStatus

PREEMPTION_MODES = ("recompute", "swap", "auto")
POLICIES = ("fcfs", "priority")
BATCHING_MODES = ("continuous", "static")


def check_modes(preemption_mode: str, policy: str, batching: str) -> None:
    """A ValueError naming the first of the scheduler's modes that is not one it has."""
    for name, value, allowed in (("preemption_mode", preemption_mode, PREEMPTION_MODES),
                                 ("policy", policy, POLICIES), ("batching", batching, BATCHING_MODES)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
# "auto" swaps a request once its output is this large a share of its prompt:
# recomputing it would then cost more than copying its blocks back.
AUTO_SWAP_OUTPUT_RATIO = 0.2


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "auto"
    policy: str = "fcfs"
    batching: str = "continuous"

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_modes(self.preemption_mode, self.policy, self.batching)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute ``token_ids`` at positions from ``start_pos``."""

    request: Request  # read-only for the runner: sampling params, token history
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool  # the step reaches the end of the known tokens: sample the next one


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    preempted: list[str] = field(default_factory=list)
    # Finished while planning (grew past what the whole pool holds): not in ``scheduled``.
    finished: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.swap_out and not self.swap_in


@dataclass
class SchedulerStats:
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    num_steps: int = 0

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_recompute + self.num_preemptions_swap


class Scheduler:
    """Continuous batching over a paged KV cache, one token budget per step."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_manager = kv_manager
        self.stats = SchedulerStats()
        self._by_priority = config.policy == "priority"
        self._seq = itertools.count()
        self._waiting_fifo: deque[Request] = deque()
        self._waiting_heap: list[tuple[tuple, Request]] = []
        self.running: list[Request] = []  # sorted by key: the tail is the next victim
        self._running_keys: list[tuple] = []
        self.swapped: list[Request] = []
        self.remote: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV, blocks reserved
        self.held: dict[str, Request] = {}  # finished with hold_kv, blocks not yet freed
        self.requests: dict[str, Request] = {}

    # -- queues ----------------------------------------------------------------

    def _key(self, request: Request) -> tuple:
        if self._by_priority:
            return (request.priority, request.seq_no)
        return (request.seq_no,)

    def _push_waiting(self, request: Request, front: bool = False) -> None:
        if self._by_priority:
            heapq.heappush(self._waiting_heap, (self._key(request), request))
        elif front:
            self._waiting_fifo.appendleft(request)
        else:
            self._waiting_fifo.append(request)

    def _peek_waiting(self) -> Request | None:
        if self._by_priority:
            return self._waiting_heap[0][1] if self._waiting_heap else None
        return self._waiting_fifo[0] if self._waiting_fifo else None

    def _pop_waiting(self) -> None:
        if self._by_priority:
            heapq.heappop(self._waiting_heap)
        else:
            self._waiting_fifo.popleft()

    def _remove_waiting(self, request: Request) -> None:
        if self._by_priority:
            self._waiting_heap = [e for e in self._waiting_heap if e[1] is not request]
            heapq.heapify(self._waiting_heap)
        else:
            self._waiting_fifo.remove(request)

    def _add_running(self, request: Request) -> None:
        key = self._key(request)
        i = bisect.bisect(self._running_keys, key)
        self._running_keys.insert(i, key)
        self.running.insert(i, request)

    def _remove_running(self, request: Request) -> None:
        i = bisect.bisect_left(self._running_keys, self._key(request))
        assert self.running[i] is request
        del self.running[i]
        del self._running_keys[i]

    @property
    def num_waiting(self) -> int:
        return len(self._waiting_heap) + len(self._waiting_fifo)

    def num_queued_tokens(self) -> int:
        """Tokens of the scheduler's requests that are yet to be computed."""
        return sum(r.num_tokens - r.num_computed_tokens for r in self.requests.values())

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_work(self) -> bool:
        return bool(self.requests)

    def has_schedulable_work(self) -> bool:
        """Work a step can do now (requests waiting for remote KV cannot be stepped)."""
        return len(self.requests) > len(self.remote)

    # -- intake ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.seq_no = next(self._seq)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._push_waiting(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, stop string hit, ...) requests wherever they are; frees their blocks."""
        done = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self._remove_running(request)
            elif request.status == RequestStatus.SWAPPED:
                self.swapped.remove(request)
            elif request.status == RequestStatus.WAITING:
                self._remove_waiting(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                del self.remote[rid]
            self._finish(request, status)
            done.append(request)
        return done

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        del self.requests[request.request_id]
        if request.hold_kv and status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
            self.held[request.request_id] = request
        else:
            self.kv_manager.free(request)

    def release_held(self, request_id: str) -> None:
        """Free the blocks of a finished ``hold_kv`` request once its KV was copied out."""
        request = self.held.pop(request_id, None)
        if request is not None:
            self.kv_manager.free(request)

    # -- remote KV (decode role) -----------------------------------------------

    def add_remote(self, request: Request) -> list[int] | None:
        """Reserve blocks for a prompt whose KV another worker computes; None if no room.

        The request waits in WAITING_FOR_REMOTE_KV, outside the token budget, until
        ``remote_arrived`` or ``remote_failed``.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if self.kv_manager.allocate_slots(request, request.num_prompt_tokens) is None:
            self.kv_manager.free(request)
            return None
        request.seq_no = next(self._seq)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        self.remote[request.request_id] = request
        return self.kv_manager.block_ids(request.request_id)

    def remote_arrived(self, request_id: str, first_token: int) -> Request | None:
        """The prompt's KV is in the reserved blocks: the request joins the batch."""
        request = self.remote.pop(request_id, None)
        if request is None:
            return None
        request.num_computed_tokens = request.num_prompt_tokens
        request.output_token_ids.append(first_token)
        status = self._check_stop(request, first_token)
        if status is not None:
            self._finish(request, status)
        else:
            request.status = RequestStatus.RUNNING
            self._add_running(request)
            self.kv_manager.cache_blocks(request)
        return request

    def remote_failed(self, request_id: str, recompute: bool) -> Request | None:
        """The KV will not come: prefill locally (``recompute``) or fail the request."""
        request = self.remote.pop(request_id, None)
        if request is None:
            return None
        if recompute:
            self.kv_manager.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self._push_waiting(request, front=True)
        else:
            self._finish(request, RequestStatus.FINISHED_ERROR)
        return request

    # -- scheduling ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step under the token budget."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.config.batching == "static":
            if not self.running and not self.swapped:
                self._form_static_batch(out, budget)
            else:
                budget = self._schedule_running(out, budget)
                if not out.preempted:
                    self._schedule_swapped(out, budget)
        else:
            budget = self._schedule_running(out, budget)
            if not out.preempted:
                budget = self._schedule_swapped(out, budget)
                self._schedule_waiting(out, budget)
        out.num_batched_tokens = sum(len(s.token_ids) for s in out.scheduled)
        self.stats.num_steps += 1
        return out

    def _plan(self, out: SchedulerOutput, request: Request, start: int, n: int) -> None:
        end = start + n
        out.scheduled.append(
            ScheduledRequest(
                request=request,
                token_ids=request.token_slice(start, end),
                start_pos=start,
                block_ids=self.kv_manager.block_ids(request.request_id),
                sample=end == request.num_tokens,
            )
        )

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = request.num_tokens - request.num_computed_tokens
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    i += 1  # a static batch's whole prompt, in a later step
                    continue
                n = budget
            while self.kv_manager.allocate_slots(request, n) is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                self._plan(out, request, request.num_computed_tokens, n)
                budget -= n
                i += 1
        return budget

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self._remove_running(request)
        request.num_preemptions += 1
        out.preempted.append(request.request_id)
        if not self.kv_manager.fits_in_pool(request.num_tokens + 1):
            # It can never fit again: end it as if it hit its length limit.
            self._finish(request, RequestStatus.FINISHED_LENGTH)
            out.finished.append(request)
            return
        mode = self.config.preemption_mode
        if mode == "auto":
            grown = request.num_output_tokens >= AUTO_SWAP_OUTPUT_RATIO * request.num_prompt_tokens
            mode = "swap" if grown else "recompute"
        if mode == "swap":
            mapping = self.kv_manager.swap_out(request)
            if mapping is not None:
                out.swap_out.extend(mapping)
                request.status = RequestStatus.SWAPPED
                self.swapped.append(request)
                self.stats.num_preemptions_swap += 1
                return
        self.kv_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self._push_waiting(request, front=True)
        self.stats.num_preemptions_recompute += 1

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        self.swapped.sort(key=self._key)
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            total = self.kv_manager.num_blocks_needed(request.num_computed_tokens + n)
            if not self.kv_manager.can_allocate(max(total, self.kv_manager.num_swapped_blocks(request.request_id))):
                break
            out.swap_in.extend(self.kv_manager.swap_in(request))
            self.kv_manager.allocate_slots(request, n)
            self.swapped.pop(0)
            request.status = RequestStatus.RUNNING
            self._add_running(request)
            self._plan(out, request, request.num_computed_tokens, n)
            budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        chunked = self.config.enable_chunked_prefill
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self._peek_waiting()
            if request is None:
                break
            hit, num_hit = self.kv_manager.get_computed_blocks(request)
            n = request.num_tokens - num_hit
            if n > budget and not chunked:
                break
            n = min(n, budget)
            if self.kv_manager.allocate_slots(request, n, hit) is None:
                break
            self._pop_waiting()
            self._start(request, num_hit)
            self._plan(out, request, num_hit, n)
            budget -= n

    def _form_static_batch(self, out: SchedulerOutput, budget: int) -> None:
        """Let in every waiting request that fits; compute what the budget allows now."""
        chunked = self.config.enable_chunked_prefill
        while len(self.running) < self.config.max_num_seqs:
            request = self._peek_waiting()
            if request is None:
                break
            hit, num_hit = self.kv_manager.get_computed_blocks(request)
            n = request.num_tokens - num_hit
            if self.kv_manager.allocate_slots(request, n, hit) is None:
                break
            self._pop_waiting()
            self._start(request, num_hit)
            planned = n if n <= budget else (budget if chunked else 0)
            if planned:
                self._plan(out, request, num_hit, planned)
                budget -= planned

    def _start(self, request: Request, num_hit: int) -> None:
        """A waiting request joins the running batch with ``num_hit`` tokens from the cache."""
        if self.kv_manager.enable_caching:
            self.kv_manager.stats.queries += request.num_tokens
            self.kv_manager.stats.hits += num_hit
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_hit
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        self._add_running(request)

    # -- results ---------------------------------------------------------------

    def update(
        self, out: SchedulerOutput, sampled: dict[str, int]
    ) -> list[tuple[Request, int | None]]:
        """Apply one step's results; returns (request, new token or None) for each planned one.

        Requests that hit a stop condition are finished and their blocks freed.
        """
        results = []
        for item in out.scheduled:
            request = item.request
            if request.is_finished or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += len(item.token_ids)
            # Cache before any stop check, so a request that ends now (a prefill-role
            # request always does) still leaves its full blocks in the prefix cache.
            self.kv_manager.cache_blocks(request)
            token = sampled.get(request.request_id) if item.sample else None
            if token is not None:
                request.output_token_ids.append(token)
                status = self._check_stop(request, token)
                if status is not None:
                    self._remove_running(request)
                    self._finish(request, status)
                    results.append((request, token))
                    continue
            results.append((request, token))
        return results

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        n_out = request.num_output_tokens
        if n_out >= params.min_tokens:
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if n_out >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
