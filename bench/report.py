"""The serving comparisons of the performance report, in one program.

    python -m bench.report [--out-dir docs/bench] [--quick] [--only batching,prefix]

Every configuration is one ``bench.serve --launch`` command line, recorded in the
report so that any run can be repeated on its own. The configurations of a comparison
share their workload flags and ``--seed``, so they are sent identical requests.

* ``batching``: static vs continuous vs continuous + chunked prefill, on a long-mix
  workload sent all at once to one colocated worker: output tokens/s, TTFT, ITL.
* ``topology``: colocated workers vs 1 prefill + 1 decode worker (the same number of
  workers, so the same cores), over a sweep of request rates: p99 TTFT and ITL, and
  goodput under an SLO.
* ``prefix``: prefix caching on vs off on a shared-prefix workload whose prompts are
  90% shared: TTFT.
* The offline engine-vs-transformers comparison is ``tandem bench offline``; the
  report links to it and does not rerun it.

Ray starts once per process, so by default every configuration runs in this process
over one local Ray, the service started and stopped around each (``bench.serve``
joins a Ray its process already started). ``--isolate`` runs each configuration as
its own ``python -m bench.serve`` process instead: slower to start, nothing shared.
A configuration that fails is recorded as failed and the others still run.

Writes into ``--out-dir``: ``report.json`` (machine, commands, every run's summary and
the ratios), ``report.md`` (the tables, ready for docs/BENCHMARKS.md), one PNG per
comparison, and ``raw/<label>.json``, each run's full ``bench.serve`` result with its
per-request records. ``--render-only`` rewrites the markdown and plots from those files.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path

# The report's parts beside this program: what runs (bench/report_plan.py), the numbers
# from the results (bench/report_checks.py), the markdown and plots (bench/report_render.py).
# The names tests and other programs use are imported from here.
from bench.report_checks import (
    CHECKS,
    batching_checks,
    condense,
    max_rate_within_slo,
    prefix_checks,
    ratio,
    slo_attainment,
    tokens_per_chunk,
)
from bench.report_plan import (
    CHUNK_BUDGET,
    COMPARISONS,
    FULL,
    MODEL_MAX_LEN,
    QUICK,
    Comparison,
    Run,
    batching_comparison,
    plan,
    topology_comparison,
)
from bench.report_render import (
    batching_table,
    fmt,
    markdown_table,
    prefix_table,
    render_markdown,
    topology_table,
    write_plot,
)
from cluster.local import local_ray

__all__ = [
    "CHUNK_BUDGET", "FULL", "MODEL_MAX_LEN", "QUICK", "Run", "batching_checks", "batching_comparison",
    "batching_table", "build_report", "condense", "fmt", "main", "markdown_table", "max_rate_within_slo", "plan",
    "prefix_checks", "prefix_table", "ratio", "render_markdown", "slo_attainment", "tokens_per_chunk",
    "topology_comparison", "topology_table",
]

REPORT_JSON = "report.json"
REPORT_MD = "report.md"


# -- running ----------------------------------------------------------------------------


def machine_info() -> dict:
    """What the numbers were measured on."""
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        kib = Path("/proc/meminfo").read_text().split("\n", 1)[0].split()[1]
        mem_gib = round(int(kib) / 2**20, 1)

    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": usable,
        "memory_gib": mem_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "ray": version("ray"),
        "git_commit": _git_commit(),
    }


def _git_commit() -> str | None:
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10)

    try:
        head, status = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "-uno")
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + (" (with uncommitted changes)" if status.stdout.strip() else "")


def _load() -> float:
    """The 1-minute load average: other work on the machine shows in the numbers."""
    return round(os.getloadavg()[0], 1)


def run_one(run: Run, raw_dir: Path, isolate: bool) -> dict:
    """Run one configuration; returns its record (the result stays in ``raw_dir``)."""
    path = raw_dir / f"{run.label}.json"
    path.unlink(missing_ok=True)
    record = {"label": run.label, "command": run.command(path), "load_before": _load(),
              "error": None}
    print(f"\n## {run.label}: {record['command']}", flush=True)
    t0 = time.perf_counter()
    try:
        if isolate:
            argv = [sys.executable, "-m", "bench.serve", *run.argv(path)]
            rc = subprocess.run(argv).returncode
        else:
            from bench import serve

            rc = serve.main(run.argv(path))
        if rc != 0:
            record["error"] = f"bench.serve exited with status {rc}"
    except (Exception, SystemExit) as e:  # one broken configuration must not lose the others
        record["error"] = f"{type(e).__name__}: {e}"
    record["wall_s"] = round(time.perf_counter() - t0, 1)
    record["load_after"] = _load()
    if record["error"] is None and not path.is_file():
        record["error"] = "bench.serve wrote no result"
    if record["error"]:
        print(f"!! {run.label} failed: {record['error']}", file=sys.stderr, flush=True)
    return record


def run_comparisons(
    comparisons: Sequence[Comparison], out_dir: Path, isolate: bool
) -> dict[str, list[dict]]:
    raw_dir = out_dir / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    records: dict[str, list[dict]] = {}
    # One local Ray for every in-process run; worker logs stay in Ray's log folder.
    with contextlib.nullcontext() if isolate else local_ray(metrics_kind="report", log_to_driver=False):
        for comparison in comparisons:
            records[comparison.key] = [run_one(run, raw_dir, isolate) for run in comparison.runs]
    return records


# -- the report ------------------------------------------------------------------------------


def load_raw(out_dir: Path, label: str) -> dict | None:
    path = out_dir / "raw" / f"{label}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def build_report(comparisons: Sequence[Comparison], records: Mapping[str, Sequence[dict]],
                 out_dir: Path, header: Mapping) -> dict:
    """``report.json``'s content: the records, each run's condensed result, the checks."""
    out = {**header, "comparisons": {}}
    for comp in comparisons:
        runs = []
        for record in records[comp.key]:
            raw = None if record["error"] else load_raw(out_dir, record["label"])
            runs.append({**record, "rates": condense(raw, comp.slo_ms) if raw else None})
        checks = CHECKS[comp.key]({r["label"]: r["rates"] for r in runs})
        out["comparisons"][comp.key] = {
            "title": comp.title, "setup": comp.setup, "slo_ms": dict(comp.slo_ms), "runs": runs,
            "checks": [c.to_json() for c in checks],
        }
    return out


def write_outputs(report: dict, out_dir: Path) -> None:
    """The plots (from ``raw/``), then ``report.json`` and ``report.md``."""
    for key, comp in report["comparisons"].items():
        raw = {r["label"]: load_raw(out_dir, r["label"]) for r in comp["runs"]}
        try:
            comp["plot"] = write_plot(key, comp, raw, out_dir)
        except Exception as e:  # a plot must not cost the numbers
            print(f"!! plot for {key} failed: {type(e).__name__}: {e}", file=sys.stderr)
            comp["plot"] = None
    (out_dir / REPORT_JSON).write_text(json.dumps(report, indent=2))
    (out_dir / REPORT_MD).write_text(render_markdown(report))
    print(f"wrote {out_dir / REPORT_JSON}, {out_dir / REPORT_MD} and the plots", flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="docs/bench", help="default: docs/bench")
    ap.add_argument("--quick", action="store_true",
                    help="few requests per configuration: a smoke check")
    ap.add_argument("--only", default=",".join(COMPARISONS),
                    help=f"comma-separated subset of {','.join(COMPARISONS)} (default: all)")
    ap.add_argument("--isolate", action="store_true",
                    help="run each configuration as its own python -m bench.serve process")
    ap.add_argument("--render-only", action="store_true",
                    help="rewrite report.md and the plots from --out-dir's report.json and raw/")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    only = [k.strip() for k in args.only.split(",") if k.strip()]
    if not only or set(only) - set(COMPARISONS):
        ap.error(f"--only takes a subset of {','.join(COMPARISONS)}, got {args.only!r}")
    out_dir = Path(args.out_dir)
    if args.render_only:
        path = out_dir / REPORT_JSON
        if not path.is_file():
            ap.error(f"--render-only: no {path}")
        write_outputs(json.loads(path.read_text()), out_dir)
        return 0
    comparisons = plan(args.quick, only)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    records = run_comparisons(comparisons, out_dir, args.isolate)
    header = {
        "command": shlex.join(["python", "-m", "bench.report", *argv]),
        "started": started, "wall_s": round(time.perf_counter() - t0, 1), "quick": args.quick,
        "isolate": args.isolate, "machine": machine_info(),
    }
    report = build_report(comparisons, records, out_dir, header)
    write_outputs(report, out_dir)
    failed = [r["label"] for c in report["comparisons"].values() for r in c["runs"] if r["error"]]
    if failed:
        print(f"failed configurations: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
