"""What the performance report runs: its comparisons, each a set of ``bench.serve --launch``
configurations (``Run``) that share workload flags and seed, at the full size or ``--quick``.

``bench/report.py`` is the program that runs them and writes the report; the numbers and
checks derived from the results are in ``bench/report_checks.py``, the markdown and plots in
``bench/report_render.py``.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

COMPARISONS = ("batching", "topology", "prefix")
SERVE = ("python", "-m", "bench.serve")


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
