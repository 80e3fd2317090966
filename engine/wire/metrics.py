"""Every metric Tandem exports: names, labels and buckets, in one place.

prometheus-client objects only; no server here (``cluster`` starts the scrape
endpoint). Names follow vLLM's under the ``tandem:`` prefix and every series carries
``model``, ``role`` (router | prefill | decode | colocated) and ``worker``.

Ray runs each worker in its own process. When ``PROMETHEUS_MULTIPROC_DIR`` is set
(``tandem up`` sets it for every process it starts on the node) the values go to
files there, and the node's one scrape endpoint reads them all; without it (tests,
the offline API) they live in this process's default registry.

Recording stays off the hot path: the engine keeps plain counters and timestamps,
and the recorders below turn them into metric updates once per step or per finished
request, in bulk. The load gauges (running, waiting, KV usage) are also set between
steps (``EngineMetrics.on_load``, after queued calls and before the step thread sleeps):
blocks released or reserved outside a step (a transfer's end, an abort, a reservation)
would otherwise leave them stale until the next step, which at idle never comes.
"""

from __future__ import annotations

import bisect

from prometheus_client import Counter, Gauge, Histogram

LABELS = ("model", "role", "worker")

# Milliseconds to minutes: serving latencies span five orders of magnitude.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)
TOKEN_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)

_GAUGE_MODE = {"multiprocess_mode": "livemax"}


def _histogram(name: str, doc: str, buckets=LATENCY_BUCKETS, extra: tuple[str, ...] = ()) -> Histogram:
    return Histogram(f"tandem:{name}", doc, LABELS + extra, buckets=buckets)


def _counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
    return Counter(f"tandem:{name}", doc, LABELS + extra)


def _gauge(name: str, doc: str) -> Gauge:
    return Gauge(f"tandem:{name}", doc, LABELS, **_GAUGE_MODE)


TIME_TO_FIRST_TOKEN = _histogram("time_to_first_token_seconds", "Time to first token, end to end at the router.")
INTER_TOKEN_LATENCY = _histogram(
    "inter_token_latency_seconds", "Time between consecutive output tokens.", TOKEN_LATENCY_BUCKETS
)
TIME_PER_OUTPUT_TOKEN = _histogram(
    "request_time_per_output_token_seconds",
    "Per request: (e2e - ttft) / (output tokens - 1).",
    TOKEN_LATENCY_BUCKETS,
)
E2E_LATENCY = _histogram("e2e_request_latency_seconds", "Request latency from arrival to its last token.")
QUEUE_TIME = _histogram("request_queue_time_seconds", "Time a request waited before its first step.")
PREFILL_TIME = _histogram("request_prefill_time_seconds", "First step to first token.")
DECODE_TIME = _histogram("request_decode_time_seconds", "First token to last token.")
KV_TRANSFER_TIME = _histogram("kv_transfer_time_seconds", "One request's KV transfer, as its receiver saw it.")

NUM_RUNNING = _gauge("num_requests_running", "Requests in the running batch.")
NUM_WAITING = _gauge("num_requests_waiting", "Requests waiting: queued or swapped out.")
KV_CACHE_USAGE = _gauge("kv_cache_usage_perc", "Share of KV blocks in use (0 to 1).")

PROMPT_TOKENS = _counter("prompt_tokens", "Prompt tokens of finished requests.")
GENERATION_TOKENS = _counter("generation_tokens", "Generated tokens of finished requests.")
REQUEST_SUCCESS = _counter("request_success", "Finished requests, by finish reason.", ("finished_reason",))
NUM_PREEMPTIONS = _counter("num_preemptions", "Preemptions, by mode.", ("mode",))
PREFIX_CACHE_QUERIES = _counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
PREFIX_CACHE_HITS = _counter("prefix_cache_hits", "Prompt tokens served by the prefix cache.")
# The host KV tier behind the prefix cache (EngineConfig.host_kv_cache_memory), per rank's share.
HOST_CACHE_BLOCKS = _gauge("host_cache_blocks", "Blocks the host KV tier can hold (0: no host tier).")
HOST_CACHE_BLOCKS_USED = _gauge("host_cache_blocks_used", "Blocks the host KV tier holds now.")
HOST_CACHE_HITS = _counter("host_cache_hits", "Prompt tokens the host KV tier served (restored, not "
                           "recomputed); a part of prefix_cache_hits.")
HOST_CACHE_SPILLS = _counter("host_cache_spills", "Prefix blocks the device evicted that were copied into the "
                             "host KV tier.")
HOST_CACHE_RESTORES = _counter("host_cache_restores", "Blocks copied back from the host KV tier to the device.")
# LoRA adapters (EngineConfig.max_loras).
LORA_RESIDENT = _gauge("lora_resident", "LoRA adapters in a device slot now (at most max_loras).")
LORA_LOADS = _counter("lora_loads", "LoRA adapters written into a device slot (first use, or back after "
                      "an eviction).")
LORA_EVICTIONS = _counter("lora_evictions", "LoRA adapters pushed out of their slot for another one "
                          "(least recently used first).")
KV_TRANSFER_BYTES = _counter("kv_transfer_bytes", "KV bytes received from prefill workers.")
KV_TRANSFER_FAILURES = _counter("kv_transfer_failures", "Failed KV transfers, by reason.", ("reason",))
REQUESTS_REJECTED = _counter("requests_rejected", "Requests turned away, by reason.", ("reason",))
STREAM_EVENTS = _counter(
    "stream_events",
    "Subscription stream events: a subscriber cut off for falling behind (worker: cut_off; router: "
    "cut), told it is behind (slow), a token channel reconnected (resumed).",
    ("event",),
)
REQUEST_MIGRATIONS = _counter(
    "request_migrations", "Streams moved to another decode worker after theirs died mid-stream."
)
LOCAL_PREFILLS = _counter(
    "local_prefills", "Requests the router had their decode worker compute whole instead of sending them "
    "through the prefill pool, by reason (short: little of the prompt uncached there; prefill_busy).", ("reason",)
)
# The pools' control loop (cluster/elastic.py), in the cluster controller: per deployment and role.
POOL_LABELS = ("model", "role")
POOL_WORKERS = Gauge("tandem:pool_workers", "Workers listed in the pool, draining ones aside.", POOL_LABELS,
                     **_GAUGE_MODE)
POOL_TARGET_WORKERS = Gauge("tandem:pool_target_workers", "Workers the pool is heading for (listed, plus "
                            "changes under way).", POOL_LABELS, **_GAUGE_MODE)
SCALING_DECISIONS = Counter("tandem:scaling_decisions", "The control loop's decisions, by direction (up, down) "
                            "and reason (slo, queue, idle, switch).", POOL_LABELS + ("direction", "reason"))


ROLE_SWITCHES = Counter("tandem:role_switches", "Warm workers moved from one pool to the other, by the role "
                        "they took (role) and the one they left (from_role).", POOL_LABELS + ("from_role",))


class EngineMetrics:
    """Exports one engine's state and finished requests (a worker's view)."""

    def __init__(self, model: str, role: str, worker: str) -> None:
        labels = (model, role, worker)
        self.labels = labels
        self._running = NUM_RUNNING.labels(*labels)
        self._waiting = NUM_WAITING.labels(*labels)
        self._usage = KV_CACHE_USAGE.labels(*labels)
        self._gauged: tuple[int, int, int] | None = None  # (running, waiting, blocks in use) as exported
        # The engine's running totals (``EngineStats`` fields), each with its counter.
        self._totals = {
            "num_preemptions_recompute": NUM_PREEMPTIONS.labels(*labels, "recompute"),
            "num_preemptions_swap": NUM_PREEMPTIONS.labels(*labels, "swap"),
            "prefix_cache_queries": PREFIX_CACHE_QUERIES.labels(*labels),
            "prefix_cache_hits": PREFIX_CACHE_HITS.labels(*labels),
            "host_cache_hits": HOST_CACHE_HITS.labels(*labels),
            "host_cache_spills": HOST_CACHE_SPILLS.labels(*labels),
            "host_cache_restores": HOST_CACHE_RESTORES.labels(*labels),
            "lora_loads": LORA_LOADS.labels(*labels),
            "lora_evictions": LORA_EVICTIONS.labels(*labels),
        }
        # The totals as last exported, so each export adds only the difference.
        self._exported = dict.fromkeys(self._totals, 0)
        # The ``EngineStats`` levels that change only in steps, each with its gauge, and as last exported.
        self._levels = {
            "host_cache_blocks": HOST_CACHE_BLOCKS.labels(*labels),
            "host_cache_blocks_used": HOST_CACHE_BLOCKS_USED.labels(*labels),
            "lora_resident": LORA_RESIDENT.labels(*labels),
        }
        self._leveled: dict[str, int] = {}
        self._queue = QUEUE_TIME.labels(*labels)
        self._prefill = PREFILL_TIME.labels(*labels)
        self._decode = DECODE_TIME.labels(*labels)

    def on_step(self, stats) -> None:
        """Once per engine step (``stats``: an ``EngineStats``)."""
        self._gauge(
            stats.num_running, stats.num_waiting + stats.num_swapped, stats.num_blocks_in_use, stats.num_blocks
        )
        for name, counter in self._totals.items():
            now = getattr(stats, name)
            delta = now - self._exported[name]
            if delta:
                counter.inc(delta)
                self._exported[name] = now
        for name, gauge in self._levels.items():
            now = getattr(stats, name)
            if self._leveled.get(name) != now:  # a write only when it changed
                gauge.set(now)
                self._leveled[name] = now

    def on_load(self, load) -> None:
        """Between steps (``load``: an ``EngineLoad``): the gauges catch up with what calls
        changed since the last step; nothing is written when nothing did."""
        self._gauge(
            load.num_running, load.num_waiting + load.num_swapped, load.num_blocks - load.num_free_blocks,
            load.num_blocks,
        )

    def _gauge(self, running: int, waiting: int, in_use: int, num_blocks: int) -> None:
        now = (running, waiting, in_use)
        if now == self._gauged:
            return
        self._gauged = now
        self._running.set(running)
        self._waiting.set(waiting)
        self._usage.set(in_use / num_blocks)  # free blocks that hold a cached prefix are free

    def on_finished(self, times) -> None:
        """A request finished here (``times``: its ``RequestTimes``)."""
        if times.queue_s is not None:
            self._queue.observe(times.queue_s)
        if times.prefill_s is not None:
            self._prefill.observe(times.prefill_s)
        if times.decode_s is not None:
            self._decode.observe(times.decode_s)

    def on_transfer(self, seconds: float, nbytes: int) -> None:
        KV_TRANSFER_TIME.labels(*self.labels).observe(seconds)
        KV_TRANSFER_BYTES.labels(*self.labels).inc(nbytes)

    def on_transfer_failure(self, reason: str) -> None:
        KV_TRANSFER_FAILURES.labels(*self.labels, reason).inc()

    def on_subscriber_cut_off(self) -> None:
        STREAM_EVENTS.labels(*self.labels, "cut_off").inc()


class BatchedObserver:
    """One histogram series whose observations gather in process memory and are written
    ``flush_every`` at a time (and on ``flush``). In multiprocess mode every
    ``Histogram.observe`` is two locked writes to a memory-mapped file; the router
    observes once per streamed token, where that cost was a few percent of its CPU.

    It reads the bucket bounds and writes the bucket and sum values of a
    prometheus-client histogram child (``_upper_bounds``, ``_buckets``, ``_sum``: the
    layout ``Histogram.observe`` itself uses), so a scrape sees exactly what plain
    observes would have written, up to ``flush_every`` observations later.
    """

    def __init__(self, child, flush_every: int = 64) -> None:
        self._child = child
        self._bounds = list(child._upper_bounds)  # the last is +Inf: every amount has a bucket
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._pending = 0
        self.flush_every = flush_every

    def observe(self, amount: float, times: int = 1) -> None:
        """``times`` observations of ``amount``."""
        self._counts[bisect.bisect_left(self._bounds, amount)] += times  # first bound >= amount
        self._sum += amount * times
        self._pending += times
        if self._pending >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        for i, count in enumerate(self._counts):
            if count:
                self._child._buckets[i].inc(count)
                self._counts[i] = 0
        self._child._sum.inc(self._sum)
        self._sum = 0.0
        self._pending = 0


class PoolMetrics:
    """The control loop's view of each pool."""

    def __init__(self, model: str) -> None:
        self.model = model

    def on_pools(self, workers: dict[str, int], targets: dict[str, int]) -> None:
        for role, n in workers.items():
            POOL_WORKERS.labels(self.model, role).set(n)
            POOL_TARGET_WORKERS.labels(self.model, role).set(targets[role])

    def on_decision(self, role: str, direction: str, reason: str) -> None:
        SCALING_DECISIONS.labels(self.model, role, direction, reason).inc()

    def on_role_switch(self, from_role: str, to_role: str) -> None:
        ROLE_SWITCHES.labels(self.model, to_role, from_role).inc()


class RouterMetrics:
    """What only the router sees: latency end to end, usage, rejections."""

    def __init__(self, model: str, worker: str) -> None:
        self.labels = (model, "router", worker)
        self._ttft = TIME_TO_FIRST_TOKEN.labels(*self.labels)
        self._itl = BatchedObserver(INTER_TOKEN_LATENCY.labels(*self.labels))  # per token: batched
        self._tpot = TIME_PER_OUTPUT_TOKEN.labels(*self.labels)
        self._e2e = E2E_LATENCY.labels(*self.labels)
        self._prompt = PROMPT_TOKENS.labels(*self.labels)
        self._generation = GENERATION_TOKENS.labels(*self.labels)

    def on_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def on_tokens(self, num_tokens: int, seconds: float) -> None:
        """``num_tokens`` arrived together ``seconds`` after the previous ones."""
        if num_tokens > 0:
            self._itl.observe(seconds / num_tokens, num_tokens)

    def on_finished(
        self, reason: str, e2e_s: float, ttft_s: float | None, prompt_tokens: int, output_tokens: int,
    ) -> None:
        REQUEST_SUCCESS.labels(*self.labels, reason).inc()
        self._itl.flush()  # a finished request's token gaps are visible at once
        self._e2e.observe(e2e_s)
        self._prompt.inc(prompt_tokens)
        self._generation.inc(output_tokens)
        if ttft_s is not None and output_tokens > 1:
            self._tpot.observe((e2e_s - ttft_s) / (output_tokens - 1))

    def on_rejected(self, reason: str) -> None:
        REQUESTS_REJECTED.labels(*self.labels, reason).inc()

    def on_migrated(self) -> None:
        REQUEST_MIGRATIONS.labels(*self.labels).inc()

    def on_local_prefill(self, reason: str) -> None:
        LOCAL_PREFILLS.labels(*self.labels, reason).inc()

    def on_stream_event(self, event: str) -> None:
        """A decode worker's stream said something about itself (a ``Notice`` kind)."""
        STREAM_EVENTS.labels(*self.labels, event).inc()
