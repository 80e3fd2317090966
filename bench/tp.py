"""Tensor parallelism's cost on one host: the decode step at TP 2 against TP 1.

    python -m bench.tp [--model DIR] [--batch 32] [--context 128] [--steps 40] [--rounds 3]
                       [--tp1-threads 1] [--rank0-threads 1] [--transport auto|gloo] [--out FILE]

Both engines live in this one process (TP 2's second rank in a process it spawned), and
their decode steps at ``--batch`` requests are timed in alternating rounds, so a slow
spell of the machine hits both; the report takes each one's median round. TP 1 runs on
``--tp1-threads`` torch threads (one, as a worker's engine does), TP 2's rank 0 on
``--rank0-threads`` and its other rank on one. ``--tp1-threads 2`` gives TP 1 the two cores
TP 2 takes; on a host busy with other work its OpenMP threads' spinning can cost it more
than the second core gives.

It reports the step times and their ratio (TP 2 / TP 1, of the medians and of the best
rounds); rank 0's time in the model's all-reduces during the timed decode steps (one after
each layer's attention and one after its MLP, one for the embedding): per call, per layer
and as a share of the step, its waits for the other rank included, as the step sees them;
and the weight bytes each rank holds (``DecoderModel.weight_bytes`` on every rank) at TP 2
against TP 1's one model. For scale, it also times one all-reduce of the step's hidden
states between this process and a spawned one with nothing around it, over shared memory
(what CPU ranks use) and gloo.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed import TCPStore

from bench.common import write_result
from bench.steps import decode_kv_blocks
from engine import LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.model.parallel import GlooGroup, TPGroup
from engine.model.shm_group import SharedMemoryGroup
from engine.ranks import LOCALHOST, TRANSPORTS, LocalRanks, TensorParallel


@dataclass
class TimedGroup:
    """A ``TPGroup`` that times its all-reduces: what rank 0 spends in them, waits included."""

    inner: TPGroup
    all_reduce_s: float = 0.0
    all_reduces: int = 0

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The inner group's all-reduce, timed."""
        t0 = time.perf_counter()
        out = self.inner.all_reduce(tensor)
        self.all_reduce_s += time.perf_counter() - t0
        self.all_reduces += 1
        return out

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The inner group's all-gather."""
        return self.inner.all_gather(tensor, dim)

    def broadcast_object(self, obj=None):
        """The inner group's broadcast."""
        return self.inner.broadcast_object(obj)

    def close(self) -> None:
        """Close the inner group."""
        self.inner.close()


def _all_reduces(group: TPGroup, numel: int, calls: int) -> float:
    """Seconds per all-reduce of ``numel`` float32 over ``group`` (after a warm-up)."""
    tensor = torch.ones(numel)
    for _ in range(20):
        group.all_reduce(tensor)
    t0 = time.perf_counter()
    for _ in range(calls):
        group.all_reduce(tensor)
    return (time.perf_counter() - t0) / calls


def _transports(store, rank: int):
    """Each transport a CPU rank could use, built on ``store`` in the same order on both sides."""
    yield "shared-memory", SharedMemoryGroup(store, rank, 2, prefix="bench/shm")
    yield "gloo", GlooGroup(store, rank, 2, prefix="bench/gloo")


def _transport_peer(port: int, numel: int, calls: int) -> None:
    """The spawned side of ``transport_latency``."""
    torch.set_num_threads(1)
    store = TCPStore(LOCALHOST, port, 2, False)
    for _, group in _transports(store, 1):
        _all_reduces(group, numel, calls)
        group.close()


def transport_latency(numel: int, calls: int = 500) -> dict[str, float]:
    """Microseconds per all-reduce of ``numel`` float32 between this process and a spawned one,
    with nothing else between the calls: each transport's own cost, apart from the step's."""
    store = TCPStore(LOCALHOST, 0, 2, True, wait_for_workers=False)
    peer = multiprocessing.get_context("spawn").Process(target=_transport_peer, args=(store.port, numel, calls))
    peer.start()
    try:
        out = {}
        for name, group in _transports(store, 0):
            out[name] = round(_all_reduces(group, numel, calls) * 1e6, 1)
            group.close()
        return out
    finally:
        peer.join(60)


def tp_engine(config: EngineConfig, transport: str = "auto") -> tuple[LLMEngine, TimedGroup]:
    """An engine of ``config.tensor_parallel_size`` ranks on this host whose rank 0 times its
    all-reduces."""
    ranks = LocalRanks(config, transport)
    timed = TimedGroup(ranks.group)
    return LLMEngine(config, tensor_parallel=TensorParallel(timed, ranks)), timed


def decode_round(engine: LLMEngine, batch: int, context: int, steps: int, timed: TimedGroup | None = None):
    """``steps`` decode steps of ``batch`` requests of ``context`` prompt tokens, timed once
    every request has decoded a few tokens: (ms a step, all-reduce seconds, all-reduce calls)."""
    ids = [engine.add_request([5 + i] * context, SamplingParams(max_tokens=10**6, ignore_eos=True, temperature=0.0))
           for i in range(batch)]
    budget = engine.scheduler.config.max_num_batched_tokens
    for _ in range(-(-batch * context // budget) + 4):  # the prefill's steps, then warm-up decodes
        engine.step()
    before = (timed.all_reduce_s, timed.all_reduces) if timed else (0.0, 0)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_ms = (time.perf_counter() - t0) / steps * 1000
    after = (timed.all_reduce_s, timed.all_reduces) if timed else (0.0, 0)
    engine.abort(ids)
    return step_ms, after[0] - before[0], after[1] - before[1]


def measure(engines: dict[str, LLMEngine], timed: TimedGroup, threads: dict[str, int], args) -> dict[str, list]:
    """Alternating rounds on each engine: the step times (ms), and TP 2's all-reduce seconds
    and calls in each of its rounds."""
    rounds: dict[str, list] = {name: [] for name in engines}
    rounds["all_reduce"] = []
    for _ in range(args.rounds):
        for name, engine in engines.items():
            torch.set_num_threads(threads[name])
            step_ms, spent, calls = decode_round(engine, args.batch, args.context, args.steps,
                                                 timed if name == "tp2" else None)
            rounds[name].append(round(step_ms, 2))
            if name == "tp2":
                rounds["all_reduce"].append((spent, calls))
    return rounds


def report(engines: dict[str, LLMEngine], rounds: dict[str, list], args) -> dict:
    """The medians and ratios the module docstring lists."""
    tp1, tp2 = (statistics.median(rounds[n]) for n in ("tp1", "tp2"))
    spent, calls = (sum(r[i] for r in rounds["all_reduce"]) for i in range(2))
    steps = args.rounds * args.steps
    layers = engines["tp1"].model_config.num_layers
    per_call_ms = 1000 * spent / calls
    per_step_ms = 1000 * spent / steps
    weights_tp1 = engines["tp1"].model.weight_bytes()
    weights_tp2 = engines["tp2"].tensor_parallel.weight_bytes(engines["tp2"].model)
    return {
        "model": engines["tp1"].model_name,
        "batch": args.batch,
        "context": args.context,
        "tp1_threads": args.tp1_threads,
        "rank0_threads": args.rank0_threads,
        "transport": args.transport,
        "tp1_step_ms": round(tp1, 2),
        "tp2_step_ms": round(tp2, 2),
        "tp2_over_tp1": round(tp2 / tp1, 2),
        # The best rounds: the least disturbed by other work on the host.
        "tp2_over_tp1_best": round(min(rounds["tp2"]) / min(rounds["tp1"]), 2),
        "rounds": {n: rounds[n] for n in ("tp1", "tp2")},
        "all_reduces_per_step": round(calls / steps, 1),
        "all_reduce_ms_per_call": round(per_call_ms, 3),
        "all_reduce_ms_per_layer": round(per_step_ms / layers, 3),
        "all_reduce_ms_per_step": round(per_step_ms, 2),
        "all_reduce_share_of_step": round(per_step_ms / statistics.mean(rounds["tp2"]), 3),
        "transport_us_per_all_reduce": transport_latency(args.batch * engines["tp1"].model_config.hidden_size),
        "weight_bytes_tp1": weights_tp1,
        "weight_bytes_per_rank_tp2": weights_tp2,
        "weights_per_rank_tp2_over_tp1": [round(w / weights_tp1, 3) for w in weights_tp2],
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the built-in model)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds on each engine")
    ap.add_argument("--tp1-threads", type=int, default=1, help="torch threads of the TP 1 engine")
    ap.add_argument("--rank0-threads", type=int, default=1, help="torch threads of TP 2's rank 0 (the other: 1)")
    ap.add_argument("--transport", choices=TRANSPORTS, default="auto",
                    help="TP 2's group: auto (shared memory on x86-64 CPUs) or gloo")
    ap.add_argument("--out", default=None, help="also write the result here as JSON")
    args = ap.parse_args(argv)
    settings = dict(model=args.model, num_kv_blocks=decode_kv_blocks(args.batch, args.context))
    engines = {"tp1": LLMEngine(EngineConfig(**settings))}
    tp2, timed = tp_engine(EngineConfig(**settings, tensor_parallel_size=2), args.transport)
    engines["tp2"] = tp2
    try:
        threads = {"tp1": args.tp1_threads, "tp2": args.rank0_threads}
        result = report(engines, measure(engines, timed, threads, args), args)
    finally:
        tp2.close()
    print(f"decode step at batch {args.batch}: TP 1 {result['tp1_step_ms']} ms, TP 2 {result['tp2_step_ms']} ms "
          f"({result['tp2_over_tp1']}x; best rounds {result['tp2_over_tp1_best']}x)")
    print(f"all-reduce on rank 0: {result['all_reduce_ms_per_call']} ms a call, {result['all_reduce_ms_per_layer']} ms "
          f"a layer, {result['all_reduce_share_of_step']:.0%} of the TP 2 step")
    print(f"one all-reduce of the step's hidden states alone, us: {result['transport_us_per_all_reduce']}")
    print(f"weights: TP 1 {result['weight_bytes_tp1'] / 2**20:.1f} MiB, TP 2 per rank "
          + ", ".join(f"{w / 2**20:.1f} MiB" for w in result["weight_bytes_per_rank_tp2"]))
    print(json.dumps(result))
    if args.out:
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
