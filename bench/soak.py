"""Soak test: the whole service under steady open-loop load for a long time, watching
for what only time shows: memory that creeps up, KV blocks that are never given back,
requests that never end.

    python -m bench.soak --duration-s 600 --capacity-fraction 0.8 --out-dir docs/soak

A run:

1. starts the service in-process (local Ray on ``--num-cpus``, 1 prefill + 1 decode
   worker, the ``collective`` KV transfer backend, metrics in a multiprocess folder as
   ``tandem up`` sets them up);
2. measures capacity (unless ``--rate``): ``--capacity-requests`` synthetic requests
   sent at once, completed requests/s;
3. sends Poisson arrivals at ``--capacity-fraction`` of it for ``--duration-s``; a
   seeded ``--cancel-fraction`` of the requests is cancelled part way: half after a
   random delay (often before the first token, while the request is queued, in prefill
   or in transfer), half after a random number of streamed chunks (while decoding);
4. every ``--sample-s`` records the RSS of every process of the service, the KV blocks
   in use on every worker, the requests in flight, and the latency percentiles of the
   requests that finished in that window;
5. stops sending, waits ``--drain-timeout-s`` for the requests in flight (those still
   open then hung), waits up to ``--settle-s`` for every worker's blocks in use to
   reach 0, and judges the trends (``judge_rss``, ``judge_blocks``).

Exit code 0 when the verdict is PASS, 1 when it is FAIL, 2 when the service never
served. Writes ``soak.json`` (every sample, the summary, the verdict), ``soak.png`` and
``soak.md`` (the markdown summary, also printed) in ``--out-dir``.

The client keeps no per-request records across windows (each window's latencies are
reduced to float32 arrays), so the driver's own memory stays flat and is judged like
every other process's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from bench.serve import HttpClient, RunPlan, open_client, run_load, warm_up
from bench.soak_report import build_report, markdown, write_plot
from bench.soak_samples import Sampler, Tally
from bench.soak_verdict import MB, CancelPoint, TrendRule, choose_cancel
from cluster.flags import add_service_flags
from load import workloads
from load.results import RequestResult, percentile
from load.workloads import BenchRequest

# -- the load ------------------------------------------------------------------------


async def send_cancelled(client: HttpClient, request: BenchRequest, point: CancelPoint,
                         result: RequestResult) -> str:
    """Send ``request`` and walk away at ``point``; the outcome ("cancelled", or how it
    ended before the point came)."""
    if point.after_s is not None:
        try:
            await asyncio.wait_for(client.send(request, result), point.after_s)
        except asyncio.TimeoutError:
            return "cancelled"
        return "cancel_missed" if result.ok else outcome_of(result)
    # After N chunks: read the SSE stream ourselves and close it early, which closes the
    # connection (an unread body is never returned to the pool) and aborts the request.
    chunks = 0
    async with client.http.stream("POST", client.url, json=client.body(request), headers=client.headers) as r:
        if r.status_code != 200:
            result.fail(f"http_{r.status_code}", (await r.aread()).decode(errors="replace"))
            return outcome_of(result)
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return "cancel_missed"
            if json.loads(data).get("choices"):
                chunks += 1
                if chunks >= point.after_chunks:
                    return "cancelled"
    result.fail("incomplete_stream", "the stream ended without [DONE]")
    return outcome_of(result)


def outcome_of(result: RequestResult) -> str:
    if result.ok:
        return "completed"
    return "rejected" if result.error in ("http_429", "resource_exhausted") else "errored"


@dataclass(frozen=True)
class LoadPlan:
    """A soak run's open-loop load: request rate and duration, the requests' lengths, the share
    cancelled part way, and the seed that fixes arrivals, prompts and cancel points."""

    rate: float
    duration_s: float
    input_len: int
    output_len: int
    range_ratio: float
    cancel_fraction: float
    cancel_max_delay_s: float
    seed: int


def arrivals(plan: LoadPlan) -> list[float]:
    """Poisson send times in [0, duration): drawn with a margin, then cut."""
    mean = plan.rate * plan.duration_s
    n = int(mean + 10 * math.sqrt(mean) + 10)
    times = workloads.arrival_times(n, plan.rate, 1.0, random.Random(f"soak-arrivals:{plan.seed}"))
    return [t for t in times if t < plan.duration_s]


def requests(plan: LoadPlan, vocab: Sequence[int]) -> Iterator[tuple[BenchRequest, CancelPoint | None]]:
    """Synthetic requests, each with its cancel point; drawn one at a time so that no
    list of prompts sits in the driver for the whole run."""
    prompts = random.Random(f"soak-prompts:{plan.seed}")
    cancels = random.Random(f"soak-cancel:{plan.seed}")
    while True:
        (request,) = workloads.synthetic(1, plan.input_len, plan.output_len, plan.range_ratio, vocab, prompts)
        yield request, choose_cancel(cancels, plan.cancel_fraction, request.output_len, plan.cancel_max_delay_s)


class Soak:
    """Runs the open-loop load and the sampler together.

    Lifecycle: ``run()`` -> baseline sample -> load (sends until ``duration_s``, samples
    every ``sample_s``) -> drain (waits for the requests in flight; still open after
    ``drain_timeout_s``: hung, cancelled) -> settle (blocks in use back to 0 within
    ``settle_s``) -> final sample.
    """

    def __init__(self, client: HttpClient, sampler: Sampler, plan: LoadPlan, vocab: Sequence[int],
                 sample_s: float, drain_timeout_s: float, settle_s: float) -> None:
        self.client, self.sampler, self.plan, self.vocab = client, sampler, plan, vocab
        self.sample_s, self.drain_timeout_s, self.settle_s = sample_s, drain_timeout_s, settle_s
        self.tally = Tally()
        self.tasks: set[asyncio.Task] = set()
        self.samples: list[dict] = []
        self.phase = "baseline"
        self.t0 = 0.0
        self.times: dict[str, float] = {}
        self.final_blocks: dict[str, int] | None = None
        self._sampling = asyncio.Lock()  # the periodic and the phase-end samples never interleave

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def one(self, request: BenchRequest, point: CancelPoint | None) -> None:
        result = RequestResult(self.tally.sent, request.group, len(request.prompt_token_ids), request.output_len)
        try:
            if point is None:
                await self.client.send(request, result)
                outcome = outcome_of(result)
            else:
                outcome = await send_cancelled(self.client, request, point, result)
        except asyncio.CancelledError:
            self.tally.record("hung")
            raise
        except Exception as e:  # one broken request must not stop the soak
            result.fail("client_error", f"{type(e).__name__}: {e}")
            outcome = "errored"
        self.tally.record(outcome, result)

    async def take_sample(self) -> None:
        async with self._sampling:
            await self._take_sample()

    async def _take_sample(self) -> None:
        t = self.now()
        window = self.tally.close_window(t)
        in_flight = len(self.tasks)
        state = await asyncio.to_thread(self.sampler.sample)
        self.samples.append({"t": round(t, 3), "phase": self.phase, "in_flight": in_flight,
                             "sent": self.tally.sent, **state, "window": window,
                             "sample_cost_s": round(self.now() - t, 3)})
        mb = sum(p["rss"] for p in state["rss"].values()) / MB
        print(f"[{t:7.1f} s] {self.phase:8} sent {self.tally.sent:6d}  in flight {in_flight:4d}  "
              f"blocks {state['blocks']}  RSS total {mb:8.1f} MB  "
              f"done {window['completed']} cancelled {window['cancelled']} "
              f"errored {window['errored']} rejected {window['rejected']}", flush=True)

    async def sample_loop(self) -> None:
        k = 1
        while True:
            tick = k * self.sample_s
            k = max(k + 1, math.floor(self.now() / self.sample_s) + 1)  # a slow sample skips ticks
            if abs(tick - self.plan.duration_s) < self.sample_s / 2:
                continue  # run() samples the load's end itself
            await asyncio.sleep(max(0.0, tick - self.now()))
            await self.take_sample()

    async def send_loop(self) -> None:
        gen = requests(self.plan, self.vocab)
        for at in arrivals(self.plan):
            await asyncio.sleep(max(0.0, at - self.now()))
            request, point = next(gen)
            self.tally.sent += 1
            task = asyncio.create_task(self.one(request, point))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        await asyncio.sleep(max(0.0, self.plan.duration_s - self.now()))

    async def run(self) -> None:
        self.t0 = time.perf_counter()
        await self.take_sample()  # baseline, t = 0
        self.t0 = time.perf_counter()  # the load's clock starts once the baseline is read
        self.phase = "load"
        sampler = asyncio.create_task(self.sample_loop())
        try:
            await self.send_loop()
            self.times["load_end"] = self.now()
            await self.take_sample()  # the load's last point, exactly at its end
            self.phase = "drain"
            pending = set(self.tasks)
            if pending:
                _, pending = await asyncio.wait(pending, timeout=self.drain_timeout_s)
            self.times["drained"] = self.now()
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            self.phase = "settle"
            self.final_blocks = await self.settle()
            self.times["settled"] = self.now()
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        self.phase = "final"
        await self.take_sample()

    async def settle(self) -> dict[str, int] | None:
        """Blocks in use once every worker reads 0, or as they stand at ``settle_s``."""
        deadline = self.now() + self.settle_s
        while True:
            blocks = await asyncio.to_thread(self.sampler.blocks)
            if (blocks is not None and not any(blocks.values())) or self.now() >= deadline:
                return blocks
            await asyncio.sleep(1.0)


# -- capacity -------------------------------------------------------------------------


async def measure_capacity(client: HttpClient, vocab: Sequence[int], n: int, input_len: int, output_len: int,
                           range_ratio: float, seed: int) -> dict:
    """``n`` synthetic requests sent at once: completed requests/s, and their TTFT."""
    rng = random.Random(f"soak-capacity:{seed}")
    batch = workloads.synthetic(n, input_len, output_len, range_ratio, vocab, rng)
    results, duration = await run_load(client, RunPlan(math.inf, batch, [0.0] * n), None, False)
    done = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    return {
        "requests": n,
        "completed": len(done),
        "errors": dict(Counter(r.error for r in results if not r.ok)),
        "duration_s": duration,
        "requests_per_s": len(done) / duration,
        "ttft_p50_s": percentile(ttft, 50) if ttft else None,
    }


# -- the service ----------------------------------------------------------------------


@contextlib.contextmanager
def launched(args: argparse.Namespace) -> Iterator[tuple[object, str]]:
    """Ray and the whole service in this process, metrics as ``tandem up`` sets them up
    (``cluster.local``); yields (service, metrics folder)."""
    from cluster.local import local_ray
    from cluster.service import ServiceConfig, TandemService

    config = ServiceConfig.from_flags(args, free=True)
    with local_ray(args.num_cpus, metrics_kind="soak", log_to_driver=args.worker_logs) as metrics_dir:
        service = TandemService(config).start()
        try:
            yield service, metrics_dir
        finally:
            service.shutdown()


def ray_logs() -> str:
    try:
        import ray

        return ray._private.worker._global_node.get_logs_dir_path()
    except Exception:  # private API moved
        return "/tmp/ray/session_*/logs"


async def soak(args: argparse.Namespace, service, metrics_dir: str, vocab: Sequence[int]) -> dict:
    client_args = argparse.Namespace(backend="http", api_key=None, timeout=args.request_timeout_s,
                                     max_concurrency=None, served_model_name=None)
    async with open_client(client_args, service.http_url, service.grpc_target) as client:
        await warm_up(client, vocab, args.seed, service.http_url)
        capacity = None
        rate = args.rate
        if rate is None:
            t = time.perf_counter()
            capacity = await measure_capacity(client, vocab, args.capacity_requests, args.input_len,
                                              args.output_len, args.range_ratio, args.seed)
            capacity["wall_s"] = time.perf_counter() - t
            if not capacity["completed"]:
                raise RuntimeError(f"no request of the capacity burst completed: {capacity['errors']}")
            rate = capacity["requests_per_s"] * args.capacity_fraction
            print(f"capacity: {capacity['completed']}/{capacity['requests']} requests in "
                  f"{capacity['duration_s']:.1f} s = {capacity['requests_per_s']:.2f} req/s; "
                  f"soaking at {args.capacity_fraction:g} x = {rate:.2f} req/s", flush=True)
        max_delay = args.cancel_max_delay_s
        if max_delay is None:
            ttft = capacity and capacity["ttft_p50_s"]
            max_delay = min(max(ttft or 0.5, 0.05), 5.0)
        plan = LoadPlan(rate, args.duration_s, args.input_len, args.output_len, args.range_ratio,
                        args.cancel_fraction, max_delay, args.seed)
        sampler = Sampler(service.controller, service.config.cluster.name, metrics_dir)
        run = Soak(client, sampler, plan, vocab, args.sample_s, args.drain_timeout_s, args.settle_s)
        await run.run()
    return {"capacity": capacity, "plan": asdict(plan), "run": run}


# -- command line -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    load = ap.add_argument_group("load")
    load.add_argument("--duration-s", type=float, default=600.0, help="length of the load (default 600)")
    rate = load.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, default=None, help="requests/s; skips the capacity measurement")
    rate.add_argument("--capacity-fraction", type=float, default=0.8, help="of the measured capacity (0.8)")
    load.add_argument("--capacity-requests", type=int, default=32, help="sent at once to measure capacity")
    load.add_argument("--cancel-fraction", type=float, default=0.1, help="requests cancelled part way (0.1)")
    load.add_argument("--cancel-max-delay-s", type=float, default=None,
                      help="delay-based cancels fall in [0, this) (default: the capacity burst's TTFT p50)")
    load.add_argument("--input-len", type=int, default=128)
    load.add_argument("--output-len", type=int, default=64)
    load.add_argument("--range-ratio", type=float, default=0.25, help="lengths uniform in LEN * (1 ± RATIO)")
    load.add_argument("--request-timeout-s", type=float, default=300.0, help="client read timeout")
    load.add_argument("--seed", type=int, default=0)

    watch = ap.add_argument_group("watching and judging")
    watch.add_argument("--sample-s", type=float, default=5.0, help="sampling period (5)")
    watch.add_argument("--drain-timeout-s", type=float, default=120.0,
                       help="after the load, requests still open after this hung (120)")
    watch.add_argument("--settle-s", type=float, default=60.0, help="wait this long for blocks in use to reach 0")
    watch.add_argument("--rss-growth-mb", type=float, default=TrendRule.rss_growth_mb)
    watch.add_argument("--rss-growth-pct", type=float, default=TrendRule.rss_growth_pct)
    watch.add_argument("--blocks-growth-pct", type=float, default=TrendRule.blocks_growth_pct,
                       help="of the worker's KV pool, projected over the load")
    watch.add_argument("--out-dir", default="docs/soak", help="soak.json, soak.png, soak.md (docs/soak)")

    svc = ap.add_argument_group("service")
    add_service_flags(svc, config_file=False, admission=False, prefill_workers=1, decode_workers=1,
                      kv_transfer_backend="collective", num_cpus=2)  # fmt: skip
    svc.add_argument("--worker-logs", action="store_true",
                     help="stream the Ray processes' logs here (default: only in the logs folder printed at startup)")
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    checks = [
        (args.duration_s > 0, "--duration-s must be > 0"),
        (args.rate is None or args.rate > 0, "--rate must be > 0"),
        (0 < args.capacity_fraction, "--capacity-fraction must be > 0"),
        (args.capacity_requests >= 1, "--capacity-requests must be >= 1"),
        (0 <= args.cancel_fraction <= 1, "--cancel-fraction must be in [0, 1]"),
        (args.cancel_max_delay_s is None or args.cancel_max_delay_s > 0, "--cancel-max-delay-s must be > 0"),
        (args.input_len >= 1 and args.output_len >= 2, "--input-len must be >= 1 and --output-len >= 2"),
        (0 <= args.range_ratio < 1, "--range-ratio must be in [0, 1)"),
        (args.sample_s > 0, "--sample-s must be > 0"),
        (args.duration_s >= 3 * args.sample_s, "--duration-s must be at least 3 samples (--sample-s) long"),
        (args.prefill_workers >= 1 and args.decode_workers >= 1, "--prefill-workers and --decode-workers >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            ap.error(message)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    rule = TrendRule(rss_growth_mb=args.rss_growth_mb, rss_growth_pct=args.rss_growth_pct,
                     blocks_growth_pct=args.blocks_growth_pct)
    from engine.model.default_model import ensure_default_model
    from engine.model.model_config import ModelConfig
    from engine.tokenizer import Tokenizer

    model_dir = args.model or str(ensure_default_model())
    vocab = workloads.sampleable_ids(Tokenizer.from_pretrained(model_dir))
    context = ModelConfig.from_pretrained(model_dir).max_model_len
    workloads.check_fits([BenchRequest([0] * math.ceil(args.input_len * (1 + args.range_ratio)),
                                       math.ceil(args.output_len * (1 + args.range_ratio)))], context)
    timings = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    try:
        with launched(args) as (service, metrics_dir):
            timings["startup"] = time.perf_counter() - t_start
            print(f"service up in {timings['startup']:.0f} s at {service.http_url}; Ray logs in {ray_logs()}",
                  flush=True)
            t = time.perf_counter()
            outcome = asyncio.run(soak(args, service, metrics_dir, vocab))
            run = outcome["run"]
            timings["capacity"] = time.perf_counter() - t - run.now()
            t_down = time.perf_counter()
        timings["shutdown"] = time.perf_counter() - t_down
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    timings["total"] = time.perf_counter() - t_start
    report = build_report(args, outcome, timings, rule)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    write_plot(report, out / "soak.png")
    summary = markdown(report)
    (out / "soak.md").write_text(summary + "\n")
    print()
    print(summary)
    print(f"\nwrote {out / 'soak.json'}, {out / 'soak.png'}, {out / 'soak.md'}")
    return 0 if report["verdict"]["result"] == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
