"""KV transfers between one prefill-decode pair while other workers die and rejoin.

A 2 prefill + 2 decode cluster (collective backend). One pair, ``prefill-0`` to
``decode-0``, moves a request's KV back to back for the whole run and each transfer's
time is recorded. The run has two halves of equal length, in one process:

* quiet: nothing else happens;
* churn: every ``--kill-every-s`` seconds ``prefill-1`` or ``decode-1`` (in turn) is
  killed; the health thread replaces it, and the replacement is timed from the moment
  it answers until its first transfer with the steady pair's peer has landed (a fresh
  channel: ``join_to_first_transfer_s``).

The steady pair's p50/p99 in each half and their ratio show whether a membership
change anywhere pauses transfers elsewhere (with one global group, every change did).

    python -m bench.membership [--seconds 30] [--kill-every-s 10] [--out bench-results/membership.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import threading
import time

import ray

from bench.common import init_local_ray, write_result
from engine import SamplingParams
from engine.wire.clients import DecodeClient, PrefillClient

PROMPT_TOKENS = 256
_ids = itertools.count()


async def _transfer(prefill, decode, tag: str) -> float:
    """One request's KV from ``prefill`` to ``decode`` (actor handles); returns the transfer's seconds."""
    rid = f"{tag}-{next(_ids)}"
    prompt = [(hash(rid) + j) % 4000 for j in range(PROMPT_TOKENS)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    # Nobody reads this subscriber's deltas: the request is aborted right after its transfer.
    reservation = await DecodeClient(decode).reserve(rid, prompt, params, subscriber=f"bench-{tag}")
    if reservation is None:
        raise RuntimeError(f"{tag}: the decode worker had no room")
    result = await PrefillClient(prefill).prefill(rid, prompt, params, decode_worker=decode, reservation=reservation)
    if result.error:
        raise RuntimeError(f"{tag}: transfer failed: {result.error}")
    await DecodeClient(decode).abort(rid)  # the token is not wanted: free the blocks at once
    return result.transfer_s


async def _steady(cluster, seconds: float) -> list[float]:
    prefill, decode = cluster.prefill_refs()[0].handle, cluster.decode_refs()[0].handle
    times, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        times.append(await _transfer(prefill, decode, "steady"))
    return times


def _churn(cluster, seconds: float, every_s: float, joins: list[float], stop: threading.Event) -> None:
    """Kill prefill-1 / decode-1 in turn; time each replacement's first transfer."""
    victims = itertools.cycle([("prefill", 1), ("decode", 1)])
    end = time.monotonic() + seconds
    while not stop.wait(every_s) and time.monotonic() < end:
        role, index = next(victims)
        refs = cluster.prefill_refs() if role == "prefill" else cluster.decode_refs()
        ray.kill(refs[index].handle, no_restart=True)
        while not cluster.check_health():
            time.sleep(0.05)
        t0 = time.perf_counter()  # the replacement answered its ready() in check_health
        refs = cluster.prefill_refs() if role == "prefill" else cluster.decode_refs()
        newcomer = refs[index].handle
        prefill = newcomer if role == "prefill" else cluster.prefill_refs()[0].handle
        decode = newcomer if role == "decode" else cluster.decode_refs()[0].handle

        asyncio.run(_transfer(prefill, decode, f"join-{role}"))
        joins.append(time.perf_counter() - t0)


def _summary(times: list[float]) -> dict:
    s = sorted(times)
    return {
        "n": len(s),
        "p50_ms": 1e3 * statistics.median(s),
        "p99_ms": 1e3 * s[min(len(s) - 1, int(0.99 * len(s)))],
        "max_ms": 1e3 * s[-1],
    }


def run(model: str | None, seconds: float, every_s: float) -> dict:
    from cluster.config import ClusterConfig
    from cluster.pools import TandemCluster

    cluster = TandemCluster(
        ClusterConfig(model=model, prefill_workers=2, decode_workers=2, restart_workers=False)  # collective
    ).start()
    try:
        asyncio.run(_steady(cluster, 2.0))  # warm-up: the steady pair's channel exists
        quiet = asyncio.run(_steady(cluster, seconds))
        joins: list[float] = []
        stop = threading.Event()
        killer = threading.Thread(target=_churn, args=(cluster, seconds, every_s, joins, stop), daemon=True)
        killer.start()
        churn = asyncio.run(_steady(cluster, seconds))
        stop.set()
        killer.join(timeout=120)
    finally:
        cluster.shutdown()
    q, c = _summary(quiet), _summary(churn)
    return {
        "quiet": q,
        "churn": c,
        "p99_churn_over_quiet": c["p99_ms"] / q["p99_ms"],
        "join_to_first_transfer_s": joins,
        "kill_every_s": every_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0, help="length of each half")
    ap.add_argument("--kill-every-s", type=float, default=10.0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default="bench-results/membership.json")
    args = ap.parse_args(argv)
    init_local_ray()
    result = run(args.model, args.seconds, args.kill_every_s)
    q, c = result["quiet"], result["churn"]
    print(f"steady pair, quiet: p50 {q['p50_ms']:.1f} ms, p99 {q['p99_ms']:.1f} ms ({q['n']} transfers)")
    print(f"steady pair, churn: p50 {c['p50_ms']:.1f} ms, p99 {c['p99_ms']:.1f} ms ({c['n']} transfers)")
    print(f"p99 churn / quiet: {result['p99_churn_over_quiet']:.2f}")
    print("join to first transfer (s):", ", ".join(f"{t:.2f}" for t in result["join_to_first_transfer_s"]))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
