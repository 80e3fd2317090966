"""What the simulator replays: requests with an arrival time, a prompt and an output length.

Pure: a seeded ``random.Random``, no clock. Three sources:

- a recorded trace: the serving benchmark's result JSON (``bench.serve --result-json``:
  each run's per-request records, ``sent_s``, ``prompt_tokens``,
  ``requested_output_tokens``) or a JSON-lines file of ``{"arrival_s", "prompt_tokens",
  "output_tokens"}`` (``write_trace`` writes one);
- a workload spec (``parse_spec``), e.g. ``sharegpt:n=2000,rate=20,seed=0``:

  * ``sharegpt``: ShareGPT-shaped lengths, not the dataset (nothing is downloaded):
    lognormal prompt and output lengths with the means the vLLM paper reports for
    ShareGPT (161 prompt, 338 output tokens), cut by vLLM's ShareGPT filters (4 to 1024
    prompt tokens, at most 2048 in all);
  * ``synthetic``: uniform within ``in``/``out`` x (1 +- ``range``) (``load.workloads.synthetic``);
  * ``long-mix``: synthetic with a share ``long`` of ``long_len``-token prompts.

  Arrivals are ``load.workloads.arrival_times`` (gamma gaps, ``burstiness`` 1 = Poisson;
  ``rate=inf`` sends everything at 0).

Prompt token ids are distinct per request (no prefix is shared by accident) unless the
trace says otherwise (``prefix`` groups: requests of a group share their first
``prefix_len`` tokens).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

from load.workloads import SHAREGPT_MAX_PROMPT_TOKENS, SHAREGPT_MAX_TOTAL_TOKENS, arrival_times, length_range

SHAREGPT_MEAN_PROMPT = 161
SHAREGPT_MEAN_OUTPUT = 338
LOGNORMAL_SIGMA = 1.0
TOKEN_SPACE = 1 << 31


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request to replay: when it arrives (seconds from the start), its lengths, and the
    prompt-sharing group it belongs to (-1: none)."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_group: int = -1
    prefix_len: int = 0

    def prompt_ids(self, index: int) -> list[int]:
        """Token ids: a group's shared prefix, then ids that no other request has."""
        head = []
        if self.prefix_group >= 0:
            base = (self.prefix_group + 1) * 104_729 % TOKEN_SPACE
            head = [(base + j) % TOKEN_SPACE for j in range(min(self.prefix_len, self.prompt_tokens))]
        start = (index * 7_919 + 1_000_003) % TOKEN_SPACE
        return head + [(start + j) % TOKEN_SPACE for j in range(self.prompt_tokens - len(head))]


@dataclass(frozen=True)
class WorkloadSpec:
    """A parsed ``--workload`` spec: its kind and settings."""

    kind: str
    n: int = 1000
    rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0
    input_len: int = 512
    output_len: int = 128
    range_ratio: float = 0.0
    long_fraction: float = 0.1
    long_len: int = 4096

    def with_rate(self, rate: float, n: int | None = None) -> WorkloadSpec:
        return replace(self, rate=rate, n=self.n if n is None else n)


KINDS = ("sharegpt", "synthetic", "long-mix")
SPEC_KEYS = {"n": ("n", int), "rate": ("rate", float), "burstiness": ("burstiness", float), "seed": ("seed", int),
             "in": ("input_len", int), "out": ("output_len", int), "range": ("range_ratio", float),
             "long": ("long_fraction", float), "long_len": ("long_len", int)}


def parse_spec(text: str) -> WorkloadSpec:
    """``kind[:key=value,...]``; ValueError names an unknown kind or key."""
    kind, _, rest = text.partition(":")
    if kind not in KINDS:
        raise ValueError(f"workload kind must be one of {KINDS}, got {kind!r}")
    values: dict = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in SPEC_KEYS:
            raise ValueError(f"workload setting {item!r}: expected key=value with key in {sorted(SPEC_KEYS)}")
        name, conv = SPEC_KEYS[key]
        values[name] = conv(value)
    spec = WorkloadSpec(kind, **values)
    if spec.n < 1:
        raise ValueError(f"workload n must be >= 1, got {spec.n}")
    return spec


def sharegpt_lengths(rng: random.Random) -> tuple[int, int]:
    """One ShareGPT-shaped (prompt, output) pair, redrawn until vLLM's filters keep it."""
    mu_in = math.log(SHAREGPT_MEAN_PROMPT) - LOGNORMAL_SIGMA**2 / 2
    mu_out = math.log(SHAREGPT_MEAN_OUTPUT) - LOGNORMAL_SIGMA**2 / 2
    while True:
        p = round(rng.lognormvariate(mu_in, LOGNORMAL_SIGMA))
        o = round(rng.lognormvariate(mu_out, LOGNORMAL_SIGMA))
        if 4 <= p <= SHAREGPT_MAX_PROMPT_TOKENS and o >= 4 and p + o <= SHAREGPT_MAX_TOTAL_TOKENS:
            return p, o


def generate(spec: WorkloadSpec) -> list[SimRequest]:
    """The spec's requests, in arrival order (same spec, same requests)."""
    rng = random.Random(spec.seed)
    times = arrival_times(spec.n, spec.rate, spec.burstiness, rng)
    return [SimRequest(t, p, o) for t, (p, o) in zip(times, _lengths(spec, len(times), rng))]


def _lengths(spec: WorkloadSpec, n: int, rng: random.Random) -> list[tuple[int, int]]:
    """``n`` (prompt, output) lengths of the spec's kind."""
    if spec.kind == "sharegpt":
        return [sharegpt_lengths(rng) for _ in range(n)]
    in_lo, in_hi = length_range(spec.input_len, spec.range_ratio)
    out_lo, out_hi = length_range(spec.output_len, spec.range_ratio)
    lengths = [(rng.randint(in_lo, in_hi), rng.randint(out_lo, out_hi)) for _ in range(n)]
    if spec.kind == "long-mix":
        long_at = set(rng.sample(range(n), round(n * spec.long_fraction)))
        lengths = [(spec.long_len, o) if i in long_at else (p, o) for i, (p, o) in enumerate(lengths)]
    return lengths


@dataclass(frozen=True)
class RateProfile:
    """A request rate that changes over time: segments of ``(seconds, rate at the start,
    rate at the end)``, the rate linear within each (equal ends: a constant rate)."""

    segments: tuple[tuple[float, float, float], ...]

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("a rate profile needs at least one segment")
        for seconds, r0, r1 in self.segments:
            if not (seconds > 0 and r0 >= 0 and r1 >= 0 and r0 + r1 > 0):
                raise ValueError(f"a profile segment needs seconds > 0 and rates >= 0 (not both 0), "
                                 f"got {(seconds, r0, r1)}")

    @classmethod
    def day(cls, low: float, peak: float, phase_s: float) -> RateProfile:
        """``low`` for ``phase_s``, a ramp up for as long, ``peak`` for as long, a ramp down, ``low`` again."""
        return cls(((phase_s, low, low), (phase_s, low, peak), (phase_s, peak, peak), (phase_s, peak, low),
                    (phase_s, low, low)))

    @property
    def duration_s(self) -> float:
        return sum(seconds for seconds, _, _ in self.segments)

    @property
    def peak(self) -> float:
        return max(max(r0, r1) for _, r0, r1 in self.segments)

    @property
    def low(self) -> float:
        return min(min(r0, r1) for _, r0, r1 in self.segments)

    def expected(self) -> float:
        """The mean number of arrivals over the whole profile."""
        return sum(seconds * (r0 + r1) / 2 for seconds, r0, r1 in self.segments)

    def time_at(self, count: float) -> float:
        """When the mean number of arrivals since the start reaches ``count`` (the inverse of
        the rate's integral); past the profile's end, ``inf``."""
        t = 0.0
        for seconds, r0, r1 in self.segments:
            area = seconds * (r0 + r1) / 2
            if count <= area:
                a = (r1 - r0) / (2 * seconds)  # count = r0 x + a x^2 within the segment
                if abs(a) < 1e-12:
                    return t + count / r0
                return t + (math.sqrt(r0 * r0 + 4 * a * count) - r0) / (2 * a)
            count -= area
            t += seconds
        return math.inf


def generate_profile(spec: WorkloadSpec, profile: RateProfile) -> list[SimRequest]:
    """The spec's lengths arriving at the profile's changing rate (``spec.n`` and
    ``spec.rate`` are not used): gaps drawn at rate 1 as ``arrival_times`` draws them
    (gamma, shape ``burstiness``), then moved onto the profile's clock (``time_at``), the
    time-rescaling of a renewal process."""
    if spec.burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {spec.burstiness}")
    rng = random.Random(spec.seed)
    expected, count, times = profile.expected(), 0.0, []
    while count <= expected:
        times.append(profile.time_at(count))
        count += rng.gammavariate(spec.burstiness, 1.0 / spec.burstiness)
    return [SimRequest(at, p, o) for at, (p, o) in zip(times, _lengths(spec, len(times), rng))]


def load_trace(path: str | Path, run: int = 0) -> list[SimRequest]:
    """A recorded trace: a ``bench.serve`` result JSON (its ``run``-th run) or JSON lines."""
    text = Path(path).read_text()
    if text.lstrip().startswith("{") and '"runs"' in text[:100_000]:
        doc = json.loads(text)
        runs = doc.get("runs") or []
        if not 0 <= run < len(runs):
            raise ValueError(f"{path}: has {len(runs)} runs, no run {run}")
        records = runs[run]["requests"]
        out = [SimRequest(r["sent_s"], r["prompt_tokens"], r["requested_output_tokens"]) for r in records]
    else:
        out = []
        for i, line in enumerate(filter(str.strip, text.splitlines())):
            r = json.loads(line)
            try:
                out.append(SimRequest(float(r["arrival_s"]), int(r["prompt_tokens"]), int(r["output_tokens"]),
                                      int(r.get("prefix_group", -1)), int(r.get("prefix_len", 0))))
            except KeyError as e:
                raise ValueError(f"{path}:{i + 1}: a trace line needs {e.args[0]!r}") from None
    return sorted(out, key=lambda r: r.arrival_s)


def write_trace(path: str | Path, requests: list[SimRequest]) -> None:
    """JSON lines that ``load_trace`` reads back."""
    lines = (json.dumps({"arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens,
                         "output_tokens": r.output_tokens, "prefix_group": r.prefix_group,
                         "prefix_len": r.prefix_len}) for r in requests)
    Path(path).write_text("\n".join(lines) + "\n")


def scaled(requests: list[SimRequest], rate_factor: float) -> list[SimRequest]:
    """The same requests with arrival times divided by ``rate_factor`` (a faster replay)."""
    return [replace(r, arrival_s=r.arrival_s / rate_factor) for r in requests]
