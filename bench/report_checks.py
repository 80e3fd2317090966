"""The performance report's numbers from its runs' results (pure): each configuration's
condensed result (``condense``: per request rate, the summary, SLO attainment and tokens per
chunk) and each comparison's derived numbers against their targets (``Check``, ``CHECKS``).

``bench/report.py`` condenses the raw ``bench.serve`` results with these and stores the
checks in ``report.json``; ``bench/report_render.py`` reads the condensed results back
(``first_summary``, ``summary_value``) for the tables and plots.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

# A configuration's condensed result: one entry per request rate (None: it failed).
Results = Mapping[str, "Sequence[dict] | None"]


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


def first_summary(runs: Results, label: str) -> dict | None:
    """The summary of a single-rate configuration, or None when it failed."""
    entries = runs.get(label)
    return entries[0]["summary"] if entries else None


def first_tokens_per_chunk(runs: Results, label: str) -> float | None:
    """The tokens per streamed chunk of a single-rate configuration, or None when it failed."""
    entries = runs.get(label)
    return entries[0].get("tokens_per_chunk") if entries else None


def summary_value(summary: Mapping | None, *path: str) -> float | None:
    """``summary[path[0]][path[1]]...``, or None where a level is missing."""
    value = summary
    for key in path:
        if value is None:
            return None
        value = value.get(key)
    return value


def batching_checks(runs: Results) -> list[Check]:
    labels = ("static", "continuous", "continuous-chunked")
    static, cont, chunked = (first_summary(runs, label) for label in labels)

    def tput(s: Mapping | None) -> float | None:
        return summary_value(s, "output_throughput")

    def itl99(s: Mapping | None) -> float | None:
        return summary_value(s, "itl_ms", "p99")

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
    on, off = first_summary(runs, "prefix-cache-on"), first_summary(runs, "prefix-cache-off")
    return [
        Check(f"TTFT {stat}, cache off / on",
              ratio(summary_value(off, "ttft_ms", key), summary_value(on, "ttft_ms", key)), ">= 3")
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
