"""The discrete-event simulator: Tandem's scheduler, placement, admission and autoscaling on
simulated time, with the model and the KV transfers replaced by a cost model.

Everything that decides is the project's own code, called with the simulated ``now``:

- each worker's ``engine.core.scheduler.Scheduler`` and ``engine.core.block_pool.KVCacheManager``
  (``sim.worker``), stepped one plan at a time;
- the router's ``router.admission.Admission`` and ``router.placement`` (``pick_decode``,
  ``pick_prefill``, ``prefill_here``, ``round_robin``, ``PrefixIndex``), fed the
  workers' load reports (``engine.wire.messages.DecodeLoad`` / ``PrefillLoad``);
- with ``autoscaling``, the controller's ``cluster.elastic.PoolScaler.observe`` and
  ``cluster.autoscaler.Autoscaler.decide``.

What the simulator itself does is the plumbing that is Ray and asyncio in the service
(``router.dispatch``): the order of the calls, as the dispatcher makes them. A request's
way, disaggregated::

    arrive ─▶ admit ─▶ pick decode worker ─▶ reserve blocks (add_remote)*
        ─▶ pick prefill worker ─▶ prefill (max_tokens 1, hold_kv) ─▶ KV transfer
        ─▶ remote_arrived*: first token ─▶ decode steps ─▶ finished, ticket released
    no decode worker with room: try again every ``load_poll_s`` until ``capacity_wait_s``
    colocated, or ``prefill_here``: the decode worker runs the request whole
    * a call to the worker: on its step thread, once the step under way has ended

Tokens reach the client at the end of the step that sampled them (a stream interval of
0), the first one of a disaggregated request when its KV has arrived and the decode
worker's step under way has ended. A cost model timed on a live service adds the
request's way through it (``service_path``: a delay drawn from those measured with as
many requests in flight, before the router places the request) and, for workers sharing
a host's cores, each step's contention with the others mid-step and the requests in
flight as it begins (``contention``). A transfer waits for both workers' links to be
free (each link carries one transfer at a time).

A decode worker takes a run of identical decode steps as one event (``sim.worker``'s
lifecycle), cut short when a request is placed on it or its KV arrives; the outcome is
the stepped one's (``decode_runs=False`` steps one plan at a time, as a check). With
autoscaling, every run is cut when the controller looks (``cut_runs``), and the clients'
tokens reach its latency window then, in the order they came (``sim/client_tokens.py``).
The run's data, ``Record`` and ``SimResult``, live in ``sim/records.py`` (imported from here too).
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from bisect import bisect_left, bisect_right
from dataclasses import replace

import numpy as np

from engine.core.request import Request
from engine.core.step_shape import shape_of
from engine.wire.sampling_params import SamplingParams
from router.admission import Admission, Rejection
from sim.client_tokens import ClientTokens
from sim.cost import CostModel
from sim.records import Record, SimResult
from sim.router import SimRouter
from sim.topology import SimTopology
from sim.worker import SAMPLED_TOKEN, DecodeRun, SimWorker
from sim.workload import SimRequest


class Simulator:
    """One run: a topology on a cost model replays a list of requests (``run``)."""

    def __init__(self, topology: SimTopology, cost: CostModel, requests: list[SimRequest],
                 sample_interval_s: float = 1.0, decode_runs: bool = True, seed: int = 0) -> None:
        self.topology = topology
        self.cost = cost
        self.requests = requests
        self.sample_interval_s = sample_interval_s
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.admission = Admission(topology.router.admission)
        self.pools: dict[str, list[SimWorker]] = {"prefill": [], "decode": []}
        self._retired: list[SimWorker] = []
        self._ids = itertools.count()
        for role, n in (("prefill", topology.prefill_workers), ("decode", topology.decode_workers)):
            for _ in range(n):
                self.pools[role].append(self._new_worker(role))
        self.router = SimRouter(topology.router, topology.engine_config("decode"), self.pools)
        self.records = [Record(i, r) for i, r in enumerate(requests)]
        self._open = len(self.records)
        self._send_times = sorted(r.req.arrival_s for r in self.records)
        self._draws = random.Random(seed)  # the service path's delays
        self.samples: list[dict] = []
        self.scaling = self.latency = None
        if topology.autoscaling is not None:
            from router.latency import LatencyWindow
            from sim.scaling import SimScaling

            self.latency = LatencyWindow(span_s=10.0)  # what the routers' clients saw, as the router keeps it
            self.scaling = SimScaling(self, topology.autoscaling)
        self._max_devices = self._held = self.num_devices()  # devices held (workers starting hold theirs)
        self._held_since = self._device_s = 0.0
        self.local_prefills = 0
        # With autoscaling, what clients saw waits there until the controller reads it (``latency_report``).
        self.tokens = ClientTokens(self.latency)
        # Runs time their steps ahead, which a shared host's contention does not allow.
        self.decode_runs = decode_runs and not cost.contention

    # -- the event loop ---------------------------------------------------------

    def at(self, t: float, fn, arg=None) -> None:
        """Call ``fn(arg)`` at simulated time ``t``."""
        heapq.heappush(self._events, (t, next(self._seq), fn, arg))

    def run(self) -> SimResult:
        cpu0 = time.process_time()
        path = self.cost.service_path  # the way to the router's placement, and back
        if path.is_fixed:
            latency = path.delay_s(0, 0.0)
            for rec in self.records:
                self.at(rec.req.arrival_s + latency, self._arrive, rec)
        else:
            for rec in self.records:
                self.at(rec.req.arrival_s, self._send, rec)
        if self.records:
            self.at(0.0, self._sample)
        if self.scaling is not None:
            self.at(self.scaling.config.interval_s, self.scaling.tick)
        events, pop = self._events, heapq.heappop
        while events and self._open:
            self.now, _, fn, arg = pop(events)
            fn(arg)
        self.note_devices()
        workers = [w for pool in self.pools.values() for w in pool] + self._retired
        return SimResult(
            self.records,
            sum(w.scheduler.stats.num_preemptions for w in workers),
            sum(w.num_steps for w in workers),
            self.samples,
            time.process_time() - cpu0,
            self._max_devices,
            self.scaling.decisions if self.scaling is not None else [],
            self.local_prefills,
            self._device_s,
            self.now,
        )

    def num_devices(self) -> int:
        """Devices the pools hold: a worker one a rank."""
        return sum(w.config.tensor_parallel_size for p in self.pools.values() for w in p)

    def note_devices(self) -> None:
        """The devices held may have changed now (workers still starting hold theirs): count
        the device-seconds until now and keep the most held at once."""
        held = self.num_devices() + (self.scaling.starting if self.scaling is not None else 0)
        self._device_s += self._held * (self.now - self._held_since)
        self._held, self._held_since = held, self.now
        self._max_devices = max(self._max_devices, held)

    def add_worker(self, role: str) -> SimWorker:
        """A new worker joins ``role``'s pool (autoscaling), empty."""
        w = self._new_worker(role)
        self.pools[role].append(w)
        self.note_devices()
        return w

    def retire_worker(self, w: SimWorker) -> None:
        """A drained worker leaves its pool; its counters still count."""
        self.pools[w.role].remove(w)
        self.router.gone(w)
        self._retired.append(w)
        self.note_devices()

    def _new_worker(self, role: str) -> SimWorker:
        config = self.topology.engine_config(role)
        blocks, cpu_blocks = self.topology.kv_blocks(role, self.cost)
        max_len = min(config.max_model_len or 1 << 62, self.cost.model.max_model_len)
        return SimWorker(f"{role}-{next(self._ids)}", role, config, blocks, cpu_blocks, max_len,
                         self.cost.at_tp(config.tensor_parallel_size))

    def _sample(self, _=None) -> None:
        """Queue lengths and KV use of each pool, every ``sample_interval_s``."""
        row = {"t": self.now}
        for role, pool in self.pools.items():
            if pool:
                row[f"{role}_waiting"] = sum(w.scheduler.num_waiting for w in pool)
                row[f"{role}_running"] = sum(len(w.scheduler.running) for w in pool)
                row[f"{role}_kv_usage"] = max(w.kv_usage(self.now) for w in pool)
                row[f"{role}_workers"] = len(pool)
        self.samples.append(row)
        self.at(self.now + self.sample_interval_s, self._sample)

    # -- requests ---------------------------------------------------------------

    def _send(self, rec: Record) -> None:
        """The client sends ``rec``: it reaches the router after a delay drawn from those
        measured with as many others in flight (``ServicePath``: sent before it, not ended)."""
        others = bisect_left(self._send_times, self.now) - (len(self.records) - self._open)
        delay = self.cost.service_path.delay_s(others, self._draws.random())
        self.at(self.now + delay, self._arrive, rec)

    def _arrive(self, rec: Record) -> None:
        decision = self.admission.try_admit(rec.req.prompt_tokens, self.now)
        if isinstance(decision, Rejection):
            self._fail(rec, "http_429")
            return
        rec.ticket = decision
        rec.deadline_s = self.now + self.topology.router.capacity_wait_s
        self._place(rec)

    def _place(self, rec: Record) -> None:
        """The dispatcher's ``_start``: a decode worker with room, then the request's way there."""
        req, rid = rec.req, str(rec.index)
        prompt = req.prompt_ids(rec.index)
        chosen = self.router.choose_decode(prompt, self.now)
        if chosen is not None:
            decode, held = chosen
            params = SamplingParams(max_tokens=req.output_tokens, ignore_eos=True)
            request = Request(rid, prompt, params, arrival_time=self.now)
            local = self.router.prefill_here(prompt, held, decode, self.now)
            self._cut(decode)
            if self.topology.colocated or local:
                self.local_prefills += local is not None
                self.router.placed_here(decode, request)
                rec.decode = decode
                decode.scheduler.add_request(request)
                decode.prompt_tokens += req.prompt_tokens
                decode.touch()
                self.kick(decode)
                return
            self._on_step_thread(decode, self._reserve, (rec, decode, request))
            return
        self._place_later(rec)

    def _place_later(self, rec: Record) -> None:
        """No decode worker had room: look again after ``load_poll_s``, until the deadline."""
        if self.now + self.topology.router.load_poll_s > rec.deadline_s:
            self._fail(rec, "no_capacity")
            return
        self.at(self.now + self.topology.router.load_poll_s, self._place, rec)

    def _reserve(self, placed: tuple[Record, SimWorker, Request]) -> None:
        """On the decode worker's step thread (``DecodeWorker.reserve``): blocks for the
        prompt's KV, then the prefill; no room (or draining) sends it back to placement."""
        rec, decode, request = placed
        self.router.reserved(decode, request)
        reserved = None if decode.draining else decode.scheduler.add_remote(request)
        decode.touch()
        if reserved is None:
            self._place_later(rec)
            return
        rec.decode, rec.held_blocks = decode, reserved[1]
        self._start_prefill(rec, request.prompt_token_ids)

    def _start_prefill(self, rec: Record, prompt: list[int]) -> None:
        prefill = self.router.choose_prefill(prompt, self.now)
        rec.prefill = prefill
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        prefill.scheduler.add_request(Request(str(rec.index), prompt, params, arrival_time=self.now, hold_kv=True))
        self.router.prefill_queued(prefill, prompt)
        prefill.prompt_tokens += rec.req.prompt_tokens
        prefill.touch()
        self.kick(prefill)

    def _fail(self, rec: Record, kind: str) -> None:
        rec.error, rec.end_s = kind, self.now
        self._close(rec)

    def _close(self, rec: Record) -> None:
        if rec.ticket is not None:
            self.admission.release(rec.ticket, self.now)
            rec.ticket = None
        self._open -= 1

    # -- steps ------------------------------------------------------------------

    def kick(self, w: SimWorker) -> None:
        """Start a step on ``w`` if it is idle and has work it can step (or a run of decode steps)."""
        if w.in_flight is not None or w.run is not None or not w.scheduler.has_schedulable_work():
            return
        if self.decode_runs and w.role == "decode":
            taken = w.scheduler.decode_run(SAMPLED_TOKEN)
            if len(taken) > 1:
                self._start_run(w, taken)
                return
        out = w.scheduler.schedule()
        w.touch()
        if out.is_empty and not out.finished:
            return  # nothing fits now: the next arrival or freed blocks kick it again
        dt = w.cost.step_s(shape_of(out))
        if self.cost.contention:  # the workers and the service share a host's cores
            dt *= self.cost.contention.factor(w.role, self._others_busy(w), self._in_flight())
        w.in_flight = out
        w.num_steps += 1
        w.forward_s += dt
        self.at(self.now + dt, self._step_done, w)

    def _on_step_thread(self, w: SimWorker, fn, arg) -> None:
        """``fn(arg)`` as a worker runs the calls it is sent (``AsyncEngine.call``): on its
        step thread, between steps; at once when it is idle, else once the step under way
        has ended and handed on its outputs. ``fn`` leaves kicking ``w`` to this."""
        self._cut(w)
        if w.in_flight is None:
            fn(arg)
            self.kick(w)
        else:
            w.calls.append((fn, arg))

    def _in_flight(self) -> int:
        """Requests the clients have sent and that have not ended."""
        return bisect_right(self._send_times, self.now) - (len(self.records) - self._open)

    def _others_busy(self, w: SimWorker) -> int:
        """Workers other than ``w`` mid-step."""
        return sum(v is not w and v.in_flight is not None for pool in self.pools.values() for v in pool)

    def _step_done(self, w: SimWorker) -> None:
        out, w.in_flight = w.in_flight, None
        sampled = {item.request.request_id: SAMPLED_TOKEN for item in out.scheduled if item.sample}
        results = w.scheduler.update(out, sampled)
        w.touch()
        if w.role == "prefill":
            for request, token in results:
                if token is not None and request.is_finished:
                    self._send_kv(w, self.records[int(request.request_id)], request)
        else:
            now, latency = self.now, self.latency
            for request, token in results:
                if token is not None:
                    rec = self.records[int(request.request_id)]
                    if latency is None:
                        rec.token_times.append(now)
                    else:
                        self.tokens.token(rec, now)
                    if request.is_finished:
                        self._finish(rec, request)
        for request in out.finished:  # ended while planning: it can never fit
            self._fail(self.records[int(request.request_id)], "too_long")
        calls, w.calls = w.calls, []
        for fn, arg in calls:  # the calls that came during the step, before the next
            fn(arg)
        self.kick(w)
        if w.draining and self.scaling is not None:
            self.scaling.check_drained(w)

    # -- runs of decode steps -------------------------------------------------------

    def _start_run(self, w: SimWorker, taken: list[int]) -> None:
        """The steps of a ``decode_run``, timed as ``kick`` times each (``CostModel.decode_steps_s``)."""
        running = list(w.scheduler.running.in_order)
        durations = w.cost.decode_steps_s(len(running), sum(r.num_computed_tokens for r in running), len(taken))
        ends = _running_sum(self.now, durations)
        w.run = DecodeRun(ends, durations, taken, w.kv.pool.num_free_blocks, running)
        w.touch()
        self.at(float(ends[-1]), self._run_done, (w, w.run))

    def _skip(self, w: SimWorker, run: DecodeRun, num_steps: int) -> None:
        """The run's first ``num_steps`` steps ended: the scheduler skips them, their tokens
        reach the clients."""
        w.scheduler.skip_decode_steps(num_steps, SAMPLED_TOKEN)
        self.tokens.ran(self.records, run.requests, run.ends[:num_steps])
        if num_steps:
            w.forward_s = float(_running_sum(w.forward_s, run.durations[:num_steps])[-1])
        w.num_steps += num_steps
        w.run = None
        w.touch()

    def _run_done(self, worker_run: tuple[SimWorker, DecodeRun]) -> None:
        w, run = worker_run
        if w.run is not run:
            return  # cut short
        self._skip(w, run, len(run.ends))
        self.kick(w)

    def _cut(self, w: SimWorker) -> None:
        """``w`` is about to change mid-run: skip the steps ended, plan the one under way."""
        run = w.run
        if run is None:
            return
        m = run.steps_ended(self.now)
        self._skip(w, run, m)
        out = w.scheduler.schedule()
        w.in_flight = out
        w.num_steps += 1
        w.forward_s += float(run.durations[m])
        self.at(float(run.ends[m]), self._step_done, w)

    def cut_runs(self) -> None:
        """Every worker's run cut at now (``_cut``: the same simulation), so that its state
        and its clients' tokens are those of now."""
        for pool in self.pools.values():
            for w in pool:
                self._cut(w)

    def latency_report(self):
        """What the routers' clients saw lately, every token up to now (``ClientTokens.report``;
        the controller cuts the runs first: ``cut_runs``)."""
        return self.tokens.report(self.now)

    def _finish(self, rec: Record, request: Request) -> None:
        rec.end_s = self.now
        rec.cached_tokens = request.num_cached_tokens
        self._close(rec)

    # -- KV hand-off ------------------------------------------------------------

    def _send_kv(self, prefill: SimWorker, rec: Record, request: Request) -> None:
        """The prefill finished: send the prompt's blocks the decode worker does not hold."""
        blocks = prefill.kv.num_blocks_needed(request.num_tokens - 1) - rec.held_blocks
        decode = rec.decode
        start = max(self.now, prefill.link_free_at, decode.link_free_at)
        busy = self.cost.handoff_busy_s(max(0, blocks), prefill.config.block_size,
                                        prefill.config.tensor_parallel_size, decode.config.tensor_parallel_size)
        prefill.link_free_at = decode.link_free_at = start + busy
        self.at(start + busy + self.cost.link_latency_s, self._kv_arrived, rec)

    def _kv_arrived(self, rec: Record) -> None:
        """The read landed: the decode worker starts the request and the prefill worker lets
        go of its blocks, each on its step thread."""
        self._on_step_thread(rec.decode, self._decode_starts, rec)
        self._on_step_thread(rec.prefill, self._release_held, rec)

    def _decode_starts(self, rec: Record) -> None:
        """``DecodeWorker._kv_arrived``: the first token goes to the client."""
        request = rec.decode.scheduler.remote_arrived(str(rec.index), SAMPLED_TOKEN)
        rec.decode.touch()
        if request is None:
            return
        self.tokens.token(rec, self.now)
        if request.is_finished:
            self._finish(rec, request)

    def _release_held(self, rec: Record) -> None:
        rec.prefill.scheduler.release_held(str(rec.index))
        rec.prefill.touch()
        if rec.prefill.draining and self.scaling is not None:
            self.scaling.check_drained(rec.prefill)


def _running_sum(start: float, steps: np.ndarray) -> np.ndarray:
    """``start + steps[0]``, then that ``+ steps[1]``, ...: each partial sum rounded as adding
    one step at a time rounds it (``np.add.accumulate`` adds in order; ``np.cumsum`` then
    ``+ start`` would round otherwise)."""
    return np.add.accumulate(np.concatenate(([start], steps)))[1:]


def run(topology: SimTopology, cost: CostModel, requests: list[SimRequest], **kwargs) -> SimResult:
    """Simulate ``requests`` on ``topology``."""
    return Simulator(topology, cost, requests, **kwargs).run()


def with_engine(topology: SimTopology, role: str | None = None, **settings) -> SimTopology:
    """``topology`` with engine settings changed for both roles (or one)."""
    if role is None:
        return replace(topology, engine={**topology.engine, **settings})
    key = f"{role}_engine"
    return replace(topology, **{key: {**getattr(topology, key), **settings}})
