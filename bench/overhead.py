"""Where the CPU of a streamed token goes: every process of the service, per output token.

One fixed streaming load (by default 96 ``/v1/completions`` requests of 64 random prompt
tokens and 128 output tokens with ``ignore_eos``, 32 in flight, 1 prefill + 1 decode
worker) runs against the service this program starts (``--ingress``, topology flags) or
a running one (``--url``). Around the load, every process's user+system CPU time is read
(psutil ``cpu_times``); each delta divided by the output tokens the client received is
that process's CPU milliseconds per token, summed by kind:

* ``router``: the Serve replica(s) of the Router deployment;
* ``ingress``: HAProxy's processes and Serve's ``HAProxyManager`` actor, or Serve's
  Python proxy actor (with HAProxy, a Python proxy still idles as its backup);
* ``decode`` / ``prefill``: the worker actors (a colocated worker counts as decode),
  with the engine's own model-runner time per token beside them;
* ``client``: the load client, one thread of this process (its thread CPU time);
* ``driver``: the rest of this process (Ray's core worker threads when it started Ray);
* ``control``: Serve's controller and Tandem's cluster controller;
* ``ray``: Ray's own processes (raylet, gcs_server, agents, idle workers).

Before starting the service, the same requests run through the offline engine
(``engine.LLM``, as many in flight, in this process) for the engine's ceiling in output
tokens/s. Processes are found as this process's descendants when it started Ray, and
among every process of the machine by command line with ``--url`` (so run that where
no other Ray runs).

    python -m bench.overhead --ingress haproxy [--prefill-workers 0] [--out bench-results/overhead.json]
    tandem bench overhead --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

# Which process is what and the CPU arithmetic are in bench/overhead_procs.py (the names
# tests use are imported from here too).
from bench.overhead_procs import (
    KindRow,
    Proc,
    by_kind,
    classify,
    cpu_deltas,
    discover,
    format_table,
    per_token_ms,
    snapshot,
)
from cluster.flags import add_service_flags
from load import workloads
from load.workloads import BenchRequest

__all__ = [
    "KindRow", "Proc", "build_parser", "by_kind", "classify", "cpu_deltas", "format_table", "main", "per_token_ms",
]

WARMUP_REQUESTS = 8


# -- the load --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadResult:
    """The measured load as the client saw it: tokens received, requests completed and failed
    (errors counted by kind), wall time and the client thread's CPU seconds."""

    tokens: int
    completed: int
    failed: int
    errors: dict[str, int]
    wall_s: float
    client_cpu_s: float


def build_requests(args: argparse.Namespace, vocab: Sequence[int]) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    return workloads.synthetic(args.num_requests, args.input_len, args.output_len, 0.0, vocab, rng)


async def _load(url: str, api_key: str | None, requests: Sequence[BenchRequest], concurrency: int,
                vocab: Sequence[int], begin) -> list:
    """Warm up (one short request, then a few of the real shape), call ``begin()``, then
    run every request with ``concurrency`` in flight; returns their results."""
    import httpx

    from bench.serve import HttpClient, RunPlan, run_load, warm_up

    def plan(reqs: Sequence[BenchRequest]) -> RunPlan:
        return RunPlan(float("inf"), list(reqs), [0.0] * len(reqs))

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as http:
        client = HttpClient(http, url, api_key, None)
        await warm_up(client, vocab, 0, url)
        await run_load(client, plan(requests[:WARMUP_REQUESTS]), concurrency, False)
        begin()
        results, _ = await run_load(client, plan(requests), concurrency, False)
        return results


def run_client(url: str, api_key: str | None, requests: Sequence[BenchRequest], concurrency: int,
               vocab: Sequence[int], on_start, on_end) -> LoadResult:
    """Run the load in a thread of its own and time that thread's CPU over the measured
    part; ``on_start`` / ``on_end`` (the other processes' snapshots) run just outside it."""
    box: dict = {}

    def begin() -> None:
        on_start()
        box["cpu0"], box["t0"] = time.thread_time(), time.perf_counter()

    def target() -> None:
        try:
            results = asyncio.run(_load(url, api_key, requests, concurrency, vocab, begin))
            box["cpu"], box["wall"] = time.thread_time() - box["cpu0"], time.perf_counter() - box["t0"]
            on_end()
            box["results"] = results
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name="overhead-client")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    results = box["results"]
    done = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    return LoadResult(sum(r.output_tokens for r in done), len(done), len(results) - len(done), errors,
                      box["wall"], box["cpu"])


# -- the offline engine's ceiling ----------------------------------------------------------


def run_offline(engine_config, requests: Sequence[BenchRequest], concurrency: int, torch_threads: int) -> dict:
    """The same requests through ``engine.LLM`` in this process, ``concurrency`` at a time
    (``max_num_seqs``) on as many torch threads as a worker: the engine's ceiling."""
    import dataclasses
    import gc

    import torch

    from engine import LLM, SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        cfg = dataclasses.replace(engine_config, max_num_seqs=min(engine_config.max_num_seqs, concurrency))
        llm = LLM(**dataclasses.asdict(cfg))
        llm.generate([requests[0].prompt_token_ids], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in requests]
        before = llm.stats()
        wall, cpu = time.perf_counter(), time.thread_time()
        outs = llm.generate([r.prompt_token_ids for r in requests], params)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        after = llm.stats()
        tokens = sum(len(o.token_ids) for o in outs)
        del llm, outs
        gc.collect()
    finally:
        torch.set_num_threads(threads)
    return {
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "cpu_ms_per_token": per_token_ms(cpu, tokens),
        "forward_ms_per_token": per_token_ms(after.forward_s - before.forward_s, tokens),
        "max_num_seqs": cfg.max_num_seqs,
        "torch_threads": torch_threads,
    }


# -- the service -------------------------------------------------------------------------------


def service_config(args: argparse.Namespace):
    from cluster.service import ServiceConfig

    return ServiceConfig.from_flags(args, free=True)


@contextlib.contextmanager
def launched(config, num_cpus: int) -> Iterator[object]:
    """Ray (``num_cpus``, no dashboard) and the service in this process, with metrics on
    as ``tandem up`` has them (every process writes them to one folder)."""
    from cluster.local import local_service

    # log_to_driver off: a line per request from the replica would cost this process CPU
    # (and bury the table); the session's log folder keeps them.
    with local_service(config, num_cpus, metrics_kind="overhead", log_to_driver=False,
                       env={"OMP_NUM_THREADS": "1"}) as service:
        yield service


def kind_of_role(role: str) -> str:
    """A worker role's kind: a colocated worker runs both phases and counts as decode."""
    return "prefill" if role == "prefill" else "decode"


def worker_infos(service) -> list[dict]:
    """Every worker actor's ``ready()`` answer: worker_id, role, pid."""
    import ray

    prefill, decode = ray.get(service.controller.workers.remote())
    return ray.get([w.handle.ready.remote() for w in prefill + decode])


def engine_seconds(service, roles: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per kind, the model-runner time its workers have spent so far (wall, CPU);
    ``roles``: worker_id -> role."""
    import ray

    out: dict[str, dict[str, float]] = {}
    for worker_id, stats in ray.get(service.controller.stats.remote()).items():
        totals = out.setdefault(kind_of_role(roles.get(worker_id, "decode")), {"forward_s": 0.0, "forward_cpu_s": 0.0})
        for key in totals:
            totals[key] += stats.get(key, 0.0)
    return out


def engine_per_token(before: dict, after: dict, tokens: int) -> dict[str, dict[str, float]]:
    """Per role, the model runner's wall and CPU milliseconds per output token."""
    return {
        role: {key.replace("_s", "_ms_per_token"): per_token_ms(after[role][key] - before.get(role, {}).get(key, 0.0),
                                                                 tokens)
               for key in ("forward_s", "forward_cpu_s")}
        for role in after
    }


# -- one measured run -------------------------------------------------------------------------


@dataclass
class Target:
    """What to load and how to see it: the URL, its processes, the engines' timers."""

    url: str
    api_key: str | None
    # pid -> (kind, component), asked at both snapshots: HAProxy's reloads replace its
    # process, and a process that appears during the load counts from zero.
    processes: Callable[[], dict[int, tuple[str, str]]]
    engine_timers: Callable[[], dict] | None = None  # engine_seconds, when the service is ours


def measure(target: Target, requests: Sequence[BenchRequest], concurrency: int, vocab: Sequence[int]) -> dict:
    """Run the load once; CPU per output token of every process and kind, and the engines'."""
    import psutil

    me = psutil.Process()
    snaps: dict[str, object] = {}

    def mark(when: str) -> None:
        t = me.cpu_times()
        snaps[when] = (snapshot(target.processes()), t.user + t.system,
                       target.engine_timers() if target.engine_timers else {})

    load = run_client(target.url, target.api_key, requests, concurrency, vocab,
                      lambda: mark("before"), lambda: mark("after"))
    (procs0, own0, eng0), (procs1, own1, eng1) = snaps["before"], snaps["after"]
    deltas = cpu_deltas(procs0, procs1)
    deltas.append(Proc(me.pid, "client", "load client thread", load.client_cpu_s))
    deltas.append(Proc(me.pid, "driver", "this process, other threads", max(0.0, own1 - own0 - load.client_cpu_s)))
    rows = by_kind(deltas)
    return {
        "load": asdict(load),
        "output_tokens_per_s": load.tokens / load.wall_s,
        "kinds": [{"kind": r.kind, "processes": r.processes, "cpu_s": r.cpu_s,
                   "ms_per_token": r.ms_per_token(load.tokens), "components": r.components} for r in rows],
        "processes": [asdict(p) for p in deltas],
        "engine": engine_per_token(eng0, eng1, load.tokens) if eng1 else {},
        "_rows": rows,
    }


# -- report ------------------------------------------------------------------------------------


def notes(result: dict) -> dict[str, str]:
    """The table's notes column: the engine's own time beside each worker kind."""
    return {kind: f"model runner {e['forward_ms_per_token']:.3f} ms wall, {e['forward_cpu_ms_per_token']:.3f} CPU"
            for kind, e in result["engine"].items()}


def report_text(result: dict, offline: dict | None, label: str) -> str:
    load = result["load"]
    lines = [f"== {label}: {load['tokens']} output tokens from {load['completed']} requests"
             + (f" ({load['failed']} failed: {load['errors']})" if load["failed"] else "")
             + f" in {load['wall_s']:.1f} s",
             format_table(result["_rows"], load["tokens"], notes(result)),
             f"service output tokens/s: {result['output_tokens_per_s']:.0f}"]
    if offline:
        lines[-1] += (f"   offline engine (same requests, {offline['max_num_seqs']} in flight, this process): "
                      f"{offline['output_tokens_per_s']:.0f}, "
                      f"model runner {offline['forward_ms_per_token']:.3f} ms/token")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tandem bench overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running service's HTTP base URL (default: start one)")
    ap.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"), help="with --url; default: $TANDEM_API_KEY")
    add_service_flags(ap, config_file=False, admission=False, prefill_workers=1, decode_workers=1, num_cpus=2)
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-offline", action="store_true", help="skip the offline engine's run")
    ap.add_argument("--out", default="bench-results/overhead.json")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.num_requests, args.input_len, args.output_len, args.concurrency) < 1:
        raise SystemExit("--num-requests, --input-len, --output-len and --concurrency must be >= 1")
    from engine.model.default_model import ensure_default_model
    from engine.tokenizer import Tokenizer

    load_before = os.getloadavg()
    args.model = args.model or str(ensure_default_model())
    vocab = workloads.sampleable_ids(Tokenizer.from_pretrained(args.model))
    requests = build_requests(args, vocab)
    config = None if args.url else service_config(args)
    offline = None
    if not args.no_offline:
        cluster = config.cluster if config else service_config(args).cluster
        offline = run_offline(cluster.engine_config("decode"), requests, args.concurrency, cluster.torch_threads)
    with contextlib.ExitStack() as stack:
        target = _target(args, config, stack)
        result = measure(target, requests, args.concurrency, vocab)
    label = f"ingress {config.ingress}" if config else args.url
    print(report_text(result, offline, label), flush=True)
    print(f"machine load average (1 min) before / after: {load_before[0]:.1f} / {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs", flush=True)
    record = {
        "label": label,
        # The load average says how far a shared machine's numbers can be trusted.
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_avg_before": load_before, "load_avg_after": os.getloadavg()},
        "config": {k: v for k, v in vars(args).items() if k != "api_key"},
        "offline": offline,
        **{k: v for k, v in result.items() if not k.startswith("_")},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")
    return 0


def _target(args: argparse.Namespace, config, stack: contextlib.ExitStack) -> Target:
    """The service to load: a running one (``--url``), or one started for the run."""
    if args.url:
        return Target(args.url, args.api_key, lambda: discover(descendants_only=False, workers={}))
    service = stack.enter_context(launched(config, args.num_cpus))
    infos = worker_infos(service)
    workers = {i["pid"]: (kind_of_role(i["role"]), f"{i['role']} worker {i['worker_id']}") for i in infos}
    roles = {i["worker_id"]: i["role"] for i in infos}
    return Target(service.http_url, None, lambda: discover(descendants_only=True, workers=workers),
                  lambda: engine_seconds(service, roles))


if __name__ == "__main__":
    sys.exit(main())
