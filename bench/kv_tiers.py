"""Multi-turn chat through one engine with the host KV tier off and on (``python -m bench.kv_tiers``).

Workload (fixed by ``--seed``): ``--conversations`` chats of 8 to 16 turns. Each turn
sends the whole history so far (every earlier user message and reply) plus a new user
message of random tokens, and the reply is ``--reply-tokens`` greedy tokens. The
conversations take turns, ``--concurrency`` turns in flight: a conversation's next turn
queues behind every other conversation's, so by the time it comes back the device pool,
sized to ``--pool-share`` of the working set (every conversation's whole final history,
in blocks), has evicted its history.

The same engine settings run it twice in one process (``engine.LLM``, driven a step at a
time so that each finished turn queues the next): the host tier off, then on and sized
to hold the whole working set. For each run:

- prompt tokens computed: tokens of admitted prompts less those the prefix cache served,
  over every admission (a recompute preemption's too);
- TTFT p50 and p90: wall time from a turn's ``add_request`` to its first token (the final
  output's ``RequestTimes``: queue + prefill), and the engine steps between the two;
- the host tier's hit rate (of the admitted prompt tokens the device's cache missed, the
  share restored from the tier), its spills and restores;
- whether the replies are identical.

Writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from bench.common import add_engine_arguments, engine_overrides, write_result

BLOCK = 16  # the engine's default block size, which the runs keep


@dataclass(frozen=True)
class Chat:
    """One conversation: each turn's new user tokens; every reply is ``reply`` tokens."""

    turns: list[list[int]]
    reply: int

    def tokens(self) -> int:
        """Its whole final history: every user message and every reply."""
        return sum(len(u) for u in self.turns) + self.reply * len(self.turns)


def make_chats(n: int, turns: tuple[int, int], user: tuple[int, int], reply: int, vocab: int, seed: int) -> list[Chat]:
    rng = random.Random(seed)
    return [Chat([[rng.randrange(2, vocab) for _ in range(rng.randint(*user))] for _ in range(rng.randint(*turns))],
                 reply) for _ in range(n)]


def run(model: str | None, chats: list[Chat], concurrency: int, num_blocks: int, host_bytes: int,
        overrides: dict) -> dict:
    """Every chat through one engine; its replies, TTFTs and counters (see the module docstring)."""
    from engine import LLM, SamplingParams

    llm = LLM(model=model, num_kv_blocks=num_blocks, host_kv_cache_memory=host_bytes, **overrides)
    engine = llm.engine
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    before = engine.stats()
    history: list[list[int]] = [[] for _ in chats]
    replies: list[list[int]] = [[] for _ in chats]
    turn = [0] * len(chats)
    queue, in_flight = deque(range(len(chats))), {}  # request id -> (chat, step it was added at)
    ttft_s, ttft_steps, steps = [], [], 0
    first_seen: set[str] = set()

    def start(c: int) -> None:
        history[c] = history[c] + chats[c].turns[turn[c]]
        params = SamplingParams(max_tokens=chats[c].reply, temperature=0.0, ignore_eos=True)
        in_flight[engine.add_request(history[c], params)] = (c, steps)

    for _ in range(min(concurrency, len(chats))):
        start(queue.popleft())
    t0 = time.perf_counter()
    while in_flight:
        outputs = engine.step()
        steps += 1
        for out in outputs:
            if out.request_id not in first_seen:
                first_seen.add(out.request_id)
                ttft_steps.append(steps - in_flight[out.request_id][1])
            if not out.finished:
                continue
            c, _ = in_flight.pop(out.request_id)
            first_seen.discard(out.request_id)
            assert out.times is not None and out.times.queue_s is not None and out.times.prefill_s is not None
            ttft_s.append(out.times.queue_s + out.times.prefill_s)
            history[c] = history[c] + out.token_ids
            replies[c] += out.token_ids
            turn[c] += 1
            if turn[c] < len(chats[c].turns):
                queue.append(c)
            if queue:
                start(queue.popleft())
    seconds = time.perf_counter() - t0
    return _summary(engine, before, replies, ttft_s, ttft_steps, seconds)


def _summary(engine, before, replies, ttft_s: list[float], ttft_steps: list[int], seconds: float) -> dict:
    """A run's figures from the engine's counters (less the warm-up's) and the turns' TTFTs."""
    stats = engine.stats()
    assert stats.num_blocks_in_use == 0 and engine.kv_manager.num_swap_blocks() == 0, "KV blocks leaked"
    queries = stats.prefix_cache_queries - before.prefix_cache_queries
    hits = stats.prefix_cache_hits - before.prefix_cache_hits
    host_hits = stats.host_cache_hits - before.host_cache_hits
    missed = queries - (hits - host_hits)
    return {
        "seconds": round(seconds, 2),
        "turns": len(ttft_s),
        "prompt_tokens": queries,
        "prompt_tokens_computed": queries - hits,
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "ttft_p50_ms": round(statistics.median(ttft_s) * 1e3, 2),
        "ttft_p90_ms": round(statistics.quantiles(ttft_s, n=10)[-1] * 1e3, 2),
        "ttft_p50_steps": statistics.median(ttft_steps),
        "host_tier": {
            "blocks": stats.host_cache_blocks,
            "blocks_used": stats.host_cache_blocks_used,
            "spills": stats.host_cache_spills - before.host_cache_spills,
            "restores": stats.host_cache_restores - before.host_cache_restores,
            "hit_rate": round(host_hits / missed, 4) if missed else 0.0,
        },
        "preemptions": stats.num_preemptions - before.num_preemptions,
        "replies": replies,
    }


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.kv_tiers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a named model or checkpoint (default: tandem-tiny-llama)")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, nargs=2, default=(8, 16), help="turns per conversation, at least and most")
    ap.add_argument("--user-tokens", type=int, nargs=2, default=(16, 48), help="a user message's tokens")
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=2, help="turns in flight at once")
    ap.add_argument("--pool-share", type=float, default=0.25, help="device pool / working set, in blocks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: steady figures on a CPU that other jobs share)")
    ap.add_argument("--out", default="bench-results/kv_tiers.json")
    add_engine_arguments(ap)
    return ap


def _sizes(chats: list[Chat], pool_share: float, concurrency: int, per_block: int) -> tuple[int, int, int]:
    """(working set, device pool, host tier bytes): the pool a share of the working set, yet
    room for the ``concurrency`` longest conversations at once (no preemption); the tier
    the whole working set and a quarter more."""
    working = sum(-(-c.tokens() // BLOCK) for c in chats)
    longest = sorted((-(-c.tokens() // BLOCK) for c in chats), reverse=True)[:concurrency]
    pool = max(int(working * pool_share), sum(longest) + concurrency)
    return working, pool + 1, (working + working // 4) * per_block


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    from engine.model.kv_cache import bytes_per_block
    from engine.model.loader import resolve_dtype
    from engine.model.model_config import ModelConfig
    from engine.model.model_registry import resolve_model

    torch.set_num_threads(args.threads)
    overrides = engine_overrides(args)
    config = ModelConfig.from_pretrained(resolve_model(args.model).path)
    per_block = bytes_per_block(config, BLOCK, resolve_dtype(args.dtype, args.device))
    chats = make_chats(args.conversations, args.turns, args.user_tokens, args.reply_tokens, config.vocab_size,
                       args.seed)
    working, num_blocks, host_bytes = _sizes(chats, args.pool_share, args.concurrency, per_block)
    print(f"{len(chats)} conversations, {sum(len(c.turns) for c in chats)} turns; working set {working} blocks, "
          f"device pool {num_blocks - 1} ({(num_blocks - 1) / working:.2f}x), host tier {host_bytes // per_block}")
    runs = {}
    for name, host in (("off", 0), ("on", host_bytes)):
        runs[name] = run(args.model, chats, args.concurrency, num_blocks, host, overrides)
        r = runs[name]
        print(f"host tier {name:3}: {r['prompt_tokens_computed']:6d} of {r['prompt_tokens']} prompt tokens computed, "
              f"TTFT p50 {r['ttft_p50_ms']:.1f} ms ({r['ttft_p50_steps']} steps), p90 {r['ttft_p90_ms']:.1f} ms; "
              f"tier hit rate {r['host_tier']['hit_rate']:.1%}, {r['host_tier']['restores']} restores, "
              f"{r['host_tier']['spills']} spills; {r['seconds']:.1f} s")
    off, on = runs["off"], runs["on"]
    same = off.pop("replies") == on.pop("replies")
    result = {
        "workload": {"conversations": args.conversations, "turns": args.turns, "user_tokens": args.user_tokens,
                     "reply_tokens": args.reply_tokens, "concurrency": args.concurrency, "seed": args.seed,
                     "working_set_blocks": working, "device_blocks": num_blocks - 1,
                     "host_tier_blocks": host_bytes // per_block},
        "off": off, "on": on, "replies_identical": same,
        "computed_on_over_off": round(on["prompt_tokens_computed"] / off["prompt_tokens_computed"], 4),
        "ttft_p50_off_over_on": round(off["ttft_p50_ms"] / on["ttft_p50_ms"], 2),
    }
    print(f"prompt tokens computed on/off {result['computed_on_over_off']:.3f}; TTFT p50 off/on "
          f"{result['ttft_p50_off_over_on']:.2f}x; replies identical: {same}")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
