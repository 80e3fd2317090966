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
import time
from collections.abc import Sequence
from pathlib import Path

# The validations beside this program: against one engine in this process
# (bench/sim_measure.py) and against the live local cluster (bench/sim_live.py). The names
# tests and other programs use are imported from here.
from bench.sim_live import (
    _live_topology,
    add_live_validate_arguments,
    live_profile,
    live_validate,
    others_busy,
    replay_live,
    requests_in_flight,
    with_service_path,
)
from bench.sim_measure import calibrate, compare, replay_on_engine, row_text
from router.admission import AdmissionConfig
from sim.cost import model_spec
from sim.fitting import cost_model
from sim.report import parse_slo, summary
from sim.simulator import run
from sim.topology import RouterSettings, SimTopology
from sim.workload import generate, parse_spec

__all__ = [
    "_live_topology", "batching", "compare", "disagg", "live_profile", "live_validate", "main", "others_busy",
    "replay_live", "replay_on_engine", "requests_in_flight", "speed", "validate", "with_service_path",
]

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
        print(f"rate {rate:g} req/s: " + row_text(row))
    return out


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
    add_live_validate_arguments(lv)
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
