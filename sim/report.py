"""A simulated run in the serving benchmark's terms: its per-request records and summary.

Each replayed request becomes a ``load.results.RequestResult`` (TTFT, ITL gaps and E2E
from its arrival, on the simulated clock) and the run is summarized by
``load.results.summarize``, so simulated and measured runs print and compare alike.
To that the simulator adds preemptions, steps, queue lengths over time and autoscaling
decisions.

Goodput here counts a request that meets every target of the SLO (``load.results.Slo``:
TTFT, mean time per output token, E2E, and the share of its gaps between tokens under a
limit); a configuration *sustains* a load when at least ``attainment`` of the requests meet
all of them (DistServe's SLO attainment).
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.autoscaler import decision_text
from load.results import RequestResult, Slo, format_summary, summarize
from load.results import parse_slo as parse_bench_slo
from sim.simulator import Record, SimResult


@dataclass(frozen=True)
class SloTarget:
    """The planner's and ``tandem sim``'s targets: a TTFT limit, and a mean time per token
    (``itl_ms``, as each request's TPOT) or a limit on its gaps between tokens (``gap_ms``,
    every one or ``gap_share`` of them) or both, with an optional E2E limit, in ms; and the
    share of requests that must meet them all (``attainment``)."""

    ttft_ms: float
    itl_ms: float | None = None
    attainment: float = 0.9
    gap_ms: float | None = None
    gap_share: float = 1.0
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        if self.itl_ms is None and self.gap_ms is None:
            raise ValueError("an SLO needs a per-token limit: itl:MS (a request's mean) or gap:MS (its gaps)")
        _ = self.bench_slo  # the limits' own checks (``Slo``)
        if not 0 < self.attainment <= 1:
            raise ValueError(f"SLO attainment must be in (0, 1], got {self.attainment}")

    @property
    def bench_slo(self) -> Slo:
        return Slo(ttft_ms=self.ttft_ms, tpot_ms=self.itl_ms, e2e_ms=self.e2e_ms, gap_ms=self.gap_ms,
                   gap_share=self.gap_share)

    @property
    def step_ms(self) -> float:
        """The longest a decode step may take and still meet the per-token targets."""
        return min(v for v in (self.itl_ms, self.gap_ms) if v is not None)


def parse_slo(text: str, attainment: float = 0.9) -> SloTarget:
    """``ttft:MS`` and ``itl:MS`` (or ``tpot:MS``) or ``gap:MS[@SHARE]`` or both, optionally
    ``e2e:MS`` (``load.results.parse_slo``); ValueError names what is missing or wrong."""
    slo = parse_bench_slo(text)
    if slo.ttft_ms is None or (slo.tpot_ms is None and slo.gap_ms is None):
        raise ValueError(f"--slo needs ttft:MS and itl:MS or gap:MS (or both), got {text!r}")
    return SloTarget(slo.ttft_ms, slo.tpot_ms, attainment, slo.gap_ms, slo.gap_share, slo.e2e_ms)


def request_result(rec: Record) -> RequestResult:
    """The benchmark's record of one simulated request."""
    req = rec.req
    result = RequestResult(rec.index, "", req.prompt_tokens, req.output_tokens, sent_s=req.arrival_s)
    if rec.error is not None or rec.end_s is None:
        result.fail(rec.error or "unfinished")
        return result
    result.ok = True
    result.output_tokens = len(rec.token_times)
    result.cached_tokens = rec.cached_tokens
    result.record_stream(req.arrival_s, list(rec.token_times), rec.end_s)
    return result


def summary(result: SimResult, slo: SloTarget | None = None, since_s: float = 0.0) -> dict:
    """``load.results.summarize``'s numbers for the run, plus the simulator's own: preemptions,
    steps, queue peaks, SLO attainment, CPU time, autoscaling decisions. With ``since_s``
    the requests' numbers are those of the requests sent from then on (the ones before
    warmed the workers up); the workers' counts are the whole run's."""
    records = [r for r in result.records if r.req.arrival_s >= since_s] if since_s > 0 else result.records
    results = [request_result(r) for r in records]
    sent = [r.req.arrival_s for r in records]
    ends = [r.end_s for r in records if r.end_s is not None]
    duration = (max(ends) - min(sent)) if ends and sent else 0.0
    out = summarize(results, max(duration, 1e-9), slo.bench_slo if slo else Slo())
    done = [r for r in results if r.ok]
    if slo is not None:
        met = sum(slo.bench_slo.met_by(r) for r in results)
        out["slo_attainment"] = met / len(results) if results else 0.0
    out["warmup_requests"] = len(result.records) - len(records)
    out["num_preemptions"] = result.num_preemptions
    out["num_steps"] = result.num_steps
    out["local_prefills"] = result.local_prefills
    out["max_devices"] = result.num_devices_max
    out["device_s"] = result.device_s
    out["mean_devices"] = result.device_s / result.end_s if result.end_s > 0 else float(result.num_devices_max)
    out["sim_cpu_s"] = result.sim_cpu_s
    out["completed_tokens"] = sum(r.output_tokens for r in done)
    out["queues"] = queue_peaks(result.queue_samples)
    out["scaling_decisions"] = [{"t": t, "action": d.action, "role": d.role, "count": d.count, "reason": d.reason}
                                for t, d in result.scaling_decisions]
    return out


def queue_peaks(samples: list[dict]) -> dict:
    """The largest and the mean of each sampled queue length over the run."""
    keys = sorted({k for s in samples for k in s if k != "t"})
    out = {}
    for k in keys:
        values = [s[k] for s in samples if k in s]
        out[k] = {"max": max(values), "mean": sum(values) / len(values)} if values else None
    return out


def format_report(s: dict, label: str) -> str:
    """The benchmark's text summary, then the simulator's lines."""
    lines = [format_summary(s, label)]
    if "slo_attainment" in s:
        lines.append(f"SLO attainment:              {s['slo_attainment']:.1%}")
    lines.append(f"preemptions:                 {s['num_preemptions']}")
    lines.append(f"steps simulated:             {s['num_steps']} in {s['sim_cpu_s']:.2f} s of CPU")
    for key in ("prefill_waiting", "decode_waiting", "decode_running", "decode_kv_usage"):
        q = s["queues"].get(key)
        if q:
            lines.append(f"{key + ' (max / mean):':29}{q['max']:.3g} / {q['mean']:.3g}")
    for d in s["scaling_decisions"][-10:]:
        lines.append(f"  t={d['t']:8.1f} s  {decision_text(d)}")
    return "\n".join(lines)
