"""The token-budget scheduler: which requests compute which tokens in the next step.

Pure Python (no torch): it sees requests as counters and blocks as integers, returns
a plain-data ``SchedulerOutput`` and takes plain-data results back in ``update``.

One step's budget (``max_num_batched_tokens``) is spent in this order:

1. running requests, each asking for ``num_tokens - num_computed_tokens`` tokens
   (1 while decoding, a chunk while prefilling);
2. swapped requests, brought back when nothing was preempted in this step;
3. waiting requests, after a prefix-cache lookup.

The scheduler is a few small parts: a waiting queue and sorted running and swapped
sets (``engine.core.request_queues``, in the order ``policy`` gives), the KV cache manager
(``engine.core.block_pool.KVCacheManager``, which also counts prefix-cache hits), and an admission
policy (``engine.core.batching``) that says when waiting requests may join the batch:

- ``ContinuousBatching``: whenever a step has budget left and the pool has blocks;
- ``StaticBatching`` (``batching="static"``, a baseline for benchmarks): only when
  nothing runs; then as many as fit (``max_num_seqs``, KV blocks for their whole
  prompts) form a batch, whose prompts are computed over as many steps as the budget
  needs, and the batch runs to its end before the next one forms.

Chunked prefill is one rule for every request, whatever the admission: a request
computes as many of its tokens as the step's budget allows, or (with
``enable_chunked_prefill`` off) all of them in one step or none in this one.

When blocks run out the victim is the lowest-priority, latest-arrived running
request. It is preempted by recompute (blocks freed, request back to the waiting
queue, first in line under ``fcfs``) or by swap (blocks copied to the CPU pool), as
``preemption_mode`` says.

With a host tier (``engine.core.host_tier``), the plan's ``swap_out`` pairs also spill
evicted prefix blocks to it and its ``swap_in`` pairs restore prefix hits from it. The
runner copies every ``swap_out`` pair, then every ``swap_in`` pair, then runs the
forward: a spill reads its device block before anything writes it, and a restored
block is in place before any request reads it.

Beside this module: its config and plan types (``engine.core.scheduler_plan``), its
admission policies (``engine.core.batching``) and the runs of pure decode steps the
simulator takes at once (``engine.core.decode_run``); their names are importable from here.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from engine.core.batching import ADMISSION_POLICIES, BATCHING_MODES, ContinuousBatching, StaticBatching
from engine.core.block_pool import KVBlock, KVCacheManager
from engine.core.decode_run import run_blocks, take_run
from engine.core.request import Request, RequestStatus
from engine.core.request_queues import SortedRequests, order_key, waiting_queue
from engine.core.scheduler_plan import PREEMPTION_MODES, ScheduledRequest, SchedulerConfig, SchedulerOutput, check_modes

# The plan types and admission policies live in their own modules; importers name them here.
__all__ = [
    "ADMISSION_POLICIES", "AUTO_SWAP_OUTPUT_RATIO", "BATCHING_MODES", "PREEMPTION_MODES", "ContinuousBatching",
    "ScheduledRequest", "Scheduler", "SchedulerConfig", "SchedulerOutput", "SchedulerStats", "StaticBatching",
    "check_modes",
]

# "auto" swaps a request once its output is this large a share of its prompt:
# recomputing it would then cost more than copying its blocks back.
AUTO_SWAP_OUTPUT_RATIO = 0.2


@dataclass
class SchedulerStats:
    """The scheduler's counters since it was built (steps, preemptions by mode); the engine
    reports them in ``stats()``."""

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
        self.admission = ADMISSION_POLICIES[config.batching]
        self.stats = SchedulerStats()
        self._seq = itertools.count()
        key = order_key(config.policy)
        self.waiting = waiting_queue(config.policy)
        self.running = SortedRequests(key)  # the last one is the next preemption victim
        self.swapped = SortedRequests(key)  # the first one is the next to come back
        self.remote: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV, blocks reserved
        self.held: dict[str, Request] = {}  # finished with hold_kv, blocks not yet freed
        self.requests: dict[str, Request] = {}

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

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
        if request.request_id in self.requests or request.request_id in self.held:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.seq_no = next(self._seq)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, stop string hit, ...) requests wherever they are; frees their blocks."""
        done = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.SWAPPED:
                self.swapped.remove(request)
            elif request.status == RequestStatus.WAITING:
                self.waiting.remove(request)
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

    def _send_back(self, request: Request) -> None:
        """Drop the request's blocks and queue it again to compute everything anew."""
        self.kv_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.push_back_in(request)

    # -- remote KV (decode role) -----------------------------------------------

    def add_remote(self, request: Request) -> tuple[list[int], int] | None:
        """Reserve blocks for a prompt whose KV another worker computes; None if no room.

        Returns the block ids (in token order) and how many leading ones need not be
        sent: this worker's prefix cache holds their KV, or they are behind every layer's
        window at the prompt's end (``NULL_BLOCK_ID`` there: no block is kept for them).
        The request waits in WAITING_FOR_REMOTE_KV, outside the token budget, until
        ``remote_arrived`` or ``remote_failed``.
        """
        if request.request_id in self.requests or request.request_id in self.held:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        # The device's cache only: a restore from the host tier would be a copy in a plan
        # made after the KV lands (``KVCacheManager.reserve_remote``).
        hit, num_hit = self.kv_manager.get_computed_blocks(request, device_only=True)
        # The prompt (+ a migrated stream's output); at least its last block is sent.
        not_sent = self.kv_manager.reserve_remote(request, [b for b in hit if isinstance(b, KVBlock)])
        if not_sent is None:
            return None
        self.kv_manager.count_prefix_lookup(request.num_tokens, num_hit)
        request.num_unsent_blocks = not_sent
        request.seq_no = next(self._seq)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        self.remote[request.request_id] = request
        return self.kv_manager.block_ids(request.request_id), not_sent

    def remote_arrived(self, request_id: str, first_token: int) -> Request | None:
        """The prompt's KV is in the reserved blocks: the request joins the batch."""
        request = self.remote.pop(request_id, None)
        if request is None:
            return None
        request.num_computed_tokens = request.num_tokens
        request.output_token_ids.append(first_token)
        status = self._check_stop(request, first_token)
        if status is not None:
            self._finish(request, status)
        else:
            request.status = RequestStatus.RUNNING
            self.running.add(request)
            self.kv_manager.cache_blocks(request)
        return request

    def remote_failed(self, request_id: str, recompute: bool) -> Request | None:
        """The KV will not come: prefill locally (``recompute``) or fail the request."""
        request = self.remote.pop(request_id, None)
        if request is None:
            return None
        if recompute:
            self._send_back(request)
        else:
            self._finish(request, RequestStatus.FINISHED_ERROR)
        return request

    # -- scheduling ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step under the token budget (the previous plan has run)."""
        out = SchedulerOutput()
        self.kv_manager.begin_step()
        admits = self.admission.admits(len(self.running), len(self.swapped))
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            budget = self._schedule_swapped(out, budget)
            if admits:
                budget = self._schedule_waiting(out, budget)
        spills, restores = self.kv_manager.take_copies()
        out.swap_out += spills
        out.swap_in += restores
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        self.stats.num_steps += 1
        return out

    def _tokens_now(self, num_tokens: int, budget: int) -> int:
        """How many of ``num_tokens`` to compute in this step: as many as the budget
        allows, or (chunked prefill off) all of them or none."""
        if num_tokens <= budget:
            return num_tokens
        return budget if self.config.enable_chunked_prefill else 0

    def _plan(self, out: SchedulerOutput, request: Request, start: int, n: int, num_tokens: int) -> None:
        """Compute tokens [start, start + n) of the request's ``num_tokens`` in this step."""
        end = start + n
        # Positional arguments, in field order: this runs for every request in every step.
        out.scheduled.append(ScheduledRequest(
            request, request.token_slice(start, end), start, self.kv_manager.block_ids(request.request_id),
            end == num_tokens,
        ))

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        running = self.running.in_order
        allocate_slots = self.kv_manager.allocate_slots
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_tokens, start = request.num_tokens, request.num_computed_tokens
            n = self._tokens_now(num_tokens - start, budget)
            if not n:
                i += 1  # its whole prompt, in a later step
                continue
            if allocate_slots(request, n) is None and not self._preempt_for(request, n, out):
                break  # it was the last one running, so it was the victim
            self._plan(out, request, start, n, num_tokens)
            budget -= n
            i += 1
        return budget

    def _preempt_for(self, request: Request, n: int, out: SchedulerOutput) -> bool:
        """Preempt from the end of the running set until ``request`` gets slots for ``n``
        more tokens; False when ``request`` itself had to go."""
        while True:
            victim = self.running.last()
            self._preempt(victim, out)
            if victim is request:
                return False
            if self.kv_manager.allocate_slots(request, n) is not None:
                return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
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
                self.swapped.add(request)
                self.stats.num_preemptions_swap += 1
                return
        self._send_back(request)
        self.stats.num_preemptions_recompute += 1

    def _adapter_waits(self, request: Request) -> bool:
        """Whether ``request`` must wait for the running requests' adapters: its own is not
        among them and they already fill the model's ``max_loras`` slots (one step's rows use
        at most that many). Head of line: those behind it wait too, as under ``fcfs``."""
        cap, adapter = self.config.max_loras, request.adapter
        if not cap or adapter is None:
            return False
        running = {r.adapter for r in self.running.in_order if r.adapter is not None}
        return adapter not in running and len(running) >= cap

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.swapped.first()
            if self._adapter_waits(request):
                break
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            mapping = self.kv_manager.swap_in(request, n)
            if mapping is None:
                break  # too few free blocks now: it stays swapped out
            out.swap_in.extend(mapping)
            self.swapped.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.add(request)
            self._plan(out, request, request.num_computed_tokens, n, request.num_tokens)
            budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        whole = self.admission.forms_whole_batch
        while (budget > 0 or whole) and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request is None or self._adapter_waits(request):
                break
            hit, num_hit = self.kv_manager.get_computed_blocks(request)
            n = request.num_tokens - num_hit
            planned = self._tokens_now(n, budget)
            if not planned and not whole:
                break
            if self.kv_manager.allocate_slots(request, n if whole else planned, hit) is None:
                break
            self.waiting.pop()
            self._start(request, num_hit, self.kv_manager.host_tokens(hit))
            if planned:
                self._plan(out, request, num_hit, planned, request.num_tokens)
                budget -= planned
        return budget

    def _start(self, request: Request, num_hit: int, num_host_hit: int) -> None:
        """A waiting request joins the running batch with ``num_hit`` tokens from the cache
        (``num_host_hit`` of them restored from the host tier)."""
        self.kv_manager.count_prefix_lookup(request.num_tokens, num_hit, num_host_hit)
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_hit
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        self.running.add(request)

    # -- runs of identical decode steps (a simulator's shortcut) ---------------

    def decode_run(self, token: int) -> list[int]:
        """The next steps that are all one pure decode step, as the blocks they take: entry
        j is what steps 1 to j + 1 allocate in all; empty when the next step is not one.

        It is one when every running request decodes a single token within the budget,
        nothing waits or is swapped out, and no layer slides; the run ends before the
        first step in which a request would finish sampling ``token`` (its length limit,
        or a stop token) or blocks would run out. ``skip_decode_steps`` takes the run's
        steps at once, as ``schedule`` and ``update`` would one by one
        (``engine.core.decode_run``).
        """
        if self.waiting or self.swapped:
            return []
        return run_blocks(self.running.in_order, self.kv_manager, self.config, token)

    def skip_decode_steps(self, num_steps: int, token: int) -> None:
        """Take ``num_steps`` steps of a ``decode_run`` at once, each request sampling ``token``
        every step: the blocks allocated and cached in the order the steps would take them
        (step by step, each step's allocations before its caching, in running order)."""
        take_run(list(self.running.in_order), self.kv_manager, num_steps, token)
        self.stats.num_steps += num_steps

    # -- results ---------------------------------------------------------------

    def update(
        self, out: SchedulerOutput, sampled: dict[str, int]
    ) -> list[tuple[Request, int | None]]:
        """Apply one step's results; returns (request, new token or None) for each planned one.

        Requests that hit a stop condition are finished and their blocks freed.
        """
        results: list[tuple[Request, int | None]] = []
        for item in out.scheduled:
            request = item.request
            if request.is_finished or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += len(item.token_ids)
            # Cache before any stop check, so a request that ends now (a prefill-role
            # request always does) still leaves its full blocks in the prefix cache.
            self.kv_manager.cache_blocks(request)
            self.kv_manager.release_outside_window(request)
            token = sampled.get(request.request_id) if item.sample else None
            if token is not None:
                request.output_token_ids.append(token)
                status = self._check_stop(request, token)
                if status is not None:
                    self.running.remove(request)
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
