"""KV between workers of different tensor-parallel sizes: bytes and time of one prompt's move.

    python -m bench.tp_transfer [--model DIR] [--prompt 2048] [--rounds 5] [--out FILE]

For each (prefill, decode) pairing of sizes 1, 2 and 4 that the model's KV heads allow, a
prompt's blocks move from a prefill worker's ranks to a decode worker's ranks the way the
service moves them (``kv_transfer.sharded``: each decode rank reads the heads it holds, over
nixl), between real nixl agents in this one process, each rank with its own share of a paged
cache shaped as the model's (float32, blocks of 16, scattered on both sides as a busy pool's
are). Every pairing is timed in alternating rounds (the median reported) and checked once:
each decode rank ends with exactly its heads of the prompt's blocks.

It reports, per pairing, the bytes every decode rank received (its transfer stats) and their
sum, against the pairing of equal sizes at the decode worker's size (the target: a transfer
between different sizes moves no more bytes in all), and the read's time against that
pairing's: between different sizes a head's row of a token is the longest stretch alike on
both sides, so a read takes a descriptor a token where equal sizes take one a block.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Sequence

import torch

from bench.common import write_result
from engine.model.model_config import ModelConfig
from engine.model.model_registry import resolve_model
from engine.model.parallel import kv_head_range
from engine.wire.messages import KVLayout
from kv_transfer.base import TransferMeta
from kv_transfer.sharded import InProcessPeer, KVRanks

BLOCK_SIZE = 16
SIZES = (1, 2, 4)


class InProcessWorker:
    """A worker's ``size`` ranks in this process: each rank's share of a paged cache (its heads
    of ``full``'s K and V, or zeros), a nixl backend of its own attached to it, and rank 0's
    ``KVRanks`` over the others (``InProcessPeer``)."""

    def __init__(self, size: int, shape: tuple[int, int, int, int, int], full=None) -> None:
        from kv_transfer.nixl import NixlBackend

        layers, blocks, block_size, heads, head_dim = shape
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.backends = []
        for rank in range(size):
            lo, hi = kv_head_range(heads, size, rank)
            if full is None:
                k, v = (torch.zeros(layers, blocks, block_size, hi - lo, head_dim) for _ in range(2))
            else:
                k, v = (t[:, :, :, lo:hi].contiguous() for t in full)
            backend = NixlBackend()
            backend.attach_cache(k, v)
            self.caches.append((k, v))
            self.backends.append(backend)
        self.peers = [InProcessPeer(b, *c) for b, c in zip(self.backends[1:], self.caches[1:], strict=True)]
        self.ranks = KVRanks(*self.caches[0], heads, size, self.peers)

    def bytes_received(self) -> list[int]:
        return [b.stats.bytes_received for b in self.backends]

    def close(self) -> None:
        for backend in self.backends:
            backend.close()


def pairings(num_kv_heads: int) -> list[tuple[int, int]]:
    """The (prefill, decode) sizes of 1, 2 and 4 whose KV heads split (or replicate) evenly."""
    def fits(size: int) -> bool:
        return num_kv_heads % size == 0 or size % num_kv_heads == 0

    return [(a, b) for a in SIZES for b in SIZES if fits(a) and fits(b)]


def _move(prefill: InProcessWorker, decode: InProcessWorker, layout: KVLayout, src: list[int],
          dst: list[int]) -> float:
    meta = TransferMeta("t", "r", layout, len(src), len(src) * layout.block_size, deadline=time.time() + 120)
    payload = prefill.ranks.offer(prefill.backends[0], meta, src)
    t0 = time.perf_counter()
    asyncio.run(decode.ranks.read(decode.backends[0], meta, payload, dst))
    return time.perf_counter() - t0


def _check(decode: InProcessWorker, full, heads: int, src: list[int], dst: list[int]) -> None:
    for rank, (k, v) in enumerate(decode.caches):
        lo, hi = kv_head_range(heads, len(decode.caches), rank)
        for got, want in ((k, full[0]), (v, full[1])):
            if not torch.equal(got[:, dst], want[:, src, :, lo:hi]):
                raise AssertionError(f"decode rank {rank} did not get heads {lo}..{hi - 1} of the prompt's blocks")


def measure(config: ModelConfig, prompt: int, rounds: int) -> dict[str, dict]:
    """Each pairing's bytes per decode rank and read times, the pairings' rounds alternating."""
    heads, n = config.num_kv_heads, -(-prompt // BLOCK_SIZE)
    blocks = 2 * n + 8
    shape = (config.num_layers, blocks, BLOCK_SIZE, heads, config.head_dim)
    layout = KVLayout(config.num_layers, BLOCK_SIZE, heads, config.head_dim, "float32")
    full = tuple(torch.randn(shape) for _ in range(2))
    rng = random.Random(0)
    src, dst = rng.sample(range(blocks), n), rng.sample(range(blocks), n)
    workers = {p: (InProcessWorker(p[0], shape, full), InProcessWorker(p[1], shape)) for p in pairings(heads)}
    rows: dict[str, dict] = {}
    try:
        for (a, b), (prefill, decode) in workers.items():
            _move(prefill, decode, layout, src, dst)  # warm: connections made, metadata loaded
            _check(decode, full, heads, src, dst)
            rows[f"{a}->{b}"] = {"bytes_per_decode_rank": decode.bytes_received(), "seconds": []}
        for _ in range(rounds):
            for (a, b), (prefill, decode) in workers.items():
                rows[f"{a}->{b}"]["seconds"].append(_move(prefill, decode, layout, src, dst))
    finally:
        for prefill, decode in workers.values():
            prefill.close()
            decode.close()
    return rows


def report(rows: dict[str, dict], prompt: int) -> dict:
    out: dict = {"prompt_tokens": prompt, "pairings": {}}
    for name, row in rows.items():
        a, b = (int(x) for x in name.split("->"))
        equal = rows[f"{b}->{b}"]
        ms = 1e3 * statistics.median(row["seconds"])
        moved, equal_moved = sum(row["bytes_per_decode_rank"]), sum(equal["bytes_per_decode_rank"])
        out["pairings"][name] = {
            "bytes_per_decode_rank": row["bytes_per_decode_rank"],
            "bytes": moved,
            "bytes_over_equal_sizes": round(moved / equal_moved, 3),
            "read_ms": round(ms, 2),
            "read_ms_over_equal_sizes": round(ms / (1e3 * statistics.median(equal["seconds"])), 2),
            "gb_per_s": round(moved / ms / 1e6, 2),
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the built-in model)")
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens whose KV moves")
    ap.add_argument("--rounds", type=int, default=5, help="alternating timed rounds of every pairing")
    ap.add_argument("--out", default=None, help="also write the result here as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    config = ModelConfig.from_pretrained(resolve_model(args.model).path)
    result = report(measure(config, args.prompt, args.rounds), args.prompt)
    print(f"{args.prompt}-token prompt, {config.num_layers} layers, {config.num_kv_heads} KV heads of "
          f"{config.head_dim}, float32:")
    for name, row in result["pairings"].items():
        print(f"  prefill {name.replace('->', ' -> decode ')}: {row['bytes'] / 2**20:.1f} MiB "
              f"({row['bytes_over_equal_sizes']}x equal sizes), per decode rank "
              f"{[round(x / 2**20, 2) for x in row['bytes_per_decode_rank']]} MiB, read {row['read_ms']} ms "
              f"({row['read_ms_over_equal_sizes']}x equal sizes, {row['gb_per_s']} GB/s)")
    print(json.dumps(result))
    if args.out:
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
