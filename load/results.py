"""A serving run's results as a client sees them: one ``RequestResult`` per request (TTFT,
ITL gaps, E2E, tokens), an ``Slo``, and the run's summary (``summarize``: throughputs,
goodput under the SLO, latency percentiles as vLLM's benchmark reports them;
``format_summary`` prints it)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds."""

    index: int
    group: str
    prompt_tokens: int
    requested_output_tokens: int
    sent_s: float = 0.0  # from the start of the run
    ok: bool = False
    error: str | None = None  # the failure's kind: "http_429", "resource_exhausted", "timeout", ...
    message: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int = 0

    def gaps_within(self, limit_s: float) -> float:
        """The share of this request's gaps between tokens at most ``limit_s`` (1 without gaps)."""
        if not self.itl_s:
            return 1.0
        return sum(gap <= limit_s for gap in self.itl_s) / len(self.itl_s)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def record_stream(self, start: float, chunk_times: Sequence[float], end: float) -> None:
        """Latencies from the send time, the arrival time of every token-carrying chunk,
        and the end of the stream (all on one clock)."""
        self.e2e_s = end - start
        if chunk_times:
            self.ttft_s = chunk_times[0] - start
            self.itl_s = [b - a for a, b in zip(chunk_times, chunk_times[1:])]

    def fail(self, kind: str, message: str = "") -> None:
        self.ok, self.error, self.message = False, kind, message[:500]

    def to_json(self) -> dict:
        return {**asdict(self), "tpot_s": self.tpot_s}


@dataclass(frozen=True)
class Slo:
    """Service-level objectives a request must meet, in milliseconds (None: not constrained):
    its time to first token, its mean time per output token after the first (``tpot``), its
    end to end time, and its gaps between tokens: at least ``gap_share`` of them (1: every
    one) at most ``gap_ms``. The mean hides the stall a prefill chunk puts between two tokens
    of every decode in its step; the gaps do not. Goodput counts a request only when it
    meets all of them (DistServe's definition); ``parse_slo`` reads them from a flag."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    gap_ms: float | None = None
    gap_share: float = 1.0

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2e_ms", "gap_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"an SLO must be > 0 ms, got {name.removesuffix('_ms')} {value}")
        if not 0 < self.gap_share <= 1:
            raise ValueError(f"the share of gaps within the limit must be in (0, 1], got {self.gap_share}")

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms, self.gap_ms))

    def met_by(self, r: RequestResult) -> bool:
        return r.ok and all(
            limit is None or value is None or value * 1000 <= limit
            for limit, value in ((self.ttft_ms, r.ttft_s), (self.tpot_ms, r.tpot_s), (self.e2e_ms, r.e2e_s))
        ) and (self.gap_ms is None or r.gaps_within(self.gap_ms / 1000) >= self.gap_share)

    def __str__(self) -> str:
        items = [f"{k}:{getattr(self, f'{k}_ms'):g}" for k in ("ttft", "tpot", "e2e") if getattr(self, f"{k}_ms")]
        if self.gap_ms is not None:
            items.append(f"gap:{self.gap_ms:g}" + (f"@{self.gap_share:g}" if self.gap_share < 1 else ""))
        return ",".join(items)


SLO_KEYS = ("ttft", "tpot", "itl", "e2e", "gap")


def parse_slo(text: str) -> Slo:
    """``KEY:MS`` items, separated by commas or spaces: ``ttft``, ``tpot`` (``itl`` is the
    same: a request's mean time per token), ``e2e``, and ``gap:MS`` (every gap between two
    tokens) or ``gap:MS@SHARE`` (that share of them, e.g. ``gap:15@0.99``). ValueError names
    the item that is wrong."""
    limits: dict[str, float] = {}
    share = 1.0
    for item in filter(None, text.replace(" ", ",").split(",")):
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"SLO item {item!r}: expected KEY:MS with KEY one of {', '.join(SLO_KEYS)}")
        key = "tpot" if key == "itl" else key
        if key in limits:
            raise ValueError(f"SLO {text!r} names {key} twice")
        ms, at, rest = value.partition("@")
        try:
            limits[key] = float(ms)
            if at:
                if key != "gap":
                    raise ValueError
                share = float(rest)
        except ValueError:
            raise ValueError(f"SLO item {item!r}: expected a number of ms"
                             + (" (and @SHARE only after gap:MS)" if at else "")) from None
    return Slo(**{f"{k}_ms": v for k, v in limits.items()}, gap_share=share)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's
    default, which vLLM's numbers use)."""
    return percentiles(values, (q,))[0]


def percentiles(values: Sequence[float], qs: Sequence[float]) -> list[float]:
    """``percentile`` at each of ``qs``, sorting ``values`` once."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    out = []
    for q in qs:
        pos = (len(ordered) - 1) * q / 100
        lo = math.floor(pos)
        hi = min(lo + 1, len(ordered) - 1)
        out.append(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))
    return out


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    if not values_s:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    ms = [v * 1000 for v in values_s]
    median, p90, p99 = percentiles(ms, (50, 90, 99))
    return {"mean": sum(ms) / len(ms), "median": median, "p90": p90, "p99": p99}


def summarize(results: Sequence[RequestResult], duration_s: float, slo: Slo) -> dict:
    """The run's numbers; throughputs count completed requests only, over the whole run
    (first send to last completion)."""
    done = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.output_tokens for r in done)
    return {
        "duration_s": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": dict(Counter(r.error for r in results if not r.ok)),
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "cached_prompt_tokens": sum(r.cached_tokens for r in done),
        "request_throughput": len(done) / duration_s,
        "output_throughput": output / duration_s,
        "total_token_throughput": (prompt + output) / duration_s,
        "goodput": sum(slo.met_by(r) for r in done) / duration_s if slo else None,
        "ttft_ms": distribution_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": distribution_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in done if r.e2e_s is not None]),
    }


def format_summary(summary: dict, rate: str) -> str:
    def num(v: float | None, fmt: str = ".2f") -> str:
        return "-" if v is None else format(v, fmt)

    lines = [
        f"==== request rate {rate} ====",
        f"completed / failed:          {summary['completed']} / {summary['failed']}"
        + (f"  {summary['errors']}" if summary["errors"] else ""),
        f"duration (s):                {num(summary['duration_s'])}",
        f"requests/s:                  {num(summary['request_throughput'])}",
        f"output tokens/s:             {num(summary['output_throughput'])}",
        f"total tokens/s:              {num(summary['total_token_throughput'])}",
        f"prompt tokens (cached):      {summary['total_input_tokens']} ({summary['cached_prompt_tokens']})",
    ]
    if summary["goodput"] is not None:
        lines.append(f"goodput (requests/s):        {num(summary['goodput'])}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = summary[key]
        lines.append(
            f"{key.split('_')[0].upper():<5} ms mean / median / p90 / p99: "
            f"{num(d['mean'])} / {num(d['median'])} / {num(d['p90'])} / {num(d['p99'])}"
        )
    return "\n".join(lines)
