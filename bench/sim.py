"""The simulator's benchmarks (docs/SIMULATOR.md): its own speed, and two studies on simulated H100s.

    python -m bench.sim speed [--devices 512] [--seconds 5] [--rate-per-device 8]
    python -m bench.sim batching [--requests 1000]
    python -m bench.sim disagg [--devices 64] [--slo ttft:60,itl:11] [--workload sharegpt:seed=0]
    python -m bench.sim validate [--rates 4,12]
    python -m bench.sim live-validate [--topologies 1P+1D,2P+1D,1P+2D,colocated] [--rates 2,8]
                                      [--live-profile] [--calibrate] [--draws 8]

``speed``: CPU time to simulate ``--devices`` H100s (1 prefill to 3 decode workers,
Llama-3.1-8B) serving ShareGPT-shaped traffic for ``--seconds`` simulated seconds, and
what that makes 10 minutes of traffic cost (the issue's target: under 2 minutes of CPU
for 512 GPUs). ``batching``: one simulated H100 serving the same requests with static
batching, continuous batching, and continuous batching with chunked prefill: offline
throughput (every request at once) and, at a rate, TBT (ITL) percentiles. ``disagg``:
``tandem plan`` on ``--devices`` H100s under a tight TTFT + ITL SLO, the planned
configuration's goodput against the best colocated one. ``validate``: one real engine
(tandem-tiny-llama on this CPU, in process, no Ray) against its CPU-calibrated
simulation on the same traces at two rates. ``live-validate``: the live local cluster
(``bench.serve --launch``) in each topology at two rates, each run's own trace replayed
strictly by the CPU-calibrated simulation of that topology (same KV block counts); with
``--live-profile`` on costs timed inside that topology's live workers on a calibration
run of its own (``live_profile``), with the request's way through the service measured
on that run (``with_service_path``), its delays drawn ``--draws`` times and the metrics
averaged.

Each prints its numbers and, with ``--json FILE``, writes them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from router.admission import AdmissionConfig
from sim.cost import model_spec
from sim.fitting import cost_model
from sim.report import parse_slo, summary
from sim.simulator import Simulator, run
from sim.topology import RouterSettings, SimTopology
from sim.workload import generate, parse_spec

UNBOUNDED = RouterSettings(admission=AdmissionConfig(max_requests=10**9, max_prompt_tokens=10**12))


def speed(args: argparse.Namespace) -> dict:
    """CPU seconds per simulated second at ``args.devices`` devices, and the 10-minute extrapolation."""
    cost = cost_model("H100", model_spec("llama-3.1-8b"))
    prefill = max(1, args.devices // 4)
    topo = SimTopology(prefill_workers=prefill, decode_workers=args.devices - prefill, router=UNBOUNDED)
    rate = args.rate_per_device * args.devices
    n = int(rate * args.seconds)
    requests = generate(parse_spec(f"sharegpt:n={n},rate={rate},seed=0"))
    wall = time.perf_counter()
    result = run(topo, cost, requests)
    wall = time.perf_counter() - wall
    s = summary(result)
    simulated = max(r.end_s for r in result.records)  # arrivals plus the drain of the last requests
    out = {"devices": args.devices, "requests": n, "arrival_seconds": args.seconds, "simulated_seconds": simulated,
           "sim_cpu_s": result.sim_cpu_s, "wall_s": wall, "steps": result.num_steps,
           "output_tokens": s["completed_tokens"],
           "cpu_s_per_output_token_us": 1e6 * result.sim_cpu_s / max(1, s["completed_tokens"]),
           "cpu_ms_per_request": 1e3 * result.sim_cpu_s / n}
    # Ten minutes of arrivals at this rate cost as many times the CPU per request (the work
    # per request does not depend on how long the run is).
    out["extrapolated_cpu_s_for_600s"] = result.sim_cpu_s / n * rate * 600
    print(f"{args.devices} simulated H100s, {n} requests over {args.seconds:g} s ({simulated:.1f} s simulated "
          f"with the drain): {result.sim_cpu_s:.1f} s of CPU, {result.num_steps} steps, "
          f"{out['cpu_s_per_output_token_us']:.1f} us of CPU a generated token, "
          f"{out['cpu_ms_per_request']:.2f} ms a request")
    print(f"10 minutes of this traffic: about {out['extrapolated_cpu_s_for_600s']:.0f} s of CPU "
          f"(target: 120 s)")
    return out


BATCHING = {
    "static": {"batching": "static", "enable_chunked_prefill": False, "max_num_batched_tokens": 8192},
    "continuous": {"batching": "continuous", "enable_chunked_prefill": False, "max_num_batched_tokens": 8192},
    "continuous+chunked": {"batching": "continuous", "enable_chunked_prefill": True, "max_num_batched_tokens": 512},
}


def batching(args: argparse.Namespace) -> dict:
    """Static vs continuous vs chunked on one simulated H100: throughput and TBT."""
    cost = cost_model("H100", model_spec("llama-3.1-8b"))
    out = {}
    for name, engine in BATCHING.items():
        topo = SimTopology(prefill_workers=0, decode_workers=1, engine={**engine, "max_num_seqs": args.max_num_seqs},
                           router=UNBOUNDED)
        offline = summary(run(topo, cost, generate(parse_spec(f"sharegpt:n={args.requests},seed=0"))))
        online_spec = parse_spec(f"{args.online},n={args.requests},rate={args.rate},seed=1")
        online = summary(run(topo, cost, generate(online_spec)))
        out[name] = {"offline_output_tokens_per_s": offline["output_throughput"],
                     "offline_requests_per_s": offline["request_throughput"],
                     "itl_ms": online["itl_ms"], "ttft_ms": online["ttft_ms"], "preemptions": online["num_preemptions"]}
        print(f"{name:20} offline {offline['output_throughput']:8.0f} output tokens/s "
              f"({offline['request_throughput']:.2f} req/s); {args.online} at {args.rate:g} req/s: TBT p50/p99 "
              f"{online['itl_ms']['median']:.1f}/{online['itl_ms']['p99']:.1f} ms, "
              f"TTFT p99 {online['ttft_ms']['p99']:.0f} ms")
    base = out["static"]["offline_output_tokens_per_s"]
    print(f"continuous / static throughput: {out['continuous']['offline_output_tokens_per_s'] / base:.2f}x; "
          f"chunked / static: {out['continuous+chunked']['offline_output_tokens_per_s'] / base:.2f}x")
    return out


def disagg(args: argparse.Namespace) -> dict:
    """The planner on ``args.devices`` H100s: the best disaggregated configuration's goodput against
    the best colocated one's, per unit times the units, then each simulated whole."""
    from sim.planner import PlanSettings, plan

    cost = cost_model("H100", model_spec("llama-3.1-8b"))
    slo, spec = parse_slo(args.slo), parse_spec(args.workload)
    settings = PlanSettings(chunks=tuple(int(c) for c in args.chunks.split(",")),
                            batch_caps=tuple(int(c) for c in args.batch_caps.split(",")),
                            max_unit=args.max_unit, iters=args.iters, trial_s=args.trial_s,
                            warmup_s=args.warmup_s, max_requests=args.max_requests)

    def progress(ev, replicas):
        print(f"  {ev.candidate.label(replicas):40} estimate {ev.estimate * replicas:8.1f}, sustains "
              f"{ev.rate * replicas:8.1f} req/s ({ev.trials} trials)", flush=True)

    t0 = time.process_time()
    result = plan(args.devices, SimTopology(router=UNBOUNDED), cost, spec, slo, settings, verify=False,
                  progress=progress)
    r = result.replicas
    out = {"devices": args.devices, "slo": args.slo, "workload": args.workload, "unit": result.unit,
           "placement": "load",
           "candidates": [{"config": e.candidate.label(r), "goodput": e.rate * r, "estimate": e.estimate * r}
                          for e in result.ranked]}
    split = next((e for e in result.ranked if not e.candidate.colocated), None)
    for name, ev in (("disaggregated", split), ("colocated", result.best_colocated)):
        out[name] = _whole(ev, r, cost, spec, slo, settings) if ev is not None else None
    if args.also_round_robin and result.best_colocated is not None:
        rr = RouterSettings(placement="round_robin", admission=UNBOUNDED.admission)
        out["colocated_round_robin"] = _whole(result.best_colocated, r, cost, spec, slo, settings, rr)
    out["cpu_s"] = time.process_time() - t0
    d, c = out["disaggregated"], out["colocated"]
    if d and c:
        out["ratio_units"] = d["unit_goodput"] / c["unit_goodput"] if c["unit_goodput"] else math.inf
        out["ratio_whole"] = d["goodput"] / c["goodput"] if c["goodput"] else None
        whole = ("- (colocated sustained nothing tried)" if out["ratio_whole"] is None
                 else f"{out['ratio_whole']:.2f}x")
        print(f"disaggregated / colocated: {out['ratio_units']:.2f}x by units, {whole} simulated whole "
              f"({out['cpu_s']:.0f} s of CPU)")
    return out


def _whole(ev, replicas: int, cost, spec, slo, settings, router: RouterSettings = UNBOUNDED) -> dict:
    """A candidate's goodput by units and simulated whole (``sim.planner.whole_cluster``), 10%
    slower at a time while it misses the SLO."""
    from sim.planner import whole_cluster

    rate, res = whole_cluster(ev, SimTopology(router=router), cost, spec, slo, settings, replicas,
                              backoffs=10, factor=0.9)
    row = {"config": ev.candidate.label(replicas), "unit_goodput": ev.rate * replicas, "goodput": rate,
           "slo_attainment": res["slo_attainment"], "ttft_ms": res["ttft_ms"], "tpot_ms": res["tpot_ms"],
           "itl_ms": res["itl_ms"]}
    print(f"{row['config']}: {row['unit_goodput']:.1f} req/s by units, {rate:.1f} req/s simulated whole "
          f"(SLO attainment {res['slo_attainment']:.1%}, TTFT p90 {res['ttft_ms']['p90']:.0f} ms, "
          f"TPOT p90 {res['tpot_ms']['p90']:.1f} ms)")
    return row


class _WallClock:
    """Seconds on the wall clock since the replay began; idle time is slept through."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))

    def step(self, engine):
        outputs = engine.step()
        return outputs, self.now()


class _CpuClock:
    """Virtual seconds: each engine step advances them by the CPU time the step's thread used,
    idle time jumps to the next arrival. What one uncontended core would take, whatever else
    the machine runs."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)

    def step(self, engine):
        c0 = time.thread_time()
        outputs = engine.step()
        self.t += time.thread_time() - c0
        return outputs, self.t


def replay_on_engine(requests, settings: dict, clock: str = "wall") -> list:
    """The trace replayed on a real ``LLMEngine`` (tandem-tiny-llama, one torch thread) in
    process: each request added at its arrival, every token timed at the end of the step that
    produced it, on the wall clock or the step thread's CPU clock (``clock="cpu"``). Returns
    ``sim.simulator.Record`` s, as a simulation would."""
    import collections

    import torch

    from engine import LLMEngine, SamplingParams
    from sim.simulator import Record

    torch.set_num_threads(1)
    engine = LLMEngine(**settings)
    records = [Record(i, r) for i, r in enumerate(requests)]
    pending = collections.deque(records)
    engine.add_request([5] * 32, SamplingParams(max_tokens=4, ignore_eos=True), request_id="warm-up")
    while engine.has_unfinished_requests():
        engine.step()
    timer = _CpuClock() if clock == "cpu" else _WallClock()
    while pending or engine.has_unfinished_requests():
        now = timer.now()
        while pending and pending[0].req.arrival_s <= now:
            rec = pending.popleft()
            prompt = [5 + (rec.index * 7919 + j) % 4000 for j in range(rec.req.prompt_tokens)]
            params = SamplingParams(max_tokens=rec.req.output_tokens, ignore_eos=True, temperature=0.0)
            engine.add_request(prompt, params, request_id=str(rec.index))
        if not engine.has_unfinished_requests():
            timer.wait_until(pending[0].req.arrival_s)
            continue
        outputs, t = timer.step(engine)
        for out in outputs:
            rec = records[int(out.request_id)]
            rec.token_times.extend([t] * len(out.new_token_ids))
            if out.finished:
                rec.end_s = t
    return records


def calibrate(path: str, clock: str = "wall") -> str:
    """Measure a CPU profile table now (``bench.steps``' measurements), so that the validation's
    costs come from the machine as busy as it is during the replays; ``clock="cpu"`` times the
    steps by the thread's CPU time instead of the wall clock."""
    import types

    import torch

    import bench.steps
    from bench.common import write_result
    from bench.steps import decode_kv_blocks, measure_profile, profile_table
    from engine import LLMEngine

    torch.set_num_threads(1)
    batches = [1, 2, 4, 8, 16, 32]
    engine = LLMEngine(num_kv_blocks=decode_kv_blocks(max(batches), 512))
    saved = bench.steps.time
    if clock == "cpu":  # bench.steps reads time.perf_counter: hand it the thread's CPU clock
        bench.steps.time = types.SimpleNamespace(perf_counter=time.thread_time)
    try:
        rows = measure_profile(engine, batches, (128, 512), 20, [16, 64, 128, 256, 512, 1024])
    finally:
        bench.steps.time = saved
    write_result(path, profile_table(engine, "cpu", "tandem-tiny-llama", rows))
    return path


def validate(args: argparse.Namespace) -> dict:
    """One engine on this CPU against the CPU-calibrated simulation of it, on the same traces."""
    from sim.simulator import SimResult

    settings = {"num_kv_blocks": args.num_kv_blocks, "max_num_batched_tokens": args.budget}
    profile = calibrate(args.profile_out, args.clock) if args.calibrate else None
    cost = cost_model("cpu", model_spec("tandem-tiny-llama"), profile)
    topo = SimTopology(prefill_workers=0, decode_workers=1, engine=settings, router=UNBOUNDED)
    out = {}
    for rate in (float(r) for r in args.rates.split(",")):
        requests = generate(parse_spec(f"{args.workload},n={args.requests},rate={rate},seed=7"))
        measured = summary(SimResult(replay_on_engine(requests, settings, args.clock), 0, 0, [], 0.0, 1, []))
        simulated = summary(run(topo, cost, requests))
        row = compare(measured, simulated)
        out[str(rate)] = row
        print(f"rate {rate:g} req/s: " + _row_text(row))
    return out


METRICS = (("throughput_tok_s", lambda s: s["output_throughput"]),
           ("ttft_p50_ms", lambda s: s["ttft_ms"]["median"]),
           ("ttft_p90_ms", lambda s: s["ttft_ms"]["p90"]),
           ("tpot_mean_ms", lambda s: s["tpot_ms"]["mean"]),
           ("e2e_mean_ms", lambda s: s["e2e_ms"]["mean"]))
# The bounds on |simulated / measured - 1|: throughput and means 10%, TTFT percentiles 15%.
BOUNDS = {"throughput_tok_s": 0.10, "ttft_p50_ms": 0.15, "ttft_p90_ms": 0.15, "tpot_mean_ms": 0.10,
          "e2e_mean_ms": 0.10}


def compare(measured: dict, *simulated: dict) -> dict:
    """Each validated metric, measured and simulated (the mean over the simulations given),
    and the simulation's relative error."""
    row = {}
    for name, get in METRICS:
        m, p = get(measured), sum(get(s) for s in simulated) / len(simulated)
        row[name] = {"measured": m, "simulated": p, "error": (p - m) / m if m else None}
    return row


def _row_text(row: dict) -> str:
    return ", ".join(f"{k} {v['measured']:.1f} vs {v['simulated']:.1f} ({v['error']:+.0%})" for k, v in row.items())


LIVE_TOPOLOGIES = {"1P+1D": (1, 1), "2P+1D": (2, 1), "1P+2D": (1, 2), "colocated": (0, 2)}


def _load_average() -> float:
    return os.getloadavg()[0]


def _step_counters(service) -> dict[str, tuple[int, float, float]]:
    """Per role, the workers' engine steps and model-runner time (wall, step thread's CPU) so far."""
    out: dict[str, tuple[int, float, float]] = {}
    for worker, st in service.stats().items():
        role = "prefill" if worker.startswith("prefill") else "decode"
        n, wall, cpu = out.get(role, (0, 0.0, 0.0))
        out[role] = (n + st["num_steps"], wall + st["forward_s"], cpu + st["forward_cpu_s"])
    return out


def _serve_run(service, name: str, args: argparse.Namespace, rate: str, seed: int, path: Path,
               extra: Sequence[str] = ()) -> None:
    """One ``bench.serve`` run of the validation's workload against ``service``."""
    from bench.serve import main as serve

    argv = [*extra, "--base-url", service.http_url, "--workload", "synthetic", "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--range-ratio", str(args.range_ratio),
            "--num-requests", str(args.requests), "--request-rate", rate, "--seed", str(seed),
            "--result-json", str(path), "--no-progress", "--label", name]
    if serve(argv + (["--model", args.model] if args.model else [])) != 0:
        raise RuntimeError(f"bench.serve failed on {name} at {rate} req/s")


def others_busy(steps: list[list[dict]]) -> list[list[int]]:
    """For each worker's steps (``take_steps`` rows, in order), how many other workers were
    mid-step as each began."""
    spans = [([r["start_s"] for r in rows], [r["start_s"] + r["step_ms"] / 1e3 for r in rows]) for rows in steps]
    out = []
    for i, rows in enumerate(steps):
        counts = []
        for r in rows:
            t = r["start_s"]
            counts.append(sum(j != i and (k := bisect_right(starts, t) - 1) >= 0 and ends[k] > t
                              for j, (starts, ends) in enumerate(spans)))
        out.append(counts)
    return out


SPREADS = tuple(i / 10 for i in range(11))  # the service path's spreads tried on the calibration run
SPREAD_SEEDS = 4


def requests_in_flight(run: dict):
    """For a ``bench.serve`` run against a local service, the requests sent and not yet
    ended at a time on the host's monotonic clock (the workers' step records')."""
    t0 = run["started_monotonic_s"]
    sent = sorted(t0 + r["sent_s"] for r in run["requests"])
    ended = sorted(t0 + r["sent_s"] + (r["e2e_s"] or 0.0) for r in run["requests"])
    return lambda t: bisect_right(sent, t) - bisect_right(ended, t)


def live_profile(service, name: str, args: argparse.Namespace, out_dir: Path) -> Path:
    """A profile timed inside the live workers of topology ``name``: a calibration run of its
    own (``--calibration-rate``, another seed than the validated runs') with every worker
    keeping its steps' shapes and times (``record_steps``: each step's turn of the step
    thread, on the wall clock, under the service's load), written as a ``bench.steps`` table
    whose rows also say each step's ``role``, the other workers mid-step as it began
    (``others_busy``) and the requests in flight then (``in_flight``): the workers and the
    service share the host's cores (``sim.fitting.live_corrections``). ``with_service_path``
    adds the request's way through the service. A few requests go first, untimed: a fresh
    service's first calls and connections are slow."""
    import ray

    from sim.cost import StepShape
    from sim.fitting import profile_row, step_profile

    prefill, decode = ray.get(service.controller.workers.remote())
    handles = [w.handle for w in (*prefill, *decode)]
    warm = argparse.Namespace(**{**vars(args), "requests": 8})  # first calls, connections: not timed
    _serve_run(service, name, warm, "inf", args.seed + 999, out_dir / f"warm-up-{name}.json",
               ["--max-concurrency", "2"])
    ray.get([h.record_steps.remote(100_000) for h in handles])
    calibration = argparse.Namespace(**{**vars(args), "requests": args.calibration_requests})
    run_path = out_dir / f"calibration-{name}.json"
    _serve_run(service, name, calibration, args.calibration_rate, args.seed + 1000, run_path)
    taken = ray.get([h.take_steps.remote() for h in handles])
    ray.get([h.record_steps.remote(0) for h in handles])
    roles = ["prefill"] * len(prefill) + ["decode"] * len(decode)
    in_flight = requests_in_flight(json.loads(run_path.read_text())["runs"][0])
    rows = [{**profile_row(StepShape(**{k: v for k, v in row.items() if k not in ("step_ms", "start_s")}),
                           row["step_ms"]), "role": role, "others_busy": busy, "in_flight": in_flight(row["start_s"])}
            for steps, others, role in zip(taken, others_busy(taken), roles, strict=True)
            for row, busy in zip(steps, others, strict=True)]
    path = out_dir / f"live-profile-{name}.json"
    path.write_text(json.dumps(step_profile("cpu", model_spec("tandem-tiny-llama"), 4, rows)))  # CPU engines: float32
    print(f"{name}: {len(rows)} live steps timed")
    return path


def with_service_path(name: str, path: Path, calibration: Path, num_kv_blocks: int) -> None:
    """Add to the live table at ``path`` the request's way through the service, which no
    step times (``service_path``, ``sim.service_path``): each request of the calibration
    run, its measured TTFT less the one simulated on the table's costs with no such delay,
    grouped by the requests in flight as it was sent; and the spread of the draws that
    gives the calibration run's own TTFT p50 and p90 (``SPREADS``, ``SPREAD_SEEDS`` draws each)."""
    from sim.service_path import NO_DELAY, ServicePath
    from sim.workload import load_trace

    cost = cost_model("cpu", model_spec("tandem-tiny-llama"), path)
    cost.service_path = NO_DELAY  # (a table fitted before has one: it is fitted anew)
    run = json.loads(calibration.read_text())["runs"][0]
    measured = sorted(run["requests"], key=lambda r: r["sent_s"])
    topology, trace = _live_topology(name, num_kv_blocks), load_trace(calibration, 0)
    records = Simulator(topology, cost, trace).run().records
    in_flight = _in_flight(records)
    ok = [(i, m["ttft_s"] - (r.token_times[0] - r.req.arrival_s))
          for i, (m, r) in enumerate(zip(measured, records, strict=True)) if m["ok"] and r.token_times]
    # Grouped again by the counts the simulator will see: in flight with these delays taken.
    cost.service_path = ServicePath.fit([in_flight[i] for i, _ in ok], [d for _, d in ok])
    in_flight = _in_flight(Simulator(topology, cost, trace).run().records)
    groups = ServicePath.fit([in_flight[i] for i, _ in ok], [d for _, d in ok])
    target = run["summary"]["ttft_ms"]

    def miss(spread: float) -> float:
        cost.service_path = replace(groups, spread=spread)
        runs = [summary(Simulator(topology, cost, trace, seed=seed).run())["ttft_ms"] for seed in range(SPREAD_SEEDS)]
        return sum(abs(sum(r[k] for r in runs) / len(runs) / target[k] - 1) for k in ("median", "p90"))

    service = replace(groups, spread=min(SPREADS, key=miss))
    table = json.loads(path.read_text())
    table["service_path"] = service.to_json()
    path.write_text(json.dumps(table))
    medians = ", ".join(f"{n}+: {g[len(g) // 2] * 1e3:.1f}" for n, g in zip(service.starts, service.groups))
    print(f"{name}: the request's way through the service, median ms by requests in flight: {medians}; "
          f"spread {service.spread:g}")


def _in_flight(records: list) -> list[int]:
    """For each simulated request, the others in flight as it was sent."""
    from sim.service_path import in_flight_at_send

    return in_flight_at_send([r.req.arrival_s for r in records],
                             [r.end_s if r.end_s is not None else math.inf for r in records])


def live_run(name: str, args: argparse.Namespace, out_dir: Path) -> tuple[list[tuple[Path, dict]], Path | None]:
    """``bench.serve`` against a local cluster of topology ``name`` started for it (as
    ``--launch`` starts one), one run per rate (seeds as a sweep's); for each, its result JSON
    and the workers' mean step in the model runner, per role (wall and CPU ms). With
    ``--live-profile``, a calibration run first (``live_profile``), whose table it returns."""
    from bench.serve import parse_args, service_config
    from cluster.local import local_service

    prefill, decode = LIVE_TOPOLOGIES[name]
    flags = ["--prefill-workers", str(prefill), "--decode-workers", str(decode),
             "--num-kv-blocks", str(args.num_kv_blocks), "--num-cpus", str(args.num_cpus)]
    flags += ["--model", args.model] if args.model else []
    out = []
    with local_service(service_config(parse_args(["--launch", *flags])), args.num_cpus) as service:
        profile = live_profile(service, name, args, out_dir) if args.live_profile else None
        for i, rate in enumerate(args.rates.split(",")):
            path = out_dir / f"live-{name}-{rate}.json"
            before = _step_counters(service)
            _serve_run(service, name, args, rate, args.seed + i, path)
            steps = {}
            for role, (n, wall, cpu) in _step_counters(service).items():
                n0, wall0, cpu0 = before.get(role, (0, 0.0, 0.0))
                if n > n0:
                    steps[role] = {"steps": n - n0, "wall_ms": 1e3 * (wall - wall0) / (n - n0),
                                   "cpu_ms": 1e3 * (cpu - cpu0) / (n - n0)}
            out.append((path, steps))
    return out, profile


def _live_topology(name: str, num_kv_blocks: int) -> SimTopology:
    prefill, decode = LIVE_TOPOLOGIES[name]
    return SimTopology(prefill_workers=prefill, decode_workers=decode, engine={"num_kv_blocks": num_kv_blocks})


def replay_live(name: str, path: Path, cost, num_kv_blocks: int, draws: int = 1) -> list[dict]:
    """Each run of a ``bench.serve`` result replayed strictly (its requests as sent) on the
    simulation of topology ``name``; the measured and simulated metrics side by side. With
    a service path whose delays are drawn, the simulated metrics are the mean of ``draws``
    simulations (seeds 0 on): the model's expectation, not one draw's."""
    from sim.workload import load_trace

    topo = _live_topology(name, num_kv_blocks)
    seeds = range(1 if cost.service_path.is_fixed else draws)
    rows = []
    for i, recorded in enumerate(json.loads(path.read_text())["runs"]):
        sims = [Simulator(topo, cost, load_trace(path, i), seed=seed) for seed in seeds]
        simulated = [summary(sim.run()) for sim in sims]
        steps = {role: 1e3 * sum(w.forward_s for w in pool) / max(1, sum(w.num_steps for w in pool))
                 for role, pool in sims[0].pools.items() if pool}
        rows.append({"topology": name, "rate": recorded["request_rate"], "failed": recorded["summary"]["failed"],
                     "metrics": compare(recorded["summary"], *simulated), "simulated_step_ms": steps})
    return rows


def live_validate(args: argparse.Namespace) -> dict:
    """The live local cluster against its CPU-calibrated simulation, topology by topology."""
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    profile = calibrate(str(out_dir / "cpu-profile-now.json")) if args.calibrate else None
    cost = cost_model("cpu", model_spec("tandem-tiny-llama"), profile)
    rows, profiles = [], {}
    for name in args.topologies.split(","):
        before = _load_average()
        if args.replay_only:
            runs = [(out_dir / f"live-{name}-{rate}.json", {}) for rate in args.rates.split(",")]
            profile_here = out_dir / f"live-profile-{name}.json" if args.live_profile else None
        else:
            runs, profile_here = live_run(name, args, out_dir)
        after = _load_average()
        if profile_here:
            with_service_path(name, profile_here, out_dir / f"calibration-{name}.json", args.num_kv_blocks)
        topology_cost = cost_model("cpu", model_spec("tandem-tiny-llama"), profile_here) if profile_here else cost
        if profile_here:
            profiles[name] = str(profile_here)
        for path, steps in runs:
            for row in replay_live(name, path, topology_cost, args.num_kv_blocks, args.draws):
                row["load_average"] = [before, after]
                row["live_steps"] = steps
                rows.append(row)
                live = ", ".join(f"{role} step {v['wall_ms']:.1f} ms ({v['cpu_ms']:.1f} CPU) vs "
                                 f"{row['simulated_step_ms'].get(role, 0.0):.1f}" for role, v in steps.items())
                print(f"{name} at {row['rate']} req/s (load average {before:.1f} -> {after:.1f}): "
                      + _row_text(row["metrics"]) + (f"; live {live}" if live else ""), flush=True)
    for row in rows:
        row["within_bounds"] = all(v["error"] is not None and abs(v["error"]) <= BOUNDS[k]
                                   for k, v in row["metrics"].items())
    print(f"{sum(r['within_bounds'] for r in rows)} of {len(rows)} runs within every bound")
    return {"profile": profile or "shipped", "live_profiles": profiles, "rows": rows}


def _live_validate_arguments(lv: argparse.ArgumentParser) -> None:
    lv.add_argument("--topologies", default=",".join(LIVE_TOPOLOGIES))
    lv.add_argument("--rates", default="2,8", help="request rates, one run each per topology")
    lv.add_argument("--requests", type=int, default=60, help="per run")
    lv.add_argument("--input-len", type=int, default=128)
    lv.add_argument("--output-len", type=int, default=32)
    lv.add_argument("--range-ratio", type=float, default=0.5)
    lv.add_argument("--num-kv-blocks", type=int, default=512, help="per worker, live and simulated")
    lv.add_argument("--num-cpus", type=int, default=2)
    lv.add_argument("--seed", type=int, default=0)
    lv.add_argument("--model", default=None, help="default: the service's default (tandem-tiny-llama)")
    lv.add_argument("--calibrate", action="store_true", help="measure a fresh CPU profile first (else the shipped one)")
    lv.add_argument("--out-dir", default="bench-results/sim-live")
    lv.add_argument("--replay-only", action="store_true", help="simulate the result files already in --out-dir")
    lv.add_argument("--live-profile", action="store_true",
                    help="time each topology's steps inside its live workers on a calibration run first, and "
                         "simulate that topology on them (with the request's way through the service)")
    lv.add_argument("--calibration-rate", default="4", help="--live-profile: the calibration run's request rate")
    lv.add_argument("--calibration-requests", type=int, default=120, help="--live-profile: the calibration run's size")
    lv.add_argument("--draws", type=int, default=8,
                    help="--live-profile: simulations of each run, their metrics averaged (delays are drawn)")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="study", required=True)
    sp = sub.add_parser("speed")
    sp.add_argument("--devices", type=int, default=512)
    sp.add_argument("--seconds", type=float, default=5.0)
    sp.add_argument("--rate-per-device", type=float, default=8.0)
    b = sub.add_parser("batching")
    b.add_argument("--requests", type=int, default=1000)
    b.add_argument("--rate", type=float, default=20.0)
    b.add_argument("--max-num-seqs", type=int, default=256)
    b.add_argument("--online", default="sharegpt:", help="the workload at --rate (kind:settings, no n or rate)")
    d = sub.add_parser("disagg")
    d.add_argument("--devices", type=int, default=64)
    d.add_argument("--slo", default="ttft:60,itl:11")
    d.add_argument("--workload", default="sharegpt:seed=0", help="the length mix (rates are the planner's)")
    d.add_argument("--chunks", default="512,2048")
    d.add_argument("--batch-caps", default="256")
    d.add_argument("--max-unit", type=int, default=8)
    d.add_argument("--iters", type=int, default=3)
    d.add_argument("--trial-s", type=float, default=10.0)
    d.add_argument("--warmup-s", type=float, default=30.0, help="arrivals before each trial's, not counted")
    d.add_argument("--max-requests", type=int, default=3000)
    d.add_argument("--also-round-robin", action="store_true",
                   help="also simulate the best colocated configuration whole with round-robin placement")
    v = sub.add_parser("validate")
    v.add_argument("--rates", default="4,12")
    v.add_argument("--requests", type=int, default=120)
    v.add_argument("--workload", default="synthetic:in=128,out=64,range=0.5")
    v.add_argument("--num-kv-blocks", type=int, default=512)
    v.add_argument("--budget", type=int, default=2048)
    v.add_argument("--calibrate", action="store_true", help="measure a fresh CPU profile first (else the shipped one)")
    v.add_argument("--profile-out", default="cpu-profile-now.json", help="where --calibrate writes its table")
    v.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: time the engine (and --calibrate) by the step thread's CPU time, "
                        "as one uncontended core would run it")
    lv = sub.add_parser("live-validate")
    _live_validate_arguments(lv)
    for p in (sp, b, d, v, lv):
        p.add_argument("--json", default=None, help="write the numbers here")
    args = ap.parse_args(argv)
    studies = {"speed": speed, "batching": batching, "disagg": disagg, "validate": validate,
               "live-validate": live_validate}
    out = studies[args.study](args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
