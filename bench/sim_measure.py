"""What the simulator's validations measure it against: a trace replayed on a real
``LLMEngine`` in this process (``replay_on_engine``, on the wall clock or the step thread's
CPU clock), a CPU profile measured now (``calibrate``), and the measured and simulated
metrics side by side with the bounds on their difference (``compare``, ``BOUNDS``).

``bench/sim.py`` is the program (its ``validate`` study uses all of these);
``bench/sim_live.py``'s ``live-validate`` compares a live local cluster the same way.
"""

from __future__ import annotations

import time


class _WallClock:
    """Seconds on the wall clock since the replay began; idle time is slept through."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))

    def step(self, engine):
        outputs = engine.step()
        return outputs, self.now()


class _CpuClock:
    """Virtual seconds: each engine step advances them by the CPU time the step's thread used,
    idle time jumps to the next arrival. What one uncontended core would take, whatever else
    the machine runs."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)

    def step(self, engine):
        c0 = time.thread_time()
        outputs = engine.step()
        self.t += time.thread_time() - c0
        return outputs, self.t


def replay_on_engine(requests, settings: dict, clock: str = "wall") -> list:
    """The trace replayed on a real ``LLMEngine`` (tandem-tiny-llama, one torch thread) in
    process: each request added at its arrival, every token timed at the end of the step that
    produced it, on the wall clock or the step thread's CPU clock (``clock="cpu"``). Returns
    ``sim.simulator.Record`` s, as a simulation would."""
    import collections

    import torch

    from engine import LLMEngine, SamplingParams
    from sim.simulator import Record

    torch.set_num_threads(1)
    engine = LLMEngine(**settings)
    records = [Record(i, r) for i, r in enumerate(requests)]
    pending = collections.deque(records)
    engine.add_request([5] * 32, SamplingParams(max_tokens=4, ignore_eos=True), request_id="warm-up")
    while engine.has_unfinished_requests():
        engine.step()
    timer = _CpuClock() if clock == "cpu" else _WallClock()
    while pending or engine.has_unfinished_requests():
        now = timer.now()
        while pending and pending[0].req.arrival_s <= now:
            rec = pending.popleft()
            prompt = [5 + (rec.index * 7919 + j) % 4000 for j in range(rec.req.prompt_tokens)]
            params = SamplingParams(max_tokens=rec.req.output_tokens, ignore_eos=True, temperature=0.0)
            engine.add_request(prompt, params, request_id=str(rec.index))
        if not engine.has_unfinished_requests():
            timer.wait_until(pending[0].req.arrival_s)
            continue
        outputs, t = timer.step(engine)
        for out in outputs:
            rec = records[int(out.request_id)]
            rec.token_times.extend([t] * len(out.new_token_ids))
            if out.finished:
                rec.end_s = t
    return records


def calibrate(path: str, clock: str = "wall") -> str:
    """Measure a CPU profile table now (``bench.steps``' measurements), so that the validation's
    costs come from the machine as busy as it is during the replays; ``clock="cpu"`` times the
    steps by the thread's CPU time instead of the wall clock."""
    import types

    import torch

    import bench.steps
    from bench.common import write_result
    from bench.steps import decode_kv_blocks, measure_profile, profile_table
    from engine import LLMEngine

    torch.set_num_threads(1)
    batches = [1, 2, 4, 8, 16, 32]
    engine = LLMEngine(num_kv_blocks=decode_kv_blocks(max(batches), 512))
    saved = bench.steps.time
    if clock == "cpu":  # bench.steps reads time.perf_counter: hand it the thread's CPU clock
        bench.steps.time = types.SimpleNamespace(perf_counter=time.thread_time)
    try:
        rows = measure_profile(engine, batches, (128, 512), 20, [16, 64, 128, 256, 512, 1024])
    finally:
        bench.steps.time = saved
    write_result(path, profile_table(engine, "cpu", "tandem-tiny-llama", rows))
    return path


METRICS = (("throughput_tok_s", lambda s: s["output_throughput"]),
           ("ttft_p50_ms", lambda s: s["ttft_ms"]["median"]),
           ("ttft_p90_ms", lambda s: s["ttft_ms"]["p90"]),
           ("tpot_mean_ms", lambda s: s["tpot_ms"]["mean"]),
           ("e2e_mean_ms", lambda s: s["e2e_ms"]["mean"]))
# The bounds on |simulated / measured - 1|: throughput and means 10%, TTFT percentiles 15%.
BOUNDS = {"throughput_tok_s": 0.10, "ttft_p50_ms": 0.15, "ttft_p90_ms": 0.15, "tpot_mean_ms": 0.10,
          "e2e_mean_ms": 0.10}


def compare(measured: dict, *simulated: dict) -> dict:
    """Each validated metric, measured and simulated (the mean over the simulations given),
    and the simulation's relative error."""
    row = {}
    for name, get in METRICS:
        m, p = get(measured), sum(get(s) for s in simulated) / len(simulated)
        row[name] = {"measured": m, "simulated": p, "error": (p - m) / m if m else None}
    return row


def row_text(row: dict) -> str:
    """``compare``'s row on one line: each metric measured vs simulated, and the error."""
    return ", ".join(f"{k} {v['measured']:.1f} vs {v['simulated']:.1f} ({v['error']:+.0%})" for k, v in row.items())
