"""The simulator against the live local cluster (``python -m bench.sim live-validate``): each
topology started for the run (``live_run``), its runs' own traces replayed strictly by the
CPU-calibrated simulation of that topology (``replay_live``); with ``--live-profile``, costs
timed inside that topology's live workers on a calibration run of its own (``live_profile``)
and the request's way through the service measured on it (``with_service_path``).

``bench/sim.py`` is the program and its docstring describes the study; the comparison of
measured and simulated metrics, and the calibration, are ``bench/sim_measure.py``'s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bench.sim_measure import BOUNDS, calibrate, compare, row_text
from sim.cost import model_spec
from sim.fitting import cost_model
from sim.report import summary
from sim.simulator import Simulator
from sim.topology import SimTopology

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
                      + row_text(row["metrics"]) + (f"; live {live}" if live else ""), flush=True)
    for row in rows:
        row["within_bounds"] = all(v["error"] is not None and abs(v["error"]) <= BOUNDS[k]
                                   for k, v in row["metrics"].items())
    print(f"{sum(r['within_bounds'] for r in rows)} of {len(rows)} runs within every bound")
    return {"profile": profile or "shipped", "live_profiles": profiles, "rows": rows}


def add_live_validate_arguments(lv: argparse.ArgumentParser) -> None:
    """``live-validate``'s flags, on its subcommand's parser ``lv``."""
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
