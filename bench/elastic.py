"""Elastic pools against fixed ones, on loads that change: a step in the request rate, and
a prompt/output mix that flips halfway.

    python -m bench.elastic [--experiment step|flip|both] [--step-rate R] [--out FILE]

**step**: a low rate, then ``--step-factor`` times the fixed minimal pools' capacity
(measured first: requests a second completed by 1 prefill + 1 decode worker under a
closed-loop burst) for ``--step-s`` seconds, then low again; run on the fixed pools and
on autoscaled ones (``min_workers: 1, max_workers: 2`` per role). Reported per
configuration: goodput during the step (requests a second sent in it that met every SLO),
and for the autoscaled one the time from the step to its first scale-out decision and
to its largest pools. The SLO is fixed before either run from the fixed pools' latency
at the low rate (``--slo-factor`` times its TTFT and TPOT p90), unless ``--slo`` gives it.

**flip**: prefill-heavy requests (long prompts, short outputs), then decode-heavy ones
(short prompts, long outputs), each at its own rate; autoscaled pools with role switching
off, then on. Reported: per 5-second window of send time, the share of requests that met
the SLO, and how long after the flip that share stays at 90% or more again.

Each configuration is one ``bench.serve`` launch of the service on the local Ray, with
the service's ``GET /status`` polled every 0.5 s for the pool sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench import serve
from load import workloads
from load.results import percentile
from load.workloads import BenchRequest

WINDOW_S = 5.0  # the flip experiment's attainment windows
ENGINE = ["--engine", "enable_prefix_caching=false", "--num-kv-blocks", "1024"]  # every prompt computed


@dataclass(frozen=True)
class Phase:
    """``duration_s`` of Poisson arrivals at ``rate`` requests a second, each with a
    ``prompt_len``-token prompt and ``output_len`` output tokens."""

    name: str
    duration_s: float
    rate: float
    prompt_len: int
    output_len: int


def schedule(phases: Sequence[Phase], vocab: Sequence[int], seed: int) -> serve.RunPlan:
    """The requests of every phase and their send times, one after the other; each
    request's ``group`` is its phase's name."""
    rng = random.Random(seed)
    requests, times, start = [], [], 0.0
    for phase in phases:
        t = start + rng.expovariate(phase.rate)
        while t < start + phase.duration_s:
            requests.append(BenchRequest(workloads.random_tokens(phase.prompt_len, vocab, rng), phase.output_len,
                                         group=phase.name))
            times.append(t)
            t += rng.expovariate(phase.rate)
        start += phase.duration_s
    return serve.RunPlan(0.0, requests, times)


def goodput(results: Sequence[serve.RequestResult], slo: serve.Slo, start_s: float, end_s: float) -> float:
    """Requests a second, of those sent in [start_s, end_s), that met the SLO."""
    met = sum(start_s <= r.sent_s < end_s and slo.met_by(r) for r in results)
    return met / (end_s - start_s)


def attainment(results: Sequence[serve.RequestResult], slo: serve.Slo, window_s: float = WINDOW_S) -> list[dict]:
    """Per window of send time: how many requests were sent and what share met the SLO."""
    windows: dict[int, list[bool]] = {}
    for r in results:
        windows.setdefault(int(r.sent_s // window_s), []).append(slo.met_by(r))
    return [{"from_s": i * window_s, "sent": len(met), "met": round(sum(met) / len(met), 2)}
            for i, met in sorted(windows.items())]


def recovery_s(windows: Sequence[dict], flip_s: float, share: float = 0.9) -> float | None:
    """Seconds from ``flip_s`` to the start of the first window after it from which every
    window meets ``share`` (None: the load ended first)."""
    after = [w for w in windows if w["from_s"] >= flip_s]
    for i, w in enumerate(after):
        if all(x["met"] >= share for x in after[i:]):
            return w["from_s"] - flip_s
    return None


def slo_from(results: Sequence[serve.RequestResult], factor: float) -> serve.Slo:
    """``factor`` times the TTFT and TPOT p90 of ``results`` (the fixed pools at low load)."""
    done = [r for r in results if r.ok]
    ttft = percentile([r.ttft_s for r in done], 90)
    tpot = percentile([r.tpot_s for r in done if r.tpot_s is not None], 90)
    return serve.Slo(ttft_ms=round(1000 * factor * ttft, 1), tpot_ms=round(1000 * factor * tpot, 1))


async def _poll_pools(base_url: str, samples: list, decisions: dict, stop: asyncio.Event, t0: float) -> None:
    """Every 0.5 s: (seconds from t0, prefill workers, decode workers) into ``samples``, and
    each decision the controller reports into ``decisions`` (its time from t0 -> (action,
    role)), dated by the answer's ``ago_s``: a status that answers late under load loses
    no decision."""
    import httpx

    async with httpx.AsyncClient(timeout=60) as http:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                status = (await http.get(f"{base_url}/status")).json()
                now = time.perf_counter() - t0
                live = {role: sum(not w["draining"] for w in ws) for role, ws in status["pools"].items()}
                for d in (status.get("autoscaling") or {}).get("decisions", []):
                    decisions.setdefault(round(d["at"], 3), (round(now - d["ago_s"], 1), d["action"], d["role"]))
                samples.append((now, live.get("prefill", 0), live.get("decode", 0)))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)


def _launch_args(topology: Path, extra: Sequence[str], model: str | None, num_cpus: int | None) -> argparse.Namespace:
    argv = ["--launch", "--config", str(topology), "--no-progress", "--max-concurrency", "64", *ENGINE, *extra]
    if model:
        argv += ["--model", model]
    if num_cpus:
        argv += ["--num-cpus", str(num_cpus)]
    return serve.parse_args(argv)


def run_config(name: str, topology: dict, runs: Sequence[serve.RunPlan | int], model: str | None,
               num_cpus: int | None, vocab: Sequence[int]) -> list[dict]:
    """Launch the service with ``topology`` and run each plan in turn (an int: a closed
    loop of that many requests at once for calibration); per plan, its results, its
    duration and the pool sizes seen meanwhile."""
    with tempfile.TemporaryDirectory(prefix="tandem-bench-elastic-") as tmp:
        path = Path(tmp) / "topology.json"
        path.write_text(json.dumps(topology))  # YAML is a superset of JSON
        args = _launch_args(path, [], model, num_cpus)
        with serve.launched_service(args) as (base_url, grpc_target):
            return asyncio.run(_run_all(name, args, runs, base_url, grpc_target, vocab))


async def _run_all(name, args, runs, base_url, grpc_target, vocab) -> list[dict]:
    out = []
    async with serve.open_client(args, base_url, grpc_target) as client:
        await serve.warm_up(client, vocab, 0, base_url)
        for plan in runs:
            samples: list = []
            decisions: dict = {}
            stop = asyncio.Event()
            t0 = time.perf_counter()
            poller = asyncio.ensure_future(_poll_pools(base_url, samples, decisions, stop, t0))
            if isinstance(plan, int):  # calibration: everything at once
                plan = serve.RunPlan(0.0, [BenchRequest(workloads.random_tokens(64, vocab, random.Random(i)), 64)
                                           for i in range(plan)], [0.0] * plan)
            results, duration = await serve.run_load(client, plan, None, False)
            stop.set()
            await poller
            failed = sum(not r.ok for r in results)
            print(f"{name}: {len(results)} requests in {duration:.1f} s, {failed} failed", flush=True)
            out.append({"results": results, "duration_s": duration, "pools": samples,
                        "decisions": sorted(decisions.values())})
    return out


def _autoscaling(slo: serve.Slo, allow_switch: bool) -> dict:
    return {
        "prefill": {"min_workers": 1, "max_workers": 2}, "decode": {"min_workers": 1, "max_workers": 2},
        "slo": {"ttft_ms": slo.ttft_ms, "itl_ms": slo.tpot_ms}, "interval_s": 1.0, "scale_down_delay_s": 5.0,
        "drain_timeout_s": 30.0, "allow_role_switch": allow_switch,
    }


def step_experiment(args, vocab) -> dict:
    fixed = {"prefill_workers": 1, "decode_workers": 1}
    burst = args.calibration_requests
    low = Phase("low", args.low_s, args.low_rate, args.prompt_len, args.output_len)
    probe = schedule([low], vocab, seed=1)
    calibration, baseline = run_config("fixed (calibration)", fixed, [burst, probe], args.model, args.num_cpus, vocab)
    capacity = burst / calibration["duration_s"]
    slo = args.slo or slo_from(baseline["results"], args.slo_factor)
    rate = args.step_rate or round(args.step_factor * capacity, 2)
    phases = [low, Phase("step", args.step_s, rate, args.prompt_len, args.output_len),
              Phase("after", args.low_s, args.low_rate, args.prompt_len, args.output_len)]
    plan = schedule(phases, vocab, seed=2)
    step_from, step_to = args.low_s, args.low_s + args.step_s
    figures = {"capacity_rps": round(capacity, 2), "step_rate_rps": rate, "slo_ms": {"ttft": slo.ttft_ms,
               "tpot": slo.tpot_ms}, "requests": len(plan.requests)}
    configs = {"fixed": fixed, "autoscaled": {**fixed, "autoscaling": _autoscaling(slo, False)}}
    for name, topology in configs.items():
        (run,) = run_config(name, topology, [plan], args.model, args.num_cpus, vocab)
        results = run["results"]
        entry = {"goodput_rps": round(goodput(results, slo, step_from, step_to), 2),
                 "failed": sum(not r.ok for r in results)}
        if "autoscaling" in topology:
            entry |= _scaling_times(run["pools"], run["decisions"], step_from)
        figures[name] = entry
        print(f"step {name}: {entry}", flush=True)
    fixed_goodput = figures["fixed"]["goodput_rps"]
    figures["goodput_ratio"] = round(figures["autoscaled"]["goodput_rps"] / fixed_goodput, 2) if fixed_goodput else None
    return figures


def _scaling_times(samples: list, decisions: list, step_s: float) -> dict:
    """Seconds from the step to the first decision to add a worker and to the largest
    pools seen, the largest pools, and every decision (seconds from the start, action, role)."""
    first_add = next((t for t, action, _ in decisions if t >= step_s and action != "remove"), None)
    peak = max((p + d for _, p, d in samples), default=0)
    at_peak = next(((t, p, d) for t, p, d in samples if t >= step_s and p + d == peak), None)
    return {"s_to_first_scale_out": None if first_add is None else round(first_add - step_s, 1),
            "s_to_largest_pools": None if at_peak is None else round(at_peak[0] - step_s, 1),
            "largest_pools": None if at_peak is None else {"prefill": at_peak[1], "decode": at_peak[2]},
            "decisions": decisions}


def flip_experiment(args, vocab, slo: serve.Slo) -> dict:
    phases = [Phase("prefill-heavy", args.flip_s, args.prefill_heavy_rate, args.long_prompt, 8),
              Phase("decode-heavy", args.flip_s, args.decode_heavy_rate, 32, args.long_output)]
    plan = schedule(phases, vocab, seed=3)
    figures = {"slo_ms": {"ttft": slo.ttft_ms, "tpot": slo.tpot_ms}, "requests": len(plan.requests)}
    for name, switch in (("scaling alone", False), ("role switching", True)):
        topology = {"prefill_workers": 1, "decode_workers": 1, "autoscaling": _autoscaling(slo, switch)}
        (run,) = run_config(name, topology, [plan], args.model, args.num_cpus, vocab)
        windows = attainment(run["results"], slo)
        figures[name] = {"s_to_slo_again": recovery_s(windows, args.flip_s), "windows": windows,
                         "decisions": run["decisions"], "failed": sum(not r.ok for r in run["results"])}
        print(f"flip {name}: back within the SLO {figures[name]['s_to_slo_again']} s after the flip; "
              f"decisions {figures[name]['decisions']}", flush=True)
    return figures


def _slo_arg(text: str) -> serve.Slo:
    parts = dict(item.split(":") for item in text.split(","))
    return serve.Slo(ttft_ms=float(parts["ttft"]), tpot_ms=float(parts["tpot"]))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", choices=("step", "flip", "both"), default="both")
    ap.add_argument("--slo", type=_slo_arg, default=None, help="ttft:MS,tpot:MS (default: from the fixed pools)")
    ap.add_argument("--slo-factor", type=float, default=3.0, help="the SLO: this times the low-load p90s")
    ap.add_argument("--low-rate", type=float, default=1.0)
    ap.add_argument("--low-s", type=float, default=20.0)
    ap.add_argument("--step-s", type=float, default=60.0)
    ap.add_argument("--step-factor", type=float, default=2.0, help="the step: this times the fixed pools' capacity")
    ap.add_argument("--step-rate", type=float, default=None, help="the step's rate (default: from --step-factor)")
    ap.add_argument("--calibration-requests", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--flip-s", type=float, default=40.0, help="each half of the flip experiment")
    ap.add_argument("--prefill-heavy-rate", type=float, default=6.0)
    ap.add_argument("--decode-heavy-rate", type=float, default=3.0)
    ap.add_argument("--long-prompt", type=int, default=768)
    ap.add_argument("--long-output", type=int, default=128)
    ap.add_argument("--model", default=None, help="default: the built-in test model")
    ap.add_argument("--num-cpus", type=int, default=None, help="CPUs for the local Ray")
    ap.add_argument("--out", default=None, help="write the figures as JSON")
    args = ap.parse_args(argv)

    from engine.model.default_model import ensure_default_model
    from engine.tokenizer import Tokenizer

    vocab = workloads.sampleable_ids(Tokenizer.from_pretrained(args.model or str(ensure_default_model())))
    figures = {}
    if args.experiment in ("step", "both"):
        figures["step"] = step_experiment(args, vocab)
    if args.experiment in ("flip", "both"):
        slo = args.slo or (serve.Slo(**{k + "_ms": v for k, v in figures["step"]["slo_ms"].items()})
                           if "step" in figures else None)
        if slo is None:
            ap.error("--experiment flip needs --slo (or run both: the step experiment measures it)")
        figures["flip"] = flip_experiment(args, vocab, slo)
    print(json.dumps({k: {n: v for n, v in f.items() if n != "windows"} for k, f in figures.items()}, default=str))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
