"""The soak test's report: the run's JSON (``build_report``), its markdown summary
(``markdown``) and its plot (``write_plot``)."""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

from bench.soak_samples import LATENCY_KEYS, Tally
from bench.soak_verdict import MB, TrendRule, judge

if TYPE_CHECKING:
    from bench.soak import Soak


def build_report(args: argparse.Namespace, outcome: dict, timings: dict, rule: TrendRule) -> dict:
    run: Soak = outcome["run"]
    load_s = run.times.get("load_end", args.duration_s)
    settle_s = run.times["settled"] - run.times["drained"] if "settled" in run.times else None
    verdict, rss_j, block_j = judge(run.samples, load_s, run.final_blocks, run.tally.totals["hung"], rule,
                                    settle_s)
    errored = run.tally.totals["errored"]
    if errored:
        verdict.warnings.append(f"{errored} request(s) failed: {dict(run.tally.errors)}")
    # By finish time; the last third takes the window that closes the load, the drain's do not count.
    last = max((s["t"] for s in run.samples if s["phase"] == "load"), default=load_s) + 0.001
    thirds = [(0.0, load_s / 3), (load_s / 3, 2 * load_s / 3), (2 * load_s / 3, last)]
    return {
        "started": timings["started"],
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "config": {k: v for k, v in vars(args).items()},
        "rule": rule.describe(),
        "capacity": outcome["capacity"],
        "plan": outcome["plan"],
        "timings_s": {**{k: round(v, 1) for k, v in run.times.items()},
                      **{k: round(v, 1) for k, v in timings.items() if k != "started"}},
        "counts": {"sent": run.tally.sent, **{k: run.tally.totals[k] for k in Tally.OUTCOMES},
                   "errors": dict(run.tally.errors)},
        "latency": dict(zip(("start", "middle", "end"), (run.tally.percentiles_between(a, b) for a, b in thirds))),
        "final_blocks": run.final_blocks,
        "verdict": {"result": verdict.label, "failures": verdict.failures, "warnings": verdict.warnings},
        "rss": [j.to_json() for j in rss_j],
        "blocks": [j.to_json() for j in block_j],
        "samples": run.samples,
    }


def _num(v, fmt=".1f") -> str:
    return "-" if v is None else format(v, fmt)


def markdown(report: dict) -> str:
    load = [s for s in report["samples"] if s["phase"] in ("baseline", "load")]
    lines = [*_md_setup(report), *_md_rss(report, load), *_md_blocks(report, load), *_md_latency(report),
             *_md_outcome(report)]
    return "\n".join(lines)


def _md_setup(report: dict) -> list[str]:
    plan, cap, config = report["plan"], report["capacity"], report["config"]
    rate = f"{plan['rate']:.2f} req/s" + (f" ({config['capacity_fraction']:g} x measured capacity "
                                          f"{cap['requests_per_s']:.2f} req/s)" if cap else "")
    return [
        f"### Soak: {report['verdict']['result']}",
        "",
        f"{plan['duration_s']:g} s of Poisson load at {rate}, {plan['input_len']}-token prompts, "
        f"{plan['output_len']}-token outputs (±{plan['range_ratio']:.0%}), {plan['cancel_fraction']:.0%} cancelled "
        f"mid-request; {config['prefill_workers']} prefill + {config['decode_workers']} decode "
        f"worker(s), `{config['kv_transfer_backend']}` transfer, {report['machine']['cpus']} CPUs; "
        f"sampled every {config['sample_s']:g} s. Started {report['started']}.",
    ]


def _md_rss(report: dict, load: list[dict]) -> list[str]:
    lines = ["", "| process | RSS start (MB) | RSS end of load (MB) | RSS after drain (MB) | slope, 2nd half (MB/min) "
                 "| projected over the load (MB) | |",
             "|---|---:|---:|---:|---:|---:|---|"]
    final = report["samples"][-1]["rss"]
    for j in report["rss"]:
        name = j["name"]
        first = next((s["rss"][name]["rss"] for s in load if name in s["rss"]), None)
        last = next((s["rss"][name]["rss"] for s in reversed(load) if name in s["rss"]), None)
        slope = j["trend"]["slope"] * 60 / MB if j["trend"] else None
        mark = ("ok" if j["ok"] else "**GROWS**") if j["judged"] else "not judged"
        lines.append(
            f"| {name} | {_num(first and first / MB)} | {_num(last and last / MB)} | "
            f"{_num(final[name]['rss'] / MB if name in final else None)} | {_num(slope, '+.2f')} | "
            f"{_num(j['projected'] / MB if j['projected'] is not None else None, '+.1f')} | {mark} |"
        )
    return lines


def _md_blocks(report: dict, load: list[dict]) -> list[str]:
    lines = ["", "| worker | KV pool (blocks) | blocks in use: mean | max | slope (blocks/min) | after drain | |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for j in report["blocks"]:
        values = [s["blocks"][j["name"]] for s in load if j["name"] in s["blocks"]]
        pool = next((s["workers"][j["name"]]["num_blocks"] for s in reversed(load)
                     if j["name"] in s.get("workers", {})), None)
        after = (report["final_blocks"] or {}).get(j["name"])
        ok = j["ok"] and after == 0
        mean = sum(values) / len(values) if values else None
        slope = j["trend"]["slope"] * 60 if j["trend"] else None
        lines.append(
            f"| {j['name']} | {_num(pool, 'd')} | {_num(mean)} | {max(values, default='-')} | "
            f"{_num(slope, '+.2f')} | {_num(after, 'd')} | {'ok' if ok else '**FAIL**'} |"
        )
    return lines


def _md_latency(report: dict) -> list[str]:
    lines = ["", "| requests finished in | requests | TTFT p50 (ms) | TTFT p99 (ms) | ITL p99 (ms) "
                 "| E2E p99 (ms) |",
             "|---|---:|---:|---:|---:|---:|"]
    for part, p in report["latency"].items():
        lines.append(f"| the {part} third of the load | {p['requests']} | {_num(p['ttft_p50_ms'])} | "
                     f"{_num(p['ttft_p99_ms'])} | {_num(p['itl_p99_ms'])} | {_num(p['e2e_p99_ms'])} |")
    return lines


def _md_outcome(report: dict) -> list[str]:
    counts, t = report["counts"], report["timings_s"]
    failures = {w: v["transfer_failures"] for w, v in report["samples"][-1].get("workers", {}).items()
                if v.get("transfer_failures")}
    lines = [
        "",
        f"KV transfer failures (incl. reservations expired by their deadline): {failures or 'none'}.",
        f"Requests: {counts['sent']} sent, {counts['completed']} completed, {counts['cancelled']} cancelled "
        f"(+{counts['cancel_missed']} finished before their cancel point), {counts['rejected']} rejected (429), "
        f"{counts['errored']} errored{' ' + str(counts['errors']) if counts['errors'] else ''}, "
        f"{counts['hung']} hung.",
        f"Wall time: {t.get('total', 0):.0f} s (startup {t.get('startup', 0):.0f} s, capacity "
        f"{t.get('capacity', 0):.0f} s, load {t.get('load_end', 0):.0f} s, drain "
        f"{t.get('drained', 0) - t.get('load_end', 0):.1f} s, blocks to 0 "
        f"{t.get('settled', 0) - t.get('drained', 0):.1f} s, shutdown {t.get('shutdown', 0):.0f} s).",
        "",
        f"Rule: {report['rule']}",
        "",
        f"**{report['verdict']['result']}**",
    ]
    lines += [f"- FAIL: {f}" for f in report["verdict"]["failures"]]
    lines += [f"- warning: {w}" for w in report["verdict"]["warnings"]]
    return lines


def write_plot(report: dict, path: Path) -> Path:
    """RSS per process, blocks in use (and requests in flight), and window latency
    percentiles over time: three stacked panels."""
    from bench import plots  # sets the Agg backend

    plt = plots.plt
    samples = report["samples"]
    ts = [s["t"] for s in samples]
    fig, (ax_rss, ax_blocks, ax_lat) = plt.subplots(3, 1, figsize=(11, 12), sharex=True, constrained_layout=True)
    for name in sorted({p for s in samples for p in s["rss"]}):
        points = [(s["t"], s["rss"][name]["rss"] / MB) for s in samples if name in s["rss"]]
        start = points[0][1]
        ax_rss.plot([t for t, _ in points], [v - start for _, v in points], marker=".",
                    label=f"{name} (from {start:.0f} MB)")
    ax_rss.set_ylabel("RSS change (MB)")
    ax_rss.set_title("resident memory per process, change since the start")
    ax_rss.legend(fontsize="small", ncol=3)
    for worker in sorted({w for s in samples for w in s["blocks"]}):
        points = [(s["t"], s["blocks"][worker]) for s in samples if worker in s["blocks"]]
        ax_blocks.plot(*zip(*points), marker=".", label=f"{worker} blocks in use")
    ax_blocks.plot(ts, [s["in_flight"] for s in samples], color="gray", linestyle="--", label="requests in flight")
    ax_blocks.set_ylabel("count")
    ax_blocks.set_title("KV blocks in use per worker, requests in flight")
    ax_blocks.legend(fontsize="small")
    for key in LATENCY_KEYS:
        points = [(s["t"], s["window"][key]) for s in samples if s["window"][key] is not None]
        if points:
            ax_lat.plot(*zip(*points), marker=".", label=key.replace("_ms", "").replace("_", " "))
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("ms")
    ax_lat.set_title("latency of the requests finished in each window")
    ax_lat.set_xlabel("seconds from the start of the load")
    ax_lat.legend(fontsize="small")
    load_end = report["timings_s"].get("load_end")
    for ax in (ax_rss, ax_blocks, ax_lat):
        ax.grid(alpha=0.3)
        if load_end is not None:
            ax.axvline(load_end, color="black", linewidth=0.8, linestyle=":")
    fig.suptitle(f"Tandem soak: {report['verdict']['result']}")
    return plots._save(fig, path)
