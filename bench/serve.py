"""Serving benchmark: an asynchronous load client for a running Tandem (or any
OpenAI-compatible completions server), in the manner of vLLM's benchmark_serving.

Requests from a workload (``load/workloads.py``) are sent on an arrival schedule
(Poisson or gamma at ``--request-rate``, or all at once), optionally capped at
``--max-concurrency`` in flight, over streaming HTTP (``/v1/completions`` with SSE) or
gRPC (``tandem.v1.Generation/Generate``). Every request is greedy with ``ignore_eos``
and a fixed ``max_tokens``, so configurations are compared on the same work.

Per request, from the client's side:

* TTFT: from sending to the first chunk that carries tokens;
* ITL: the gaps between consecutive token-carrying chunks. A chunk (an SSE event, a
  gRPC message) holds every token produced since the previous one, so it can carry
  several; like vLLM, a chunk of k tokens counts as one gap, not k;
* TPOT: ``(E2E - TTFT) / (output_tokens - 1)``, the mean time per token after the
  first, whatever the chunking (undefined for a one-token output, which then meets
  any TPOT SLO);
* E2E: from sending to the end of the stream.

Token counts come from the usage the server reports at the end of the stream.
Rejections (HTTP 429, gRPC RESOURCE_EXHAUSTED) and other failures are counted by kind
and never retried: a benchmark reports them rather than hiding them. Goodput is the
rate of completed requests meeting every ``--goodput`` SLO.

A comma-separated ``--request-rate`` runs a sweep, one run per rate in turn; each run
draws fresh prompts (seed + run index), so no run hits a prefix cache the previous one
warmed. ``--launch`` starts the service in-process on free ports for the duration of
the run, with the same topology flags as ``tandem up``.

    tandem bench serve --launch --workload shared-prefix --request-rate 1,2,4 \\
        --result-json bench-results/serve.json --plot-dir bench-results/serve
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import platform
import random
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

# The clients that send the requests and time their streams are in bench/serve_clients.py
# (HttpClient and GrpcClient are imported from here too).
from bench.serve_clients import Client, GrpcClient, HttpClient, open_client
from cluster.flags import LOCAL_GRPC, LOCAL_URL, add_service_flags
from load import workloads
from load.results import RequestResult, Slo, format_summary, parse_slo, summarize
from load.workloads import BenchRequest

__all__ = [
    "GrpcClient", "HttpClient", "RunPlan", "build_parser", "launched_service", "main", "open_client", "parse_args",
    "run_load", "service_config", "warm_up",
]

WORKLOADS = ("synthetic", "sharegpt", "shared-prefix", "long-mix")
LAUNCH_FLAGS = (
    "config", "prefill_workers", "decode_workers", "num_kv_blocks", "kv_transfer_backend", "engine",
    "stream_interval_s",
    "token_channel",
    "max_outstanding_requests", "max_outstanding_prompt_tokens", "placement", "num_cpus",
)
WARMUP_PROMPT_TOKENS = 16
READY_TIMEOUT_S = 60.0
# Failures that mean "not up yet" while waiting for a server to answer its first request.
NOT_READY = {"connection", "unavailable", "http_503"}


# -- running the load -----------------------------------------------------------


@dataclass(frozen=True)
class RunPlan:
    """One run of the load at one request rate: the requests and when each is sent, in seconds from
    the run's start (``run_load``)."""

    rate: float
    requests: list[BenchRequest]
    times: list[float]  # send time of each request, from the start of the run


async def run_load(
    client: Client, plan: RunPlan, max_concurrency: int | None, progress: bool
) -> tuple[list[RequestResult], float]:
    """Send every request at its scheduled time (waiting for a slot when
    ``max_concurrency`` are in flight); returns the results and the run's duration."""
    from tqdm import tqdm

    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(plan.requests), disable=not progress, desc=f"rate {rate_label(plan.rate)}", leave=False)
    t0 = time.perf_counter()

    async def one(i: int, request: BenchRequest) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + plan.times[i] - time.perf_counter()))
        async with slots or contextlib.nullcontext():
            result = RequestResult(
                i, request.group, len(request.prompt_token_ids), request.output_len, time.perf_counter() - t0
            )
            try:
                await client.send(request, result)
            except Exception as e:  # one broken request must not lose the run's other results
                result.fail("client_error", f"{type(e).__name__}: {e}")
        bar.update(1)
        return result

    try:
        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(plan.requests)))
    finally:
        bar.close()
    return list(results), time.perf_counter() - t0


async def warm_up(client: Client, vocab: Sequence[int], seed: int, target: str,
                  ready_timeout_s: float = READY_TIMEOUT_S, retry_s: float = 1.0) -> None:
    """One short request before measuring: it waits out a server that is still coming
    up, and a wrong address or key fails here with a clear message instead of as N
    failed requests."""
    prompt = workloads.random_tokens(WARMUP_PROMPT_TOKENS, vocab, random.Random(f"warmup:{seed}"))
    deadline = time.monotonic() + ready_timeout_s
    for attempt in itertools.count():
        result = RequestResult(-1, "warmup", len(prompt), 2)
        await client.send(BenchRequest(prompt, 2), result)
        if result.ok:
            return
        if result.error not in NOT_READY or time.monotonic() > deadline:
            raise RuntimeError(f"the warm-up request to {target} failed ({result.error}): {result.message}")
        if attempt == 0:
            print(f"waiting up to {ready_timeout_s:g} s for {target} to answer", file=sys.stderr, flush=True)
        await asyncio.sleep(retry_s)


async def run_benchmark(args: argparse.Namespace, plans: Sequence[RunPlan], vocab: Sequence[int],
                        base_url: str, grpc_target: str) -> list[dict]:
    """Every planned run in turn over one client; one record per run."""
    runs = []
    async with open_client(args, base_url, grpc_target) as client:
        await warm_up(client, vocab, args.seed, grpc_target if args.backend == "grpc" else base_url)
        for plan in plans:
            started = time.monotonic()  # the host's clock, which a local service's step records share
            results, duration = await run_load(client, plan, args.max_concurrency, not args.no_progress)
            summary = summarize(results, duration, args.goodput)
            print(format_summary(summary, rate_label(plan.rate)), flush=True)
            runs.append({
                "request_rate": rate_label(plan.rate),
                "started_monotonic_s": started,
                "summary": summary,
                "requests": [r.to_json() for r in results],
            })
    return runs


# -- workloads and schedules ----------------------------------------------------


def build_workload(args: argparse.Namespace, tokenizer, vocab: Sequence[int], context_len: int,
                   rng: random.Random) -> list[BenchRequest]:
    n = args.num_requests
    if args.workload == "sharegpt":
        return workloads.sharegpt(args.dataset_path, n, tokenizer, context_len, rng)
    if args.workload == "shared-prefix":
        requests = workloads.shared_prefix(
            n, args.num_prefix_groups, args.prefix_len, args.suffix_len, args.output_len, args.range_ratio,
            vocab, rng,
        )
    elif args.workload == "long-mix":
        requests = workloads.long_mix(
            n, args.input_len, args.output_len, args.range_ratio, args.long_fraction, args.long_len, vocab, rng
        )
    else:
        requests = workloads.synthetic(n, args.input_len, args.output_len, args.range_ratio, vocab, rng)
    workloads.check_fits(requests, context_len)
    return requests


def plan_runs(args: argparse.Namespace, tokenizer, vocab: Sequence[int], context_len: int) -> list[RunPlan]:
    """One plan per request rate; run i draws its prompts and gaps from seed + i."""
    plans = []
    for i, rate in enumerate(args.request_rate):
        requests = build_workload(args, tokenizer, vocab, context_len, random.Random(args.seed + i))
        gaps_rng = random.Random(f"arrivals:{args.seed + i}")
        plans.append(RunPlan(rate, requests, workloads.arrival_times(len(requests), rate, args.burstiness, gaps_rng)))
    return plans


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


# -- launching a service ---------------------------------------------------------


def service_config(args: argparse.Namespace):
    """The ``ServiceConfig`` that ``tandem up`` would build from the same flags, on free ports."""
    from cluster.service import ServiceConfig

    return ServiceConfig.from_flags(args, free=True)


@contextlib.contextmanager
def launched_service(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """Start Tandem in-process, as ``tandem up`` would from the same flags
    (``cluster.local``); yields (HTTP base URL, gRPC target) and shuts everything down after."""
    from cluster.local import local_service

    with local_service(service_config(args), args.num_cpus, metrics_kind="bench-serve") as service:
        yield service.http_url, service.grpc_target


# -- output ------------------------------------------------------------------------


def write_plots(runs: Sequence[dict], plot_dir: Path, slo: Slo) -> list[Path]:
    from bench import plots

    def samples(run: dict) -> dict[str, list[float]]:
        done = [r for r in run["requests"] if r["ok"]]
        return {
            "TTFT": [r["ttft_s"] * 1000 for r in done if r["ttft_s"] is not None],
            "ITL": [gap * 1000 for r in done for gap in r["itl_s"]],
            "E2E": [r["e2e_s"] * 1000 for r in done if r["e2e_s"] is not None],
        }

    written = [plots.latency_cdfs({run["request_rate"]: samples(run) for run in runs}, plot_dir / "latency_cdf.png")]
    if len(runs) > 1:
        summaries = [run["summary"] for run in runs]
        written.append(plots.sweep(
            [run["request_rate"] for run in runs],
            [s["ttft_ms"]["p99"] for s in summaries],
            [s["itl_ms"]["p99"] for s in summaries],
            [s["goodput"] if slo else s["request_throughput"] for s in summaries],
            "goodput (req/s)" if slo else "completed requests/s (no --goodput SLO)",
            plot_dir / "sweep.png",
        ))
    return written


def config_record(args: argparse.Namespace) -> dict:
    """The run's settings as JSON: every flag but the API key, rates as labels ("inf"
    is not JSON)."""
    record = {k: v for k, v in vars(args).items() if k != "api_key"}
    record["request_rate"] = [rate_label(r) for r in args.request_rate]
    record["goodput"] = asdict(args.goodput)
    record["engine"] = dict(args.engine)
    return record


# -- command line -------------------------------------------------------------------


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or comma-separated numbers: {text!r}") from None
    if any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"request rates must be > 0 (or inf), got {text!r}")
    return rates


def _slo_item(text: str) -> tuple[str, str]:
    """One ``--goodput`` item (``load.results.parse_slo``'s form), checked alone: (its key, it)."""
    try:
        parse_slo(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    key = text.partition(":")[0]
    return ("tpot" if key == "itl" else key), text


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tandem bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    target = ap.add_argument_group("target")
    target.add_argument("--backend", choices=["http", "grpc"], default="http")
    target.add_argument("--base-url", default=None, help=f"HTTP server (default: {LOCAL_URL})")
    target.add_argument("--grpc-target", default=None, help=f"gRPC server (default: {LOCAL_GRPC})")
    target.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"), help="default: $TANDEM_API_KEY")
    target.add_argument("--served-model-name", default=None,
                        help="the HTTP 'model' field, for servers that require it (Tandem does not)")
    target.add_argument("--model", default=None,
                        help="HF checkpoint dir: its tokenizer makes the prompts, and --launch serves it "
                             "(default: the built-in model)")
    target.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")

    load = ap.add_argument_group("load")
    load.add_argument("--num-requests", type=_positive_int, default=100, help="per request rate")
    load.add_argument("--request-rate", type=_rates, default=[math.inf],
                      help="requests/s, or inf to send all at once; 1,2,4,8 runs a sweep (default: inf)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the gaps: 1 is Poisson, < 1 burstier, > 1 more regular")
    load.add_argument("--max-concurrency", type=_positive_int, default=None, help="cap on requests in flight")
    load.add_argument("--seed", type=int, default=0)

    wl = ap.add_argument_group("workload")
    wl.add_argument("--workload", choices=WORKLOADS, default="synthetic")
    wl.add_argument("--input-len", type=_positive_int, default=256, help="synthetic, long-mix: prompt tokens")
    wl.add_argument("--output-len", type=_positive_int, default=64, help="output tokens (not sharegpt)")
    wl.add_argument("--range-ratio", type=float, default=0.0,
                    help="lengths are uniform in LEN * (1 ± RATIO), RATIO in [0, 1)")
    wl.add_argument("--dataset-path", default=None, help="sharegpt: the ShareGPT-format JSON file")
    wl.add_argument("--num-prefix-groups", type=_positive_int, default=4, help="shared-prefix: distinct prefixes")
    wl.add_argument("--prefix-len", type=_positive_int, default=512, help="shared-prefix: tokens per prefix")
    wl.add_argument("--suffix-len", type=_positive_int, default=64, help="shared-prefix: unique tokens per request")
    wl.add_argument("--long-fraction", type=float, default=0.1, help="long-mix: share of long prompts")
    wl.add_argument("--long-len", type=_positive_int, default=1536, help="long-mix: tokens per long prompt")

    out = ap.add_argument_group("output")
    out.add_argument("--goodput", type=_slo_item, nargs="+", action="extend", default=[], metavar="KEY:MS",
                     help="SLOs for goodput, e.g. ttft:500 tpot:50 e2e:10000 gap:15@0.99 (a request's gaps between "
                          "tokens: that share of them, or with no @SHARE every one, at most MS)")
    out.add_argument("--result-json", default=None, help="write config, summaries and per-request records")
    out.add_argument("--plot-dir", default=None, help="write latency CDFs (and a sweep plot) as PNG")
    out.add_argument("--label", default=None, help="a name for this run in the JSON, for comparisons")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")

    launch = ap.add_argument_group("launch (start the service for the run; flags as in tandem up)")
    launch.add_argument("--launch", action="store_true", help="start Tandem in-process on free ports")
    add_service_flags(launch, model=False)
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the flags together; every mistake exits with a usage error
    before anything is started or sent."""
    ap = build_parser()
    args = ap.parse_args(argv)
    problem = _check(args)
    if problem:
        ap.error(problem)
    _fill_defaults(args)
    return args


def _check(args: argparse.Namespace) -> str | None:
    if not 0.0 <= args.range_ratio < 1.0:
        return f"--range-ratio must be in [0, 1), got {args.range_ratio}"
    if not args.burstiness > 0:
        return f"--burstiness must be > 0, got {args.burstiness}"
    if not 0.0 <= args.long_fraction <= 1.0:
        return f"--long-fraction must be in [0, 1], got {args.long_fraction}"
    if args.workload == "sharegpt" and not args.dataset_path:
        return "--workload sharegpt needs --dataset-path"
    if args.dataset_path and args.workload != "sharegpt":
        return "--dataset-path is for --workload sharegpt"
    if args.dataset_path and not Path(args.dataset_path).is_file():
        return f"--dataset-path {args.dataset_path}: no such file"
    keys = [key for key, _ in args.goodput]
    if len(set(keys)) != len(keys):
        return f"--goodput names an SLO twice: {' '.join(keys)}"
    if not args.launch:
        given = [f"--{name.replace('_', '-')}" for name in LAUNCH_FLAGS if getattr(args, name) not in (None, [])]
        if given:
            return f"--launch is needed for {', '.join(given)} (they configure the service it starts)"
    elif args.base_url or args.grpc_target:
        return "--launch serves on free ports of its own: drop --base-url / --grpc-target"
    return None


def _fill_defaults(args: argparse.Namespace) -> None:
    """Defaults left unset at parse time, so that ``_check`` tells flags given from
    defaults; the admission bounds are ``tandem up``'s."""
    from router.admission import AdmissionConfig

    admission = AdmissionConfig()
    args.goodput = parse_slo(",".join(item for _, item in args.goodput))
    args.base_url = args.base_url or LOCAL_URL
    args.grpc_target = args.grpc_target or LOCAL_GRPC
    if args.max_outstanding_requests is None:
        args.max_outstanding_requests = admission.max_requests
    if args.max_outstanding_prompt_tokens is None:
        args.max_outstanding_prompt_tokens = admission.max_prompt_tokens
    args.placement = args.placement or "load"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.model.default_model import ensure_default_model
    from engine.model.model_config import ModelConfig
    from engine.tokenizer import Tokenizer

    model_dir = args.model or str(ensure_default_model())
    tokenizer = Tokenizer.from_pretrained(model_dir)
    context_len = ModelConfig.from_pretrained(model_dir).max_model_len
    vocab = workloads.sampleable_ids(tokenizer)
    plans = plan_runs(args, tokenizer, vocab, context_len)
    endpoints = launched_service(args) if args.launch else contextlib.nullcontext((args.base_url, args.grpc_target))
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        with endpoints as (base_url, grpc_target):
            runs = asyncio.run(run_benchmark(args, plans, vocab, base_url, grpc_target))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    report = {
        "label": args.label,
        "started": started,
        "target": grpc_target if args.backend == "grpc" else base_url,
        "model": model_dir,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "config": config_record(args),
        "runs": runs,
    }
    if args.result_json:
        path = Path(args.result_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
        print(f"wrote {path}")
    if args.plot_dir:
        for path in write_plots(runs, Path(args.plot_dir), args.goodput):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
