"""Chaos: long streams move off a dead decode worker past what the prefill pool can hold.

A live service with 2 prefill workers whose KV pools hold PREFILL_BLOCKS blocks (a few
hundred tokens) and 2 decode workers with large pools serves N long streaming greedy
completions at once (short prompts, LENGTHS output tokens each: prompt and output
together outgrow a prefill pool). Once every stream has streamed more than a prefill
pool holds, the decode worker running the most of them is killed. Its streams move: a
prefill worker refuses to prefill prompt + streamed tokens it cannot hold, and the new
decode worker recomputes them itself.

The verdict (``tests/chaos/streams.py``): every stream ends with exactly the
undisturbed greedy text (no client sees an error), none hangs, and afterwards every
worker holds no KV blocks and the service answers. Beside it: streams moved, and the
decode workers counted the refused hand-offs as failed transfers (nothing else fails a
transfer here: no faults are set).

    .venv/bin/python -m pytest -q -s tests/chaos/test_small_prefill_pool.py
"""

from __future__ import annotations

import asyncio
import random

import pytest

from engine.tokenizer import Tokenizer
from tests.chaos.streams import backends, judge, kill, model_name, reference, run_load, services_fixture, until, workers

BLOCK_SIZE = 16
PREFILL_BLOCKS = 12  # 192 tokens: a short prompt fits, prompt and 200 streamed tokens do not
N = 4
LENGTHS = (280, 320)  # output tokens: the stream goes on well after it no longer fits a prefill pool
SETTINGS = dict(prefill_workers=2, decode_workers=2, restart_workers=True, num_kv_blocks=512,
                prefill_engine={"num_kv_blocks": PREFILL_BLOCKS})
DEADLINES = {"timeout_s": 5, "op_timeout_s": 10, "checksums": True}


services = services_fixture(SETTINGS, DEADLINES)


@pytest.fixture(params=backends("collective"))
def service(services, request):
    return services.get(request.param)


@pytest.fixture(scope="module")
def workload(tiny_model):
    """N short prompts, each with a long output, and the reference texts."""
    rng = random.Random(5)
    words = ["alpha", "beta", "gamma", "delta", "kv", "block", "stream", "token", "prefill", "decode"]
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 10))) for _ in range(N)]
    lengths = [rng.randint(*LENGTHS) for _ in range(N)]
    return reference(tiny_model, prompts, lengths)


def _transfer_failures(svc) -> int:
    return sum(s.get("transfer_failures", 0) for s in svc.stats().values())


def test_streams_outgrowing_the_prefill_pool_move_by_recompute(service, tiny_model, workload, metrics_dir):
    """Streams moved after more tokens than a prefill pool holds finish with exactly the
    undisturbed text (recomputed on the new decode worker), and every worker's blocks
    return to zero."""
    from tests.helpers import metric_sum, scrape

    moved_before = metric_sum(scrape(metrics_dir), "tandem:request_migrations_total")
    failures_before = _transfer_failures(service)
    # Tokens streamed, counted in the text received (a chunk may carry several tokens when
    # the router falls behind), with a margin for re-tokenization at the text's end.
    past_the_pool = PREFILL_BLOCKS * BLOCK_SIZE + 8
    tokenizer = Tokenizer.from_pretrained(tiny_model)

    async def chaos(progress):
        victim = []

        async def long_enough():
            # Every stream still live (one that started late may lag the others by more
            # than the gap between the pool and the shortest output) is past the pool.
            live = list(progress["live"].values())
            if not live or min(len(tokenizer.encode(o.text, add_special_tokens=False)) for o in live) <= past_the_pool:
                return False
            _, decode = workers(service)
            loads = await asyncio.gather(*(w.handle.load.remote() for w in decode))
            victim[:] = [max(zip(decode, loads), key=lambda wl: wl[1].running)[0]]
            return True

        await until(long_enough, f"every stream past {past_the_pool} tokens")
        await kill(victim[0].handle)

    outcomes = asyncio.run(run_load(service.http_url, model_name(tiny_model), workload, chaos, N, N))
    judge("streams outgrowing the prefill pool moved", outcomes, workload, service, may_fail=False, count=N)
    moved = metric_sum(scrape(metrics_dir), "tandem:request_migrations_total") - moved_before
    refused = _transfer_failures(service) - failures_before
    print(f"streams moved {moved:.0f}; hand-offs failed (refused by the prefill worker) {refused}")
    assert moved > 0, "the kill should have caught streams mid-way and moved them"
    assert refused >= moved, f"every moved stream outgrew the prefill pool: {moved:.0f} moved, {refused} refused"
