"""``tandem sim`` (replay a trace or a workload on a simulated deployment) and ``tandem plan``
(search the configuration that serves the most load under SLOs); docs/SIMULATOR.md."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from router.admission import AdmissionConfig
from sim.cost import DEVICES, LINKS, MODELS, model_spec
from sim.fitting import cost_model
from sim.topology import RouterSettings, SimTopology

PLAN_HELP = ("search P:D splits, chunk budgets and batch caps for the most load under SLOs "
             "(and with --low-rate, autoscaling bounds)")


def _add_hardware(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device-kind", default="H100", choices=sorted(DEVICES), help="default: H100")
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS),
                   help="the served model's sizes (default: llama-3.1-8b)")
    p.add_argument("--profile", default=None,
                   help="a profile table (python -m bench.steps --profile) to fit the device's corrections from")
    p.add_argument("--link", default=None, choices=LINKS, help="KV transfer link (default: ib on GPUs, pcie on cpu)")


def add_sim(sub) -> None:
    """The ``tandem sim`` subcommand."""
    p = sub.add_parser("sim", help="replay a trace or workload on a simulated deployment (docs/SIMULATOR.md)")
    p.add_argument("--config", default=None, help="topology YAML (cluster/config.py); default 1 prefill + 1 decode")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", default=None, help="a bench.serve result JSON or a JSON-lines trace")
    src.add_argument("--workload", default=None, help="e.g. sharegpt:n=2000,rate=20,seed=0 (sim/workload.py)")
    p.add_argument("--run-index", type=int, default=0, help="which run of a bench.serve result to replay")
    p.add_argument("--rate-scale", type=float, default=1.0, help="replay the trace this many times faster")
    p.add_argument("--prefill-workers", type=int, default=None)
    p.add_argument("--decode-workers", type=int, default=None)
    _add_hardware(p)
    _add_router(p)
    p.add_argument("--slo", default=None, help="goodput SLO, e.g. ttft:200,itl:50 or ttft:300,gap:15 (every gap "
                                               "between two tokens) or gap:15@0.99 (99%% of them)")
    p.add_argument("--result-json", default=None, help="write the summary as JSON")
    p.set_defaults(func=cmd_sim)


def _add_router(p: argparse.ArgumentParser) -> None:
    p.add_argument("--placement", default="load", choices=("load", "round_robin"))
    p.add_argument("--local-prefill-tokens", type=int, default=0)
    p.add_argument("--local-prefill-backlog-tokens", type=int, default=0)
    p.add_argument("--max-outstanding-requests", type=int, default=256)
    p.add_argument("--max-outstanding-prompt-tokens", type=int, default=262_144)


def _router(args: argparse.Namespace) -> RouterSettings:
    return RouterSettings(
        placement=args.placement, local_prefill_tokens=args.local_prefill_tokens,
        local_prefill_backlog_tokens=args.local_prefill_backlog_tokens,
        admission=AdmissionConfig(max_requests=args.max_outstanding_requests,
                                  max_prompt_tokens=args.max_outstanding_prompt_tokens),
    )


def _topology(args: argparse.Namespace, router: RouterSettings) -> SimTopology:
    if args.config:
        from cluster.config import ClusterConfig

        ClusterConfig.from_yaml(args.config)  # the file is a valid Tandem topology
        topo = SimTopology.from_yaml(args.config, router)
    else:
        topo = SimTopology(router=router)
    changes = {k: getattr(args, k, None) for k in ("prefill_workers", "decode_workers")}
    return topo.replace(**{k: v for k, v in changes.items() if v is not None})


def cmd_sim(args: argparse.Namespace) -> int:
    from sim.report import format_report, parse_slo, summary
    from sim.simulator import run
    from sim.workload import generate, load_trace, parse_spec, scaled

    cost = cost_model(args.device_kind, model_spec(args.model), args.profile, args.link)
    topo = _topology(args, _router(args))
    if args.trace:
        requests = scaled(load_trace(args.trace, args.run_index), args.rate_scale)
    else:
        requests = generate(parse_spec(args.workload))
    slo = parse_slo(args.slo) if args.slo else None
    result = run(topo, cost, requests)
    s = summary(result, slo)
    label = (f"{topo.prefill_workers}P+{topo.decode_workers}D" if not topo.colocated
             else f"colocated {topo.decode_workers}") + f" on {args.device_kind} ({cost.corrections.source} costs)"
    print(format_report(s, label))
    if args.result_json:  # with the queue lengths over time, one sample a simulated second
        Path(args.result_json).write_text(json.dumps({**s, "queue_samples": result.queue_samples}, indent=2))
        print(f"wrote {args.result_json}")
    return 0


def add_plan(sub) -> None:
    """The ``tandem plan`` subcommand."""
    p = sub.add_parser("plan", help=PLAN_HELP)
    p.add_argument("--slo", required=True,
                   help="ttft:MS and itl:MS (each request's mean time per token) or gap:MS[@SHARE] (its gaps "
                        "between tokens: every one, or that share, within MS) or both; e2e:MS optional")
    p.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet the SLO")
    p.add_argument("--rate", type=float, required=True, help="the request rate to serve (requests/s)")
    p.add_argument("--devices", type=int, required=True, help="devices (GPUs) to split into workers")
    p.add_argument("--workload", default="sharegpt", help="length mix, e.g. sharegpt or synthetic:in=1024,out=128")
    p.add_argument("--config", default=None, help="a topology YAML whose engine settings the candidates start from")
    _add_hardware(p)
    p.add_argument("--chunks", default="512,2048,8192", help="chunk budgets to try (max_num_batched_tokens)")
    p.add_argument("--batch-caps", default="64,256", help="batch caps to try (max_num_seqs)")
    p.add_argument("--explain", action="store_true",
                   help="say why the best won and what held back the runner-up (rates by side, batch, simulation)")
    p.add_argument("--tensor-parallel", default=None,
                   help="tensor_parallel_size values each role is searched over, e.g. 1,2,4 (default: the "
                        "smallest the model fits on one worker, for both roles)")
    p.add_argument("--max-unit", type=int, default=8, help="devices per simulated unit, at most")
    p.add_argument("--iters", type=int, default=5, help="bisection steps per candidate")
    p.add_argument("--trial-s", type=float, default=30.0, help="simulated seconds of arrivals counted per trial")
    p.add_argument("--warmup-s", type=float, default=30.0,
                   help="simulated seconds of arrivals before them, not counted (batches fill to a steady state)")
    p.add_argument("--low-rate", type=float, default=None,
                   help="also plan elastic pools (autoscaling bounds) for traffic between this rate and --rate")
    p.add_argument("--phase-s", type=float, default=300.0,
                   help="with --low-rate: each phase of the day simulated (low, ramp up, peak, ramp down, low)")
    p.add_argument("--worker-start-s", type=float, default=60.0,
                   help="with --low-rate: seconds from asking for a worker to its serving")
    p.add_argument("--scale-up-shares", default=None,
                   help="with --low-rate: scale_up_share values to try with each floor, e.g. 0,0.5,1 "
                        "(default: the controller's, from --config or 0.5)")
    p.add_argument("--out-dir", default=None, help="write topology.yaml and values.yaml here")
    p.add_argument("--json", default=None, help="write every candidate's numbers as JSON")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from sim.planner import PlanSettings, explain, plan
    from sim.report import parse_slo
    from sim.workload import parse_spec

    slo = parse_slo(args.slo, args.attainment)
    cost = cost_model(args.device_kind, model_spec(args.model), args.profile, args.link)
    # Admission is sized from the plan (Helm values), so it does not bind while searching.
    router = RouterSettings(admission=AdmissionConfig(max_requests=10**9, max_prompt_tokens=10**12))
    base = SimTopology.from_yaml(args.config, router) if args.config else SimTopology(router=router)
    spec = parse_spec(args.workload)
    settings = PlanSettings(chunks=_ints(args.chunks, "--chunks"), batch_caps=_ints(args.batch_caps, "--batch-caps"),
                            max_unit=args.max_unit, iters=args.iters, trial_s=args.trial_s, warmup_s=args.warmup_s,
                            tensor_parallel=_ints(args.tensor_parallel, "--tensor-parallel")
                            if args.tensor_parallel else None)
    if args.low_rate is not None and not 0 < args.low_rate < args.rate:
        raise ValueError(f"--low-rate must be > 0 and below --rate ({args.rate:g}), got {args.low_rate:g}")
    ups = _shares(args.scale_up_shares) if args.scale_up_shares is not None else ()

    def progress(ev, replicas):
        print(f"  {ev.candidate.label(replicas):40} estimate {ev.estimate * replicas:8.2f} req/s, "
              f"sustains {ev.rate * replicas:8.2f} req/s ({ev.trials} trials)", file=sys.stderr, flush=True)

    result = plan(args.devices, base, cost, spec, slo, settings, progress=progress)
    bounds = elastic_bounds(result, base, cost, spec, slo, args, ups) if args.low_rate is not None else None
    why = explain(result, base, cost, spec, slo) if args.explain and result.ranked else []
    print(format_plan(result, base, args, cost, bounds, why))
    if args.out_dir:
        write_plan(result, base, args, Path(args.out_dir), bounds)
    if args.json:
        Path(args.json).write_text(json.dumps(plan_record(result, bounds), indent=2))
    return 0


def elastic_bounds(result, base: SimTopology, cost, spec, slo, args: argparse.Namespace,
                   scale_up_shares: tuple[float, ...] = ()):
    """``sim.bounds.plan_bounds`` for the plan's best configuration over a day between
    ``--low-rate`` and ``--rate``; autoscaling as ``--config`` sets it, else the controller's
    defaults held to the plan's SLO; each floor with each of ``scale_up_shares``."""
    from sim.bounds import default_scaling, plan_bounds
    from sim.workload import RateProfile, generate_profile

    if not result.ranked or result.cluster_rate(result.best) <= 0:
        return None
    ceiling = result.best.candidate.topology(base, result.replicas).replace(worker_start_s=args.worker_start_s)
    profile = RateProfile.day(args.low_rate, args.rate, args.phase_s)
    requests = generate_profile(spec, profile)
    print(f"elastic pools: a day of 5 x {args.phase_s:g} s between {args.low_rate:g} and {args.rate:g} req/s, "
          f"{len(requests)} requests", file=sys.stderr, flush=True)

    def progress(t):
        print(f"  {_bounds_line(t)}", file=sys.stderr, flush=True)

    return plan_bounds(ceiling, result.cluster_rate(result.best), cost, requests, profile, slo,
                       base.autoscaling or default_scaling(slo), scale_up_shares=scale_up_shares,
                       progress=progress)


def _bounds_line(t) -> str:
    s = t.summary
    return (f"{t.label():44} SLO attainment {s['slo_attainment']:6.1%}, devices mean {s['mean_devices']:6.2f} "
            f"max {s['max_devices']:3}, {len(s['scaling_decisions'])} changes")


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} values must be >= 1, got {text!r}")
    return values


def _shares(text: str) -> tuple[float, ...]:
    """``--scale-up-shares``: comma-separated numbers in [0, 4] (``AutoscalingConfig``'s range)."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--scale-up-shares takes comma-separated numbers, got {text!r}") from None
    if not all(0 <= v <= 4 for v in values):
        raise ValueError(f"--scale-up-shares values must be in [0, 4], got {text!r}")
    return values


def best_topology(result, base: SimTopology, cost, bounds=None) -> SimTopology:
    """What the plan chose over all the devices (the elastic bounds' choice, with ``bounds``),
    its KV blocks written out explicitly."""
    topo = bounds.chosen.topology if bounds is not None else result.best.candidate.topology(base, result.replicas)
    roles = ("decode",) if topo.colocated else ("prefill", "decode")
    engines = {f"{role}_engine": {**getattr(topo, f"{role}_engine"), "num_kv_blocks": topo.kv_blocks(role, cost)[0]}
               for role in roles}
    if topo.colocated:
        engines["prefill_engine"] = {}
    return topo.replace(**engines)


def outstanding(result) -> int:
    """An admission bound that lets the planned load in: twice the requests in flight at the
    sustained rate (Little's law over the E2E p99), and never under the service's 256."""
    best = result.best
    s = best.whole or best.summary or {}
    e2e_s = ((s.get("e2e_ms") or {}).get("p99") or 0) / 1e3
    return max(256, math.ceil(2 * result.cluster_rate(best) * e2e_s))


def _model_note(model: str) -> str:
    return f"# planned for {model}: set model: to its checkpoint (a path or a registered name)"


def helm_values(topo: SimTopology, max_outstanding: int = 256) -> dict:
    """Helm values (deploy/helm/tandem) for ``topo``: one GPU a rank, a worker's ranks on one
    pod (the group's ``tensorParallelSize``, which the chart writes into the topology). With
    autoscaling, each worker group between its pool's bounds (the chart writes the topology's
    ``autoscaling:`` from them) and the pods starting at the pools' sizes."""
    topology = {**topo.to_topology(), "prefill_resources": {"num_cpus": 1, "num_gpus": 1},
                "decode_resources": {"num_cpus": 1, "num_gpus": 1}}
    for key in ("engine", "prefill_engine", "decode_engine"):  # the groups' values carry it
        if key in topology:
            topology[key] = {k: v for k, v in topology[key].items() if k != "tensor_parallel_size"}
    a = topology.pop("autoscaling", None) and topo.autoscaling
    pools = {}
    for role, n in (("prefill", topo.prefill_workers), ("decode", topo.decode_workers)):
        lo, hi = (a.bounds(role).min_workers, a.bounds(role).max_workers) if a and n else (n, n)
        # A colocated plan's prefill group holds no pod (the chart's groups have room for one at least).
        tp = topo.tensor_parallel_size(role) if n else 1
        pools[role] = {"replicas": n, "minReplicas": lo, "maxReplicas": max(hi, 1), "gpus": tp}
        if tp > 1:
            pools[role]["tensorParallelSize"] = tp
    values = {**pools, "serve": {"topology": topology, "maxOutstandingRequests": max_outstanding}}
    if a:
        values["autoscaling"] = {"enabled": True, "slo": {"ttftMs": a.slo.ttft_ms, "itlMs": a.slo.itl_ms},
                                 "intervalSeconds": a.interval_s, "scaleDownDelaySeconds": a.scale_down_delay_s,
                                 "scaleUpShare": a.scale_up_share,
                                 "drainTimeoutSeconds": a.drain_timeout_s}
        if a.allow_role_switch:  # a switched worker keeps its pod: both roles ask for one resource
            values["autoscaling"]["allowRoleSwitch"] = True
            values["serve"]["workerResources"] = {}
            for role in ("prefill", "decode"):  # None deletes the chart's per-role resource from the merge
                shared = {"tandem_worker": 1, f"tandem_{role}": None}
                values["serve"]["workerResources"][role] = values[role]["rayResources"] = shared
    return values


def format_plan(result, base: SimTopology, args: argparse.Namespace, cost, bounds=None,
                why: list[str] | None = None) -> str:
    """The plan's report: the best, the candidates ranked, the elastic bounds (``bounds``),
    why the best won (``why``: ``sim.planner.explain``), the topology file and Helm values."""
    import yaml

    if not result.ranked or result.cluster_rate(result.best) <= 0:
        return "no candidate met the SLO at any rate tried"
    r, best = result.replicas, result.best
    rate = result.cluster_rate(best)
    need = math.ceil(args.rate / rate * args.devices)
    lines = [f"best on {args.devices} x {args.device_kind} ({result.unit} devices a unit, {r} units): "
             f"{best.candidate.label(r)} sustains {rate:.2f} req/s "
             f"({'meets' if rate >= args.rate else 'short of'} --rate {args.rate:g}; "
             f"about {need} devices would serve it)"]
    for ev in result.ranked[:6]:
        lines.append(f"  {ev.candidate.label(r):40} {_rates(result, ev)}")
    split = next((e for e in result.ranked if not e.candidate.colocated), None)
    colo = next((e for e in result.ranked if e.candidate.colocated), None)
    if split is not None and colo is not None and result.cluster_rate(colo) > 0:
        lines.append(f"best disaggregated / best colocated: "
                     f"{result.cluster_rate(split) / result.cluster_rate(colo):.2f}x")
    if why:
        lines += ["", *why]
    if bounds is not None:
        lines += ["", *format_bounds(bounds, args)]
    topo = best_topology(result, base, cost, bounds)
    lines += ["", "# topology.yaml", _model_note(args.model),
              yaml.safe_dump(topo.to_topology(), sort_keys=False).rstrip(),
              "", "# Helm values", _model_note(args.model),
              yaml.safe_dump(helm_values(topo, outstanding(result)), sort_keys=False).rstrip()]
    return "\n".join(lines)


def format_bounds(bounds, args: argparse.Namespace) -> list[str]:
    """The elastic step's lines: every configuration simulated over the day, and the choice."""
    lines = [f"elastic pools over a day between {args.low_rate:g} and {args.rate:g} req/s "
             f"(5 phases of {args.phase_s:g} s; a worker serves {args.worker_start_s:g} s after it is asked for):"]
    lines += [f"  {_bounds_line(t)}" for t in [bounds.fixed, *bounds.trials]]
    if bounds.chosen is bounds.fixed:
        lines.append("no floor below the peak pools met the SLO over the day for fewer device-seconds: "
                     "the pools stay fixed")
    else:
        lines.append(f"chosen: {bounds.chosen.label()}, {bounds.saved:.0%} fewer device-seconds than fixed pools")
    return lines


def write_plan(result, base: SimTopology, args: argparse.Namespace, out: Path, bounds=None) -> None:
    import yaml

    out.mkdir(parents=True, exist_ok=True)
    cost = cost_model(args.device_kind, model_spec(args.model), args.profile, args.link)
    topo = best_topology(result, base, cost, bounds)
    note = _model_note(args.model) + "\n"
    (out / "topology.yaml").write_text(note + yaml.safe_dump(topo.to_topology(), sort_keys=False))
    (out / "values.yaml").write_text(note + yaml.safe_dump(helm_values(topo, outstanding(result)), sort_keys=False))
    print(f"wrote {out / 'topology.yaml'} and {out / 'values.yaml'}")


def _rates(result, ev) -> str:
    by_units = f"{ev.rate * result.replicas:8.2f} req/s by units"
    if ev.whole_rate is None:
        return by_units
    w = ev.whole
    return (f"{by_units}, {ev.whole_rate:8.2f} simulated whole (SLO attainment {w['slo_attainment']:.1%}, "
            f"TTFT p90 {w['ttft_ms']['p90']:.0f} ms, TPOT p90 {w['tpot_ms']['p90']:.1f} ms)")


def plan_record(result, bounds=None) -> dict:
    """Every evaluated candidate's numbers (per the whole cluster), for ``--json``; with
    ``bounds``, each elastic configuration's summary over the day."""
    r = result.replicas
    out = {"unit": result.unit, "replicas": r, "candidates": [
        {"config": ev.candidate.label(r), "estimate": ev.estimate * r, "sustained_rate_by_units": ev.rate * r,
         "sustained_rate_whole": ev.whole_rate, "trials": ev.trials, "summary": ev.summary, "whole": ev.whole}
        for ev in result.ranked]}
    if bounds is not None:
        out["elastic"] = {"chosen": bounds.chosen.label(), "saved_device_s_share": bounds.saved,
                          "configs": [{"config": t.label(), "floor_share": t.share, "summary": t.summary}
                                      for t in [bounds.fixed, *bounds.trials]]}
    return out
