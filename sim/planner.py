"""The planner: which prefill:decode split, chunk budget and batch cap serve the most load
under latency SLOs on N devices of one kind.

The search, for a workload's length mix and an ``SloTarget``:

1. **Units.** N devices are split into N / U identical units of U devices (U the
   largest divisor of N up to ``max_unit``); a unit is simulated at 1 / (N / U) of the
   rate, as the router spreads load evenly over like workers. The best configuration is
   then simulated whole (``verify``).
2. **Rate matching** (the prune): for every split (p prefill + d decode workers, p + d =
   U) the cost model estimates what a prefill worker and a decode worker each sustain
   (prefill: tokens a step of the chunk budget computes; decode: the largest batch whose
   step stays under the ITL limit and whose KV fits), and the unit's capacity is the
   smaller side. Splits within ``keep_share`` of the best estimate are kept (at most
   ``keep``), and the colocated unit (all U workers run requests whole) always is.
3. **Bisection**: for each kept split and each chunk budget and batch cap, the highest
   request rate whose simulation meets the SLO (``SloTarget.attainment`` of the requests
   sent after a warm-up meet both limits), to ``iters`` halvings of the bracket around
   the estimate.

Candidates are ranked by the rate they sustain (the goodput the N devices serve); the best
disaggregated and the best colocated one are simulated whole and rank first, by that rate.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from sim.cost import CostModel, StepShape, decode_shape
from sim.report import SloTarget, summary
from sim.simulator import run
from sim.topology import SimTopology
from sim.workload import WorkloadSpec, generate, sharegpt_lengths


@dataclass(frozen=True)
class Candidate:
    """One configuration of a unit: pool sizes, the chunk budget (``max_num_batched_tokens`` of the
    workers that prefill), the batch cap (``max_num_seqs`` of the workers that decode) and each
    role's ``tensor_parallel_size`` (a worker takes that many devices)."""

    prefill_workers: int
    decode_workers: int
    chunk: int
    max_num_seqs: int
    prefill_tp: int = 1
    decode_tp: int = 1

    @property
    def colocated(self) -> bool:
        return self.prefill_workers == 0

    @property
    def num_devices(self) -> int:
        return self.prefill_workers * self.prefill_tp + self.decode_workers * self.decode_tp

    def label(self, replicas: int = 1) -> str:
        p, d = self.prefill_workers * replicas, self.decode_workers * replicas
        pools = f"colocated {d}" if self.colocated else f"{p}P+{d}D"
        if self.colocated and self.decode_tp > 1:
            pools += f" tp {self.decode_tp}"
        elif not self.colocated and (self.prefill_tp, self.decode_tp) != (1, 1):
            pools += f" tp {self.prefill_tp}/{self.decode_tp}"
        return f"{pools} chunk {self.chunk} seqs {self.max_num_seqs}"

    def topology(self, base: SimTopology, replicas: int = 1) -> SimTopology:
        """``base`` with this candidate's pools (times ``replicas``) and engine settings."""
        prefill_role = "decode" if self.colocated else "prefill"
        engines = {"prefill_engine": dict(base.prefill_engine), "decode_engine": dict(base.decode_engine)}
        engines[f"{prefill_role}_engine"]["max_num_batched_tokens"] = self.chunk
        engines["decode_engine"]["max_num_seqs"] = self.max_num_seqs
        for role, size in (("prefill", self.prefill_tp), ("decode", self.decode_tp)):
            if size > 1 and not (role == "prefill" and self.colocated):
                engines[f"{role}_engine"]["tensor_parallel_size"] = size
        return base.replace(prefill_workers=self.prefill_workers * replicas,
                            decode_workers=self.decode_workers * replicas, **engines)


@dataclass
class Evaluated:
    """A candidate with its rate-matching estimate and the rate it sustained (per unit), and the
    summary of the simulation at that rate."""

    candidate: Candidate
    estimate: float
    rate: float = 0.0
    summary: dict | None = None
    trials: int = 0
    whole_rate: float | None = None  # simulated whole: the cluster's sustained rate (None: not checked)
    whole: dict | None = None  # ... and its summary there


@dataclass(frozen=True)
class PlanSettings:
    """The search's space and effort."""

    chunks: tuple[int, ...] = (512, 2048, 8192)
    batch_caps: tuple[int, ...] = (64, 256)
    # Each role's tensor_parallel_size is searched over these (those the model splits over
    # and fits on); None: the smallest the model fits, for both roles (``fitting_sizes``).
    tensor_parallel: tuple[int, ...] | None = None
    max_unit: int = 8
    keep: int = 3
    keep_share: float = 0.5
    iters: int = 5
    trial_s: float = 30.0  # simulated seconds of arrivals per trial, after the warm-up
    warmup_s: float = 30.0  # ... and before it: arrivals that fill the batches, not counted
    min_requests: int = 200
    max_requests: int = 6000  # counted requests per trial, at most


@dataclass
class PlanResult:
    """The ranked candidates (best first), the unit size and how many units make N devices."""

    ranked: list[Evaluated]
    unit: int
    replicas: int
    best_colocated: Evaluated | None = None
    evaluated: list[Evaluated] = field(default_factory=list)

    @property
    def best(self) -> Evaluated:
        return self.ranked[0]

    def cluster_rate(self, ev: Evaluated) -> float:
        """What ``ev`` serves on all the devices: simulated whole where checked, else by units."""
        return ev.whole_rate if ev.whole_rate is not None else ev.rate * self.replicas


def unit_size(devices: int, max_unit: int) -> int:
    """The largest divisor of ``devices`` that is at most ``max_unit``."""
    return max(u for u in range(1, min(devices, max_unit) + 1) if devices % u == 0)


def mean_lengths(spec: WorkloadSpec, n: int = 2000) -> tuple[float, float]:
    """The workload's mean prompt and output lengths (from a sample of its generator)."""
    if spec.kind == "sharegpt":
        rng = random.Random(spec.seed)
        pairs = [sharegpt_lengths(rng) for _ in range(n)]
    else:
        pairs = [(r.prompt_tokens, r.output_tokens) for r in generate(spec.with_rate(math.inf, min(n, spec.n)))]
    return sum(p for p, _ in pairs) / len(pairs), sum(o for _, o in pairs) / len(pairs)


@dataclass(frozen=True)
class WorkerRates:
    """What the cost model says one worker of a candidate sustains, and why: a prefill worker's
    step of the chunk budget, and a decode worker's best batch (the most requests a step
    within the SLO's per-token limit, under the batch cap and the KV room)."""

    prefill_rate: float  # requests/s
    prefill_step_s: float
    decode_rate: float  # requests/s
    decode_batch: int
    decode_step_s: float
    kv_tokens: int  # tokens a decode worker's KV blocks hold


def worker_rates(c: Candidate, base: SimTopology, cost: CostModel, lengths: tuple[float, float],
                 slo: SloTarget) -> WorkerRates:
    """Requests/s one prefill worker and one decode worker of ``c`` sustain, by the cost model."""
    prompt, output = lengths
    per_step = max(1, min(c.chunk, 8192))
    reqs = max(1, round(per_step / max(prompt, 1)))
    shape = StepShape(reqs, per_step, per_step, int(reqs * prompt * (prompt + 1) / 2), per_step, reqs)
    prefill_step = cost.at_tp(c.decode_tp if c.colocated else c.prefill_tp).step_s(shape)
    context = int(prompt + output / 2)
    topo = c.topology(base)
    blocks, _ = topo.kv_blocks("decode", cost)
    kv_tokens = blocks * topo.engine_config("decode").block_size
    fits = kv_tokens // max(context, 1)
    decode_cost = cost.at_tp(c.decode_tp)
    best, best_batch, best_step = 0.0, 1, 0.0
    for batch in sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, c.max_num_seqs}):
        batch = min(batch, c.max_num_seqs, max(1, fits))
        step = decode_cost.step_s(decode_shape(batch, context))
        if (step * 1e3 <= slo.step_ms or batch == 1) and batch / (step * output) > best:
            best, best_batch, best_step = batch / (step * output), batch, step
    return WorkerRates(per_step / prefill_step / max(prompt, 1), prefill_step, best, best_batch, best_step, kv_tokens)


def estimate(c: Candidate, base: SimTopology, cost: CostModel, lengths: tuple[float, float],
             slo: SloTarget) -> float:
    """The unit's rate-matching capacity (requests/s): the smaller side of prefill and decode."""
    rates = worker_rates(c, base, cost, lengths, slo)
    prefill_rate, decode_rate = rates.prefill_rate, rates.decode_rate
    if c.colocated:  # each worker does both: the time shares add up
        return c.decode_workers / (1 / prefill_rate + 1 / decode_rate)
    return min(c.prefill_workers * prefill_rate, c.decode_workers * decode_rate)


def trial(c: Candidate, base: SimTopology, cost: CostModel, spec: WorkloadSpec, slo: SloTarget, rate: float,
          s: PlanSettings, replicas: int = 1) -> dict:
    """One simulation of ``replicas`` units of ``c`` at ``rate``: ``warmup_s`` of arrivals,
    then ``trial_s`` more (``min_requests`` to ``max_requests`` a unit); the summary counts
    the latter. The warm-up is what makes it a steady state: batches grow for as long as
    the longest outputs take, and a rate met for 10 s can fail after 30 (docs/SIMULATOR.md)."""
    counted = int(min(s.max_requests * replicas, max(s.min_requests, rate * s.trial_s)))
    warmup = math.ceil(rate * s.warmup_s) if math.isfinite(rate) else 0
    requests = generate(spec.with_rate(rate, warmup + counted))
    since = requests[warmup].arrival_s if warmup else 0.0
    return summary(run(c.topology(base, replicas), cost, requests), slo, since_s=since)


def sustained(c: Candidate, base: SimTopology, cost: CostModel, spec: WorkloadSpec, slo: SloTarget,
              guess: float, s: PlanSettings) -> Evaluated:
    """The highest rate at which a unit of ``c`` meets the SLO: a bracket found by doubling or
    halving from the estimate (at most 4 steps), then ``iters`` bisections."""
    ev = Evaluated(c, guess)

    def meets(rate: float) -> bool:
        res = trial(c, base, cost, spec, slo, rate, s)
        ev.trials += 1
        if res["slo_attainment"] >= slo.attainment and rate > ev.rate:
            ev.rate, ev.summary = rate, res
        return res["slo_attainment"] >= slo.attainment

    rate = max(guess, 1e-3)
    if meets(rate):
        lo, hi = rate, rate * 2
        for _ in range(4):
            if not meets(hi):
                break
            lo, hi = hi, hi * 2
    else:
        lo, hi = rate / 2, rate
        for _ in range(4):
            if meets(lo):
                break
            lo, hi = lo / 2, lo
        else:
            return ev  # under a 16th of the estimate: counted as sustaining nothing
    for _ in range(s.iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return ev


def fitting_sizes(cost: CostModel, block_size: int, sizes: tuple[int, ...] = (1, 2, 4, 8)) -> tuple[int, ...]:
    """The ``sizes`` a worker of this model may run at on this device kind: the model splits
    over them (``ModelSpec.check_tensor_parallel``) and a rank's share fits its device with
    room for KV."""
    fitting = []
    for size in sizes:
        try:
            sized = cost.at_tp(size)  # ValueError: the model does not split over ``size``
            if cost.device.is_gpu:
                sized.kv_blocks_fitting(block_size)  # ... or a rank's share leaves no room for KV
        except ValueError:
            continue
        fitting.append(size)
    return tuple(fitting)


def candidates(unit: int, s: PlanSettings, sizes: tuple[int, ...] = (1,)) -> list[Candidate]:
    """Every split of ``unit`` devices into prefill and decode workers (each role at each of
    ``sizes`` ranks a worker, the devices used whole) and a colocated pool at each size, with
    every chunk budget and batch cap."""
    pools = [(p, d, tp_p, tp_d) for tp_p in sizes for tp_d in sizes
             for p in range(1, unit // tp_p) for d in [(unit - p * tp_p) // tp_d]
             if d >= 1 and p * tp_p + d * tp_d == unit]
    pools += [(0, unit // tp, 1, tp) for tp in sizes if unit % tp == 0]
    return [Candidate(p, d, chunk, cap, tp_p, tp_d) for p, d, tp_p, tp_d in pools
            for chunk in s.chunks for cap in s.batch_caps]


def prune(cands: list[Candidate], estimates: dict[Candidate, float], s: PlanSettings) -> list[Candidate]:
    """The splits the rate matching keeps (the colocated one always), with all their knobs."""
    best_of: dict[tuple[int, int, int, int], float] = {}
    for c in cands:
        key = (c.prefill_workers, c.decode_workers, c.prefill_tp, c.decode_tp)
        best_of[key] = max(best_of.get(key, 0.0), estimates[c])
    disagg = sorted((k for k in best_of if k[0] > 0), key=lambda k: -best_of[k])
    top = best_of[disagg[0]] if disagg else 0.0
    kept = {k for k in disagg[: s.keep] if best_of[k] >= s.keep_share * top} | {k for k in best_of if k[0] == 0}
    return [c for c in cands if (c.prefill_workers, c.decode_workers, c.prefill_tp, c.decode_tp) in kept]


def plan(devices: int, base: SimTopology, cost: CostModel, spec: WorkloadSpec, slo: SloTarget,
         s: PlanSettings | None = None, verify: bool = True, progress=None) -> PlanResult:
    """Search the configurations of ``devices`` devices; the best first (module docstring)."""
    s = s or PlanSettings()
    if devices < 2:
        raise ValueError(f"--devices must be >= 2 (a prefill and a decode worker), got {devices}")
    unit = unit_size(devices, s.max_unit)
    if unit < 2:
        unit = devices  # a prime count above max_unit: the whole cluster is one unit
    replicas = devices // unit
    lengths = mean_lengths(spec)
    block_size = base.engine_config("decode").block_size
    sizes = fitting_sizes(cost, block_size, s.tensor_parallel or (1, 2, 4, 8))
    if not sizes:
        raise ValueError(f"{cost.model.name} fits no worker of {s.tensor_parallel or (1, 2, 4, 8)} "
                         f"{cost.device.name}s (or does not split over them)")
    cands = candidates(unit, s, sizes if s.tensor_parallel else sizes[:1])
    if not cands:
        raise ValueError(f"no split of a {unit}-device unit into workers of {sizes} devices: "
                         "raise --max-unit or --devices")
    estimates = {c: estimate(c, base, cost, lengths, slo) for c in cands}
    evaluated = []
    for c in prune(cands, estimates, s):
        ev = sustained(c, base, cost, spec, slo, estimates[c], s)
        evaluated.append(ev)
        if progress is not None:
            progress(ev, replicas)
    ranked = sorted(evaluated, key=lambda e: -e.rate)
    colocated = [e for e in ranked if e.candidate.colocated]
    result = PlanResult(ranked, unit, replicas, best_colocated=colocated[0] if colocated else None,
                        evaluated=evaluated)
    if verify and replicas > 1:
        # The best of each kind, simulated whole: units can be optimistic (docs/SIMULATOR.md).
        split = [e for e in ranked if not e.candidate.colocated][:1]
        for ev in split + colocated[:1]:
            if ev.rate > 0:
                ev.whole_rate, ev.whole = whole_cluster(ev, base, cost, spec, slo, s, replicas, backoffs=8, factor=0.8)
        result.ranked = sorted(ranked, key=lambda e: (e.whole_rate is not None, result.cluster_rate(e)), reverse=True)
    return result


def whole_cluster(ev: Evaluated, base: SimTopology, cost: CostModel, spec: WorkloadSpec, slo: SloTarget,
                  s: PlanSettings, replicas: int, backoffs: int = 4, factor: float = 0.9) -> tuple[float, dict]:
    """The candidate over all ``replicas`` units at its unit rate times ``replicas``; while it
    misses the SLO, again at ``factor`` times the rate (up to ``backoffs`` times). (rate, its
    summary); the rate is 0 when even the last one missed."""
    rate = ev.rate * replicas
    for _ in range(backoffs + 1):
        res = trial(ev.candidate, base, cost, spec, slo, rate, s, replicas)
        if res["slo_attainment"] >= slo.attainment:
            return rate, res
        rate *= factor
    return 0.0, res


def explain(result: PlanResult, base: SimTopology, cost: CostModel, spec: WorkloadSpec, slo: SloTarget) -> list[str]:
    """Why the plan chose its best, and what held back the runner-up (the best of another
    pool shape): each one's workers by the cost model (which side bounds it, the decode
    batch the per-token limit and the KV room allow) and its simulation at the rate it
    sustained (``tandem plan --explain``)."""
    lengths = mean_lengths(spec)
    best = result.best
    shape = (best.candidate.prefill_workers, best.candidate.decode_workers, best.candidate.prefill_tp,
             best.candidate.decode_tp)
    runner_up = next((e for e in result.ranked[1:] if (e.candidate.prefill_workers, e.candidate.decode_workers,
                                                        e.candidate.prefill_tp, e.candidate.decode_tp) != shape), None)
    lines = [f"mean prompt {lengths[0]:.0f} and output {lengths[1]:.0f} tokens; per-token limit {slo.step_ms:g} ms"]
    for title, ev in (("chosen", best), ("runner-up", runner_up)):
        if ev is None:
            continue
        c, r = ev.candidate, result.replicas
        w = worker_rates(c, base, cost, lengths, slo)
        rate = result.cluster_rate(ev)
        lines.append(f"{title}: {c.label(r)}, {rate:.2f} req/s"
                     + (f" ({rate / result.cluster_rate(best):.2f}x the chosen)" if ev is not best else ""))
        lines.append(f"  a prefill worker: {w.prefill_rate:.2f} req/s ({c.chunk}-token steps of "
                     f"{w.prefill_step_s * 1e3:.1f} ms); a decode worker: {w.decode_rate:.2f} req/s (batch "
                     f"{w.decode_batch}, {w.decode_step_s * 1e3:.1f} ms a step, KV for {w.kv_tokens:,} tokens)")
        if c.colocated:
            lines.append(f"  colocated, each worker's time split between both: {ev.estimate * r:.2f} req/s estimated")
        else:
            p, d = c.prefill_workers * w.prefill_rate, c.decode_workers * w.decode_rate
            side = "prefill" if p < d else "decode"
            lines.append(f"  the {side} side bounds a unit: prefill {p:.2f}, decode {d:.2f} req/s estimated")
        s = ev.whole or ev.summary
        if s:
            lines.append(f"  simulated at its rate: {s['slo_attainment']:.1%} met the SLO; TTFT p90 "
                         f"{_ms(s['ttft_ms'], 'p90')}, per token p90 {_ms(s['tpot_ms'], 'p90')}, "
                         f"gap p99 {_ms(s['itl_ms'], 'p99')} ms")
    return lines


def _ms(dist: dict | None, key: str) -> str:
    value = (dist or {}).get(key)
    return "-" if value is None else f"{value:.1f}"
