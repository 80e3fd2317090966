"""KV transfer throughput of each backend, beside raw gloo and an in-process copy.

For each size (MiB of K+V per request) it moves the same bytes between two Ray
actors, all in one run:

* ``raw_gloo``: a bare two-rank gloo group's send/recv into existing buffers (the baseline);
* ``collective``: this project's backend (pairwise channels, staging buffers, deadlines);
* ``object_store``: through Ray's object store;
* ``nixl``: one-sided READ through NIXL (UCX), where the nixl packages are installed;
  ``nixl_read`` is the receiver's own time for the same transfers (its stats), without
  the copy into the resident buffer that every backend row includes;
* ``nixl_paged``: what the workers run with NIXL: the receiver reads the blocks out of
  the sender's paged cache straight into its own paged cache (no packing on either
  side), into scattered blocks (one descriptor per block and layer: the worst case);
* ``collective_paged``: what the workers run with gloo channels on CPUs: messages from
  the sender's blocks straight into the receiver's, here one stretch of consecutive
  blocks (a message per layer, K and V); ``collective_paged_scattered`` into blocks in
  random order (past ``MAX_MESSAGES`` messages, gathered and scattered instead);

both timed inside the receiver until the bytes sit in a resident buffer, as they must
in a decode worker's cache (raw gloo receives straight into its buffer);
* ``nixl_paged_checksums``, ``collective_paged_checksums``: the same reads with per-block
  checksums on (``transfer.checksums``): the receiver's time includes checking every
  block's sum, and ``checksums_sender`` is what summing them costs the sender first;
  ``*_checksums_added`` is the share they add to the read;
* ``inprocess_copy``: one ``torch`` copy of the same bytes in this process.

It also times one request at low load through a 1 prefill + 1 decode cluster and
splits its TTFT into reserve, prefill (queue included), transfer and first delivery;
then, with each paged backend (gloo channels, and NIXL where installed), a long prompt
prefilled in chunks (``--long-prompt`` tokens, budget ``--chunk``), its blocks moved
chunk by chunk during the prefill (``pipeline``) and all after it, where
``transfer_s`` is what the transfer adds after the prefill.

    python -m bench.transfer [--sizes 16 256] [--repeats 5] [--long-prompt 2000 --chunk 256]
        [--out bench-results/transfer.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import ray
import torch

from bench.common import init_local_ray, write_result
from kv_transfer import KVLayout, TransferMeta
from kv_transfer.config import TransferConfig
from kv_transfer.nixl import unavailable_reason
from kv_transfer.peer import TransferPeer

MiB = 1 << 20


def _layout_for(size_mib: int) -> tuple[KVLayout, int]:
    """A float32 layout whose packed K+V for one request is ``size_mib`` MiB."""
    layout = KVLayout(num_layers=16, block_size=16, num_kv_heads=8, head_dim=128, dtype="float32")
    per_block = layout.nbytes(1)
    return layout, max(1, size_mib * MiB // per_block)


def _pair(backend: str):
    actor = ray.remote(TransferPeer).options(num_cpus=0, max_concurrency=16)
    return actor.remote(TransferConfig(backend=backend)), actor.remote(TransferConfig(backend=backend))


def time_backend(a, b, size_mib: int, repeats: int) -> list[float]:
    layout, blocks = _layout_for(size_mib)
    times = []
    for i in range(repeats + 1):  # the first is a warm-up
        meta = TransferMeta(
            f"t{size_mib}-{i}", f"r{i}", layout, blocks, blocks * 16, ray.get(b.endpoint.remote()), time.time() + 300
        )
        payload, _ = ray.get(a.prepare.remote(meta, i))
        pull = b.pull.remote(meta, payload)
        ray.get(a.push.remote(meta))
        _, seconds = ray.get(pull)  # measured inside the receiver: wait + receive
        if i:
            times.append(seconds)
        ray.get(a.release.remote(meta))
    return times


def time_paged(a, b, size_mib: int, repeats: int, scattered: bool = True, sums: list | None = None) -> list[float]:
    """Blocks moved from one paged cache into blocks of another (``scattered``: in random
    order, so no two are consecutive; else one stretch); bytes checked. With ``sums`` (a
    list), the sender sums every block as a worker with ``checksums`` on does (its
    seconds are appended there) and the receiver's time includes checking them."""
    import dataclasses
    import random

    layout, blocks = _layout_for(size_mib)
    ray.get([a.attach.remote(layout, blocks, 1), b.attach.remote(layout, 2 * blocks, 2)])
    rng = random.Random(size_mib)
    endpoint = ray.get(b.endpoint.remote())
    times = []
    for i in range(repeats + 1):
        src = list(range(blocks))
        dst = rng.sample(range(2 * blocks), blocks) if scattered else list(range(blocks // 2, blocks // 2 + blocks))
        meta = TransferMeta(f"p{size_mib}-{i}", f"r{i}", layout, blocks, blocks * 16, endpoint, time.time() + 300,
                            tuple(dst))
        payload, want, block_sums, summed = ray.get(a.prepare_blocks.remote(meta, src, sums is not None))
        meta = dataclasses.replace(meta, checksums=block_sums)
        if i and sums is not None:
            sums.append(summed)
        pull = b.pull_blocks.remote(meta, payload, dst)
        ray.get(a.push.remote(meta))  # a reader (NIXL) has nothing to push
        got, seconds = ray.get(pull)
        if got != want:
            raise RuntimeError(f"paged read {meta.transfer_id} delivered other bytes")
        if i:
            times.append(seconds)
        ray.get(a.release.remote(meta))
    return times


def time_receive_only(a, b, size_mib: int, repeats: int) -> list[float]:
    """The receiving backend's own seconds per transfer, from its stats."""
    times = []
    for i in range(repeats + 1):
        before = ray.get(b.stats.remote())["seconds_receiving"]
        time_backend(a, b, size_mib, 0)  # one transfer, untimed here
        if i:
            times.append(ray.get(b.stats.remote())["seconds_receiving"] - before)
    return times


def time_raw_gloo(a, b, size_mib: int, repeats: int) -> list[float]:
    nbytes = _layout_for(size_mib)[0].nbytes(_layout_for(size_mib)[1])
    addr = ray.get(b.raw_setup.remote(nbytes, 1))
    joined = b.raw_join.remote()
    ray.get(a.raw_setup.remote(nbytes, 0, addr))
    ray.get(joined)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        recv = b.raw_recv.remote(i)
        ray.get(a.raw_send.remote(i))
        ray.get(recv)
        if i:
            times.append(time.perf_counter() - t0)
    return times


def time_inprocess(size_mib: int, repeats: int) -> list[float]:
    layout, blocks = _layout_for(size_mib)
    n = layout.nbytes(blocks)
    src, dst = torch.ones(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return times


def ttft_breakdown(model: str | None, prompt_len: int = 512, chunk_tokens: int | None = None,
                   transfer: TransferConfig | None = None) -> dict:
    """One request at a time through 1 prefill + 1 decode worker (the default backend
    unless ``transfer`` says otherwise); ``chunk_tokens``: the prefill step budget.
    ``transfer_s`` is what the transfer adds after the prefill: with a pipelined paged
    backend, only the last chunk's blocks."""
    import asyncio

    from cluster.config import ClusterConfig
    from cluster.pools import TandemCluster
    from engine import SamplingParams
    from engine.wire.clients import DecodeClient, PrefillClient

    engine = {"max_num_batched_tokens": chunk_tokens} if chunk_tokens else {}
    cluster = TandemCluster(ClusterConfig(
        model=model, prefill_workers=1, decode_workers=1, restart_workers=False, engine=engine,
        transfer=transfer or TransferConfig(),
    )).start()
    try:
        decode, prefill = cluster.decode_refs()[0].handle, cluster.prefill_refs()[0].handle
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        async def one(rid: str, i: int) -> dict:
            prompt = [(i * 7919 + j) % 4000 for j in range(prompt_len)]  # distinct: no prefix hits
            stream = DecodeClient(decode).subscribe(f"bench-{rid}")
            t0 = time.perf_counter()
            res = await DecodeClient(decode).reserve(rid, prompt, params, subscriber=f"bench-{rid}")
            t_res = time.perf_counter()
            pref = PrefillClient(prefill).prefill(rid, prompt, params, decode_worker=decode, reservation=res)
            marks = []
            async for ref in stream:  # one message per step: this request's deltas
                _, (delta,) = await ref
                marks.append(time.perf_counter())
                if delta[3]:  # finished
                    break
            result = await pref
            return {
                "reserve_s": t_res - t0,
                "prefill_s": result.prefill_s,
                "transfer_s": result.transfer_s,
                "ttft_s": marks[0] - t0,
                "first_decode_step_s": marks[-1] - marks[0] if len(marks) > 1 else None,
                "kv_mib": result.kv_bytes / MiB,
            }

        runs = [asyncio.run(one(f"ttft-{i}", i)) for i in range(6)][1:]
        return {k: statistics.median(r[k] for r in runs if r[k] is not None) for k in runs[0]}
    finally:
        cluster.shutdown()


def chunked_ttft(model: str | None, prompt_len: int, chunk_tokens: int, backends: list[str]) -> dict:
    """A long prompt prefilled in chunks, moved by each paged backend: pipelined (with
    per-block checksums off, then on), and whole after the prefill."""
    result = {}
    for backend in backends:
        for pipeline, sums in ((True, False), (True, True), (False, False)):
            mode = ("pipelined" if pipeline else "whole") + ("_checksums" if sums else "")
            key = f"ttft_{prompt_len}_tokens_chunk_{chunk_tokens}_{backend}_{mode}"
            config = TransferConfig(backend=backend, pipeline=pipeline, checksums=sums)
            result[key] = ttft_breakdown(model, prompt_len, chunk_tokens, config)
            print(f"{key} (s):", json.dumps(result[key]), flush=True)
    return result


def _summary(size_mib: int, rows: dict[str, list[float]]) -> dict:
    """Each row's median and GiB/s, and every backend's speed over raw gloo's."""
    layout, blocks = _layout_for(size_mib)
    nbytes = layout.nbytes(blocks)
    summary = {}
    for name, times in rows.items():
        med = statistics.median(times)
        summary[name] = {"median_s": med, "GiB_per_s": nbytes / med / (1 << 30)}
    for name in rows:
        if name not in ("raw_gloo", "object_store", "inprocess_copy", "checksums_sender"):
            summary[f"{name}_vs_raw_gloo"] = summary["raw_gloo"]["median_s"] / summary[name]["median_s"]
    for name in [n.removesuffix("_checksums") for n in rows if n.endswith("_checksums")]:
        # What checking every block's sum adds to a read, and what summing them costs the sender.
        base = summary[name]["median_s"]
        summary[f"{name}_checksums_added"] = summary[f"{name}_checksums"]["median_s"] / base - 1
        if "checksums_sender" in summary:
            summary["checksums_sender_vs_read"] = summary["checksums_sender"]["median_s"] / base
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 256], help="MiB of K+V per request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default=None)
    ap.add_argument("--long-prompt", type=int, default=2000, help="tokens of the chunked TTFT runs' prompt")
    ap.add_argument("--chunk", type=int, default=256, help="prefill step budget of the chunked TTFT runs")
    ap.add_argument("--out", default="bench-results/transfer.json")
    args = ap.parse_args(argv)
    init_local_ray()
    torch.set_num_threads(1)
    gloo_a, gloo_b = _pair("collective")
    store_a, store_b = _pair("object_store")
    nixl_missing = unavailable_reason()
    nixl_a, nixl_b = _pair("nixl") if nixl_missing is None else (None, None)
    if nixl_missing:
        print(f"nixl skipped: {nixl_missing}", flush=True)
    result: dict = {"sizes_mib": args.sizes, "repeats": args.repeats, "results": {}}
    for size in args.sizes:
        rows = {
            "raw_gloo": time_raw_gloo(gloo_a, gloo_b, size, args.repeats),
            "collective": time_backend(gloo_a, gloo_b, size, args.repeats),
            "object_store": time_backend(store_a, store_b, size, args.repeats),
            "inprocess_copy": time_inprocess(size, args.repeats),
        }
        if nixl_a is not None:
            rows["nixl"] = time_backend(nixl_a, nixl_b, size, args.repeats)
            rows["nixl_read"] = time_receive_only(nixl_a, nixl_b, size, args.repeats)
            sender_sums: list[float] = []
            for name, sums in (("nixl_paged", None), ("nixl_paged_checksums", sender_sums)):
                paged_a, paged_b = _pair("nixl")  # a cache of its own for each run
                rows[name] = time_paged(paged_a, paged_b, size, args.repeats, sums=sums)
                for actor in (paged_a, paged_b):
                    ray.kill(actor)
            rows["checksums_sender"] = sender_sums
        for name, scattered, sums in (("collective_paged", False, None), ("collective_paged_checksums", False, []),
                                      ("collective_paged_scattered", True, None)):
            paged_a, paged_b = _pair("collective")
            rows[name] = time_paged(paged_a, paged_b, size, args.repeats, scattered, sums=sums)
            for actor in (paged_a, paged_b):
                ray.kill(actor)
        summary = result["results"][f"{size}MiB"] = _summary(size, rows)
        print(f"{size} MiB: " + ", ".join(
            f"{k} {v['median_s'] * 1e3:.1f} ms ({v['GiB_per_s']:.2f} GiB/s)"
            for k, v in summary.items() if isinstance(v, dict)
        ) + "; " + ", ".join(
            f"{k.removesuffix('_vs_raw_gloo')}/raw gloo = {v:.2f}"
            for k, v in summary.items() if k.endswith("_vs_raw_gloo")
        ) + "; " + ", ".join(
            f"{k} {v:+.1%}" for k, v in summary.items() if k.endswith("_checksums_added") or k.endswith("_vs_read")
        ), flush=True)
    for a in (gloo_a, gloo_b, store_a, store_b, nixl_a, nixl_b):
        if a is not None:
            ray.kill(a)
    result["ttft_breakdown_512_tokens"] = ttft_breakdown(args.model)
    print("TTFT breakdown (s):", json.dumps(result["ttft_breakdown_512_tokens"], indent=1))
    paged = ["collective"] + (["nixl"] if nixl_missing is None else [])
    result.update(chunked_ttft(args.model, args.long_prompt, args.chunk, paged))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
