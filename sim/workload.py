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
    if spec.kind == "sharegpt":
        lengths = [sharegpt_lengths(rng) for _ in range(spec.n)]
    else:
        in_lo, in_hi = length_range(spec.input_len, spec.range_ratio)
        out_lo, out_hi = length_range(spec.output_len, spec.range_ratio)
        lengths = [(rng.randint(in_lo, in_hi), rng.randint(out_lo, out_hi)) for _ in range(spec.n)]
        if spec.kind == "long-mix":
            long_at = set(rng.sample(range(spec.n), round(spec.n * spec.long_fraction)))
            lengths = [(spec.long_len, o) if i in long_at else (p, o) for i, (p, o) in enumerate(lengths)]
    return [SimRequest(t, p, o) for t, (p, o) in zip(times, lengths)]


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
