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
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from cluster.local import local_ray

COMPARISONS = ("batching", "topology", "prefix")
SERVE = ("python", "-m", "bench.serve")
REPORT_JSON = "report.json"
REPORT_MD = "report.md"
OFFLINE_LINK = "../BENCHMARKS.md#offline-throughput-engine-vs-hugging-face-transformers"

# A configuration's condensed result: one entry per request rate (None: it failed).
Results = Mapping[str, "Sequence[dict] | None"]


# -- what runs --------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One configuration: a label and its ``bench.serve`` flags (output paths aside)."""

    label: str
    flags: tuple[str, ...]

    def argv(self, result_json: Path) -> list[str]:
        return [*self.flags, "--label", self.label, "--result-json", str(result_json)]

    def command(self, result_json: Path) -> str:
        """The command line that repeats this run on its own."""
        return shlex.join([*SERVE, *self.argv(result_json)])


@dataclass(frozen=True)
class Comparison:
    """One comparison of the report: the runs it compares (sharing workload flags and seed), its
    title and setup for the markdown, and the goodput SLO, if any."""

    key: str
    title: str
    setup: str  # workload, topology and load, for the markdown
    runs: tuple[Run, ...]
    slo_ms: Mapping[str, float] = field(default_factory=dict)  # goodput SLO, if any


@dataclass(frozen=True)
class Sizes:
    """How much work each comparison sends: the full report, or a smoke check."""

    batching_requests: int
    topology_requests: int  # per request rate
    topology_rates: tuple[float, ...]
    prefix_requests: int


# The full report takes about 15-20 minutes on 2 idle cores, a fifth of it starting
# services (about 15 s each); --quick about 3.
FULL = Sizes(batching_requests=128, topology_requests=80, topology_rates=(1, 2, 3, 4, 6),
             prefix_requests=100)
QUICK = Sizes(batching_requests=16, topology_requests=8, topology_rates=(2, 6), prefix_requests=8)

COMMON_FLAGS = ("--launch", "--no-progress", "--seed", "0")
# The built-in model's context: without chunked prefill one step's budget must hold
# the longest prompt.
MODEL_MAX_LEN = 2048

# batching: the engine's batch is capped so that the queue outlasts one batch and
# continuous batching has slots to refill.
BATCHING_MAX_SEQS = 32
# Tokens per step with chunked prefill: what bounds the stall a long prompt causes.
# In engine-only trials on this workload 256 cut ITL p99 about 4x at no measurable
# throughput cost; 128 cut it further for ~10% more steps.
CHUNK_BUDGET = 256
BATCHING_WORKLOAD = (
    "--workload", "long-mix", "--input-len", "128", "--output-len", "128", "--range-ratio", "0.9",
    "--long-len", "1500", "--long-fraction", "0.1", "--request-rate", "inf",
)
# topology: two workers either way, one per core of the development machine, which
# serves about 4 of these requests/s; the rates bracket that.
TOPOLOGY_WORKLOAD = (
    "--workload", "synthetic", "--input-len", "256", "--output-len", "64", "--range-ratio", "0.25",
)
# Several times what one request sees on an idle machine (TTFT ~150 ms, TPOT ~15 ms).
TOPOLOGY_SLO_MS = {"ttft": 1000.0, "tpot": 50.0}
# A fresh 1000-token prefill takes ~450 ms on one thread, 900 cached + 100 new ~50 ms:
# at 1 req/s the uncached server is busy but keeps up.
PREFIX_RATE = 1.0
PREFIX_WORKLOAD = (
    "--workload", "shared-prefix", "--num-prefix-groups", "4", "--prefix-len", "900",
    "--suffix-len", "100", "--output-len", "32",
)


def _engine(**settings: object) -> tuple[str, ...]:
    flags: list[str] = []
    for key, value in settings.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        flags += ["--engine", f"{key}={text}"]
    return tuple(flags)


def batching_comparison(sizes: Sizes) -> Comparison:
    base = (
        *COMMON_FLAGS, *BATCHING_WORKLOAD, "--num-requests", str(sizes.batching_requests),
        "--prefill-workers", "0", "--decode-workers", "1", *_engine(max_num_seqs=BATCHING_MAX_SEQS),
    )
    whole = dict(enable_chunked_prefill=False, max_num_batched_tokens=MODEL_MAX_LEN)
    chunked = dict(enable_chunked_prefill=True, max_num_batched_tokens=CHUNK_BUDGET)
    return Comparison(
        key="batching",
        title="Static vs continuous batching vs continuous batching with chunked prefill",
        setup=(
            f"{sizes.batching_requests} long-mix requests sent at once to one colocated worker "
            f"(`max_num_seqs={BATCHING_MAX_SEQS}`): 90% prompts of 13-243 tokens, 10% of 1500 "
            "tokens, outputs of 13-243 tokens. Static: a batch forms only when nothing runs and "
            "runs to its end. Without chunked prefill a step's budget is "
            f"{MODEL_MAX_LEN} tokens (the model's context); with it, {CHUNK_BUDGET}."
        ),
        runs=(
            Run("static", (*base, *_engine(batching="static", **whole))),
            Run("continuous", (*base, *_engine(batching="continuous", **whole))),
            Run("continuous-chunked", (*base, *_engine(batching="continuous", **chunked))),
        ),
    )


def topology_comparison(sizes: Sizes) -> Comparison:
    rates = ",".join(f"{r:g}" for r in sizes.topology_rates)
    slo = [f"{key}:{ms:g}" for key, ms in TOPOLOGY_SLO_MS.items()]
    base = (*COMMON_FLAGS, *TOPOLOGY_WORKLOAD, "--num-requests", str(sizes.topology_requests),
            "--request-rate", rates, "--goodput", *slo)
    slo_text = ", ".join(f"{key.upper()} <= {ms:g} ms" for key, ms in TOPOLOGY_SLO_MS.items())
    return Comparison(
        key="topology",
        title="Colocated vs disaggregated (1 prefill + 1 decode) over request rates",
        setup=(
            f"{sizes.topology_requests} synthetic requests per rate (Poisson arrivals at {rates} "
            "req/s; prompts of 192-320 tokens, outputs of 48-80 tokens). Both configurations run "
            "two workers with one torch thread each: two colocated workers, each doing prefill "
            f"and decode, against one prefill and one decode worker. Goodput SLO: {slo_text}."
        ),
        runs=(
            Run("colocated", (*base, "--prefill-workers", "0", "--decode-workers", "2")),
            Run("disaggregated", (*base, "--prefill-workers", "1", "--decode-workers", "1")),
        ),
        slo_ms=dict(TOPOLOGY_SLO_MS),
    )


def prefix_comparison(sizes: Sizes) -> Comparison:
    base = (*COMMON_FLAGS, *PREFIX_WORKLOAD, "--num-requests", str(sizes.prefix_requests),
            "--request-rate", f"{PREFIX_RATE:g}", "--prefill-workers", "0", "--decode-workers", "1")
    return Comparison(
        key="prefix",
        title="Prefix caching on vs off",
        setup=(
            f"{sizes.prefix_requests} shared-prefix requests (Poisson arrivals at {PREFIX_RATE:g} "
            "req/s) to one colocated worker: 4 groups, each prompt a 900-token group prefix plus "
            "a unique 100-token suffix (90% shared), outputs of 32 tokens."
        ),
        runs=(
            Run("prefix-cache-on", (*base, *_engine(enable_prefix_caching=True))),
            Run("prefix-cache-off", (*base, *_engine(enable_prefix_caching=False))),
        ),
    )


BUILDERS: dict[str, Callable[[Sizes], Comparison]] = {
    "batching": batching_comparison,
    "topology": topology_comparison,
    "prefix": prefix_comparison,
}


def plan(quick: bool, only: Sequence[str] = COMPARISONS) -> list[Comparison]:
    sizes = QUICK if quick else FULL
    return [BUILDERS[key](sizes) for key in COMPARISONS if key in only]


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


# -- from results to numbers (pure) ------------------------------------------------------


def slo_attainment(requests: Sequence[Mapping], slo_ms: Mapping[str, float]) -> float | None:
    """The share of all sent requests that completed within every SLO (a latency the
    request has none of, such as the TPOT of a one-token output, meets its SLO)."""
    if not requests or not slo_ms:
        return None
    met = 0
    for r in requests:
        values = {"ttft": r.get("ttft_s"), "tpot": r.get("tpot_s"), "e2e": r.get("e2e_s")}
        met += bool(r.get("ok")) and all(
            values[key] is None or values[key] * 1000 <= limit for key, limit in slo_ms.items()
        )
    return met / len(requests)


def tokens_per_chunk(requests: Sequence[Mapping]) -> float | None:
    """Output tokens per streamed chunk over the completed requests. 1 means every token
    went out on its own; more means tokens waited and were merged (the engine merges
    what a slow reader has not taken yet), which delays TTFT and hides ITL."""
    done = [r for r in requests if r.get("ok") and r.get("ttft_s") is not None]
    chunks = sum(len(r.get("itl_s", ())) + 1 for r in done)
    return sum(r.get("output_tokens", 0) for r in done) / chunks if chunks else None


def condense(result: Mapping, slo_ms: Mapping[str, float]) -> list[dict]:
    """A ``bench.serve`` result without its per-request records: one entry per request
    rate, its summary plus what only the records tell (SLO attainment, chunking)."""
    return [
        {"request_rate": run["request_rate"], "summary": run["summary"],
         "slo_attainment": slo_attainment(run.get("requests", []), slo_ms),
         "tokens_per_chunk": tokens_per_chunk(run.get("requests", []))}
        for run in result["runs"]
    ]


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


@dataclass(frozen=True)
class Check:
    """One derived number of the report, against its target when it has one."""

    name: str
    value: float | None
    target: str | None = None  # ">= 2" or "<= 0.1"
    unit: str = "x"  # "x" (a ratio), "%" (a share) or a unit printed after the value

    @property
    def met(self) -> bool | None:
        if self.value is None or self.target is None:
            return None
        op, bound = self.target.split()
        return self.value >= float(bound) if op == ">=" else self.value <= float(bound)

    def _show(self, value: float | None) -> str:
        if value is None:
            return "-"
        if self.unit == "%":
            return f"{value:.0%}"
        if self.unit == "x":
            return f"{value:.2f}x"
        return f"{value:g} {self.unit}"

    def text(self) -> str:
        shown = f"{self.name}: **{self._show(self.value)}**"
        if self.target is None:
            return shown
        op, bound = self.target.split()
        verdict = {True: "met", False: "**not met**", None: "not measured"}[self.met]
        return f"{shown} (target {op} {self._show(float(bound))}: {verdict})"

    def to_json(self) -> dict:
        return {**asdict(self), "met": self.met, "text": self.text()}


def _first(runs: Results, label: str) -> dict | None:
    """The summary of a single-rate configuration, or None when it failed."""
    entries = runs.get(label)
    return entries[0]["summary"] if entries else None


def _per_chunk(runs: Results, label: str) -> float | None:
    entries = runs.get(label)
    return entries[0].get("tokens_per_chunk") if entries else None


def _get(summary: Mapping | None, *path: str) -> float | None:
    value = summary
    for key in path:
        if value is None:
            return None
        value = value.get(key)
    return value


def batching_checks(runs: Results) -> list[Check]:
    labels = ("static", "continuous", "continuous-chunked")
    static, cont, chunked = (_first(runs, label) for label in labels)

    def tput(s: Mapping | None) -> float | None:
        return _get(s, "output_throughput")

    def itl99(s: Mapping | None) -> float | None:
        return _get(s, "itl_ms", "p99")

    kept = ratio(tput(chunked), tput(cont))
    return [
        Check("output tokens/s, continuous / static", ratio(tput(cont), tput(static)), ">= 2"),
        Check("ITL p99, static / continuous+chunked", ratio(itl99(static), itl99(chunked)), ">= 3"),
        Check("ITL p99, continuous / continuous+chunked", ratio(itl99(cont), itl99(chunked)),
              ">= 3"),
        Check("throughput cost of chunking, 1 - chunked / continuous",
              None if kept is None else 1 - kept, "<= 0.1", unit="%"),
    ]


def prefix_checks(runs: Results) -> list[Check]:
    on, off = _first(runs, "prefix-cache-on"), _first(runs, "prefix-cache-off")
    return [
        Check(f"TTFT {stat}, cache off / on",
              ratio(_get(off, "ttft_ms", key), _get(on, "ttft_ms", key)), ">= 3")
        for stat, key in (("mean", "mean"), ("p50", "median"), ("p99", "p99"))
    ]


def topology_checks(runs: Results) -> list[Check]:
    """No target: the highest swept rate each topology holds at 90% SLO attainment."""
    return [
        Check(f"highest swept rate with >= 90% of requests within the SLO, {label}",
              max_rate_within_slo(runs.get(label)), unit="req/s")
        for label in ("colocated", "disaggregated")
    ]


def max_rate_within_slo(entries: Sequence[dict] | None, share: float = 0.9) -> float | None:
    """The highest rate of a sweep at which ``share`` of the requests met the SLO (and
    every lower rate did too); None when not even the lowest did."""
    best = None
    for entry in sorted(entries or [], key=lambda e: float(e["request_rate"])):
        if entry.get("slo_attainment") is None or entry["slo_attainment"] < share:
            break
        best = float(entry["request_rate"])
    return best


CHECKS: dict[str, Callable[[Results], list[Check]]] = {
    "batching": batching_checks,
    "topology": topology_checks,
    "prefix": prefix_checks,
}


# -- markdown (pure) ----------------------------------------------------------------------


def fmt(value: float | None, spec: str = ".1f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _done(s: Mapping) -> str:
    return f"{s['completed']}/{s['completed'] + s['failed']}"


def _failed_row(first: Sequence[str], width: int) -> list[str]:
    return [*first, "failed", *["-"] * (width - len(first) - 1)]


def _label_table(
    runs: Results, headers: Sequence[str], row: Callable[[str, Mapping], list[str]]
) -> str:
    """A table of one row per config: ``row(label, its first run's summary)``, or a
    failed row where the config has none."""
    rows = []
    for label in runs:
        s = _first(runs, label)
        rows.append(_failed_row([label], len(headers)) if s is None else row(label, s))
    return markdown_table(headers, rows)


def batching_table(runs: Results) -> str:
    headers = ["config", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
               "TPOT p99 ms", "tokens/chunk", "completed", "duration s"]

    def row(label: str, s: Mapping) -> list[str]:
        return [
            label, fmt(s["output_throughput"]),
            fmt(s["ttft_ms"]["median"], ".0f"), fmt(s["ttft_ms"]["p99"], ".0f"),
            fmt(s["itl_ms"]["median"]), fmt(s["itl_ms"]["p99"]), fmt(s["tpot_ms"]["p99"]),
            fmt(_per_chunk(runs, label), ".2f"), _done(s), fmt(s["duration_s"]),
        ]

    return _label_table(runs, headers, row)


def topology_table(runs: Results) -> str:
    headers = ["rate req/s", "config", "req/s done", "output tok/s", "TTFT p50 ms", "TTFT p99 ms",
               "ITL p50 ms", "ITL p99 ms", "tokens/chunk", "goodput req/s", "SLO met", "completed"]
    rates = sorted({e["request_rate"] for entries in runs.values() for e in entries or []},
                   key=float)
    rows = []
    for rate in rates:
        for label, entries in runs.items():
            match = [e for e in entries or [] if e["request_rate"] == rate]
            if not match:
                rows.append(_failed_row([rate, label], len(headers)))
                continue
            s, met, per_chunk = (match[0].get(k) for k in ("summary", "slo_attainment",
                                                             "tokens_per_chunk"))
            rows.append([
                rate, label, fmt(s["request_throughput"], ".2f"), fmt(s["output_throughput"]),
                fmt(s["ttft_ms"]["median"], ".0f"), fmt(s["ttft_ms"]["p99"], ".0f"),
                fmt(s["itl_ms"]["median"]), fmt(s["itl_ms"]["p99"]), fmt(per_chunk, ".2f"),
                fmt(s["goodput"], ".2f"),
                "-" if met is None else f"{met:.0%}", _done(s),
            ])
    return markdown_table(headers, rows)


def prefix_table(runs: Results) -> str:
    headers = ["config", "TTFT mean ms", "TTFT p50 ms", "TTFT p99 ms", "cached prompt tokens",
               "tokens/chunk", "output tok/s", "completed"]

    def row(label: str, s: Mapping) -> list[str]:
        cached = ratio(s["cached_prompt_tokens"], s["total_input_tokens"])
        return [
            label, fmt(s["ttft_ms"]["mean"], ".0f"), fmt(s["ttft_ms"]["median"], ".0f"),
            fmt(s["ttft_ms"]["p99"], ".0f"), "-" if cached is None else f"{cached:.0%}",
            fmt(_per_chunk(runs, label), ".2f"), fmt(s["output_throughput"]), _done(s),
        ]

    return _label_table(runs, headers, row)


TABLES: dict[str, Callable[[Results], str]] = {
    "batching": batching_table,
    "topology": topology_table,
    "prefix": prefix_table,
}


def render_markdown(report: Mapping) -> str:
    """``report.md`` from ``report.json`` alone."""
    m = report["machine"]
    quick = ", **--quick: a smoke check, not numbers to publish**" if report["quick"] else ""
    out = [
        "# Serving comparisons",
        "",
        f"Generated by `{report['command']}` on {report['started']} "
        f"({report['wall_s']:.0f} s{quick}).",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['cores_usable']} usable), "
        f"{m['memory_gib']} GiB, {m['platform']}; Python {m['python']}, torch {m['torch']}, "
        f"Ray {m['ray']}; commit {m['git_commit']}. Each worker runs torch with one thread (the "
        "cluster default); the client, router and Ray share the same cores. Model: the built-in "
        "tandem-tiny-llama (12.6M parameters, float32).",
        "",
        "The offline comparison against Hugging Face transformers is `tandem bench offline`; "
        f"see [Offline throughput]({OFFLINE_LINK}). It is not rerun here.",
        "",
        "Latencies are taken at the client, as `tandem bench serve` defines them. "
        "*tokens/chunk* is output tokens per streamed chunk: 1.00 means every token was sent "
        "on its own; more means tokens were held back and sent together, which delays TTFT "
        "and hides stalls from ITL (one chunk of k tokens is one ITL sample).",
    ]
    for key, comp in report["comparisons"].items():
        runs = {r["label"]: r["rates"] for r in comp["runs"]}
        out += ["", f"## {comp['title']}", "", comp["setup"], "", TABLES[key](runs), ""]
        out += [f"- {c['text']}" for c in comp["checks"]] + [""]
        if comp.get("plot"):
            out += [f"![{key}]({comp['plot']})", ""]
        loads = ", ".join(f"{r['label']} {fmt(r['load_before'])} -> {fmt(r['load_after'])}"
                          for r in comp["runs"])
        out += [f"Load average (1 min) before -> after each run: {loads}.", ""]
        failed = [f"{r['label']}: {r['error']}" for r in comp["runs"] if r["error"]]
        if failed:
            out += ["Failed: " + "; ".join(failed), ""]
        out += ["Commands, one per configuration (from the repository root):", "", "```"]
        out += [r["command"] for r in comp["runs"]] + ["```"]
    return "\n".join(out) + "\n"


# -- plots ---------------------------------------------------------------------------------


def _samples(result: Mapping | None, metric: str) -> list[float]:
    """Milliseconds of one latency over every completed request of every rate."""
    if result is None:
        return []
    done = [r for run in result["runs"] for r in run["requests"] if r["ok"]]
    if metric == "ITL":
        return [gap * 1000 for r in done for gap in r["itl_s"]]
    return [r["ttft_s"] * 1000 for r in done if r["ttft_s"] is not None]


def _cdf(ax, values: Sequence[float], label: str) -> None:
    values = sorted(values)
    if values:
        fractions = [(i + 1) / len(values) for i in range(len(values))]
        ax.step(values, fractions, where="post", label=label)


def _cdf_panel(ax, metric: str, raw: Mapping[str, Mapping | None]) -> None:
    for label, result in raw.items():
        _cdf(ax, _samples(result, metric), label)
    ax.set_xscale("log")
    ax.set_title(f"{metric} CDF")
    ax.set_xlabel(f"{metric} (ms, log scale)")
    ax.set_ylabel("fraction")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def plot_batching(runs: Results, raw: Mapping[str, Mapping | None], path: Path) -> Path:
    from bench import plots  # the Agg backend, chosen before pyplot loads

    fig, (bar, ttft, itl) = plots.plt.subplots(1, 3, figsize=(15, 4), constrained_layout=True)
    labels = list(runs)
    bar.bar(labels, [_get(_first(runs, k), "output_throughput") or 0 for k in labels])
    bar.set_title("output tokens/s")
    _cdf_panel(ttft, "TTFT", raw)
    _cdf_panel(itl, "ITL", raw)
    return plots._save(fig, path)


def plot_topology(runs: Results, path: Path, slo_ms: Mapping[str, float]) -> Path:
    from bench import plots

    slo = ", ".join(f"{k} {v:g} ms" for k, v in slo_ms.items())
    panels = (
        ("p99 TTFT (ms)", ("ttft_ms", "p99")),
        ("p99 ITL (ms)", ("itl_ms", "p99")),
        (f"goodput (req/s), SLO {slo}", ("goodput",)),
    )
    fig, axes = plots.plt.subplots(1, 3, figsize=(15, 4), constrained_layout=True)
    for ax, (title, key) in zip(axes, panels):
        for label, entries in runs.items():
            points = [(float(e["request_rate"]), _get(e["summary"], *key)) for e in entries or []]
            points = [(x, y) for x, y in points if y is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=label)
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title, fontsize="medium")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return plots._save(fig, path)


def plot_prefix(raw: Mapping[str, Mapping | None], path: Path) -> Path:
    from bench import plots

    fig, ax = plots.plt.subplots(figsize=(6, 4), constrained_layout=True)
    _cdf_panel(ax, "TTFT", raw)
    return plots._save(fig, path)


def write_plot(key: str, comp: Mapping, raw: Mapping[str, Mapping | None],
               out_dir: Path) -> str | None:
    runs = {r["label"]: r["rates"] for r in comp["runs"]}
    if not any(runs.values()):
        return None
    path = out_dir / f"{key}.png"
    if key == "batching":
        plot_batching(runs, raw, path)
    elif key == "topology":
        plot_topology(runs, path, comp["slo_ms"])
    else:
        plot_prefix(raw, path)
    return path.name


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
