"""Prefill and decode workers on a local Ray: same tokens as one engine, no leaked blocks.

Every test runs its requests through a dispatcher over the pools (as a router replica
does) and ends by checking that blocks in use are back to zero on every worker.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from cluster.config import ClusterConfig
from engine import LLM, SamplingParams
from engine.model.model_config import ModelConfig
from engine.wire.messages import KVLayout
from kv_transfer.nixl import unavailable_reason
from tests.helpers import PATIENCE_S, DispatchedPools, assert_blocks_freed, build_hf_checkpoint, wait_for

NUM_REQUESTS = 32
NEEDS_NIXL = pytest.mark.skipif(unavailable_reason() is not None, reason=f"nixl unavailable: {unavailable_reason()}")



def _workload(seed=0, n=NUM_REQUESTS, shared_prefix=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(4000) for _ in range(shared_prefix)]
    prompts = [prefix + [rng.randrange(4000) for _ in range(rng.randint(1, 200))] for _ in range(n)]
    lengths = [rng.randint(1, 32) for _ in range(n)]
    return prompts, lengths


def _params(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model):
    prompts, lengths = _workload()
    llm = LLM(model=tiny_model, num_kv_blocks=1024)
    outs = llm.generate(prompts, [_params(n) for n in lengths])
    return prompts, lengths, [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def pair(ray_cluster, tiny_model):
    """One prefill and one decode worker over the object store, for the tests that set
    their own transfer faults and deadlines on it (``set_transfer``) instead of starting
    a cluster each. Its own name keeps its actors apart from the other tests' clusters."""
    cluster = _start(tiny_model, 1, 1, "object_store", name="pair")
    yield cluster
    cluster.shutdown()


def _set_transfer(cluster, **settings):
    from kv_transfer.config import TransferConfig

    cluster.set_transfer(TransferConfig.from_dict({"backend": cluster.config.transfer.backend, **settings}))


def _start(model, prefill=1, decode=1, backend="collective", name="tandem", token_channel="tcp", **transfer):
    cfg = ClusterConfig.from_dict(
        {
            "name": name,
            "model": model,
            "prefill_workers": prefill,
            "decode_workers": decode,
            "transfer": {"backend": backend, "checksums": True, **transfer},
            "engine": {"num_kv_blocks": 512},
            "restart_workers": False,
            "token_channel": token_channel,
        }
    )
    return DispatchedPools(cfg).start()


async def _collect(cluster, prompt, n, progress: list[int] | None = None, index: int = 0):
    """A request's (tokens, errors, finish reason); ``progress[index]``, if given,
    follows how many tokens it has streamed so far."""
    tokens, errors, finish = [], [], None
    async for delta in cluster.dispatcher.generate(prompt, _params(n)):
        tokens += delta.token_ids
        if progress is not None:
            progress[index] = len(tokens)
        if delta.error:
            errors.append(delta.error)
        finish = delta.finish_reason
    return tokens, errors, finish


def _run_all(cluster, prompts, lengths, timeout=120):
    async def main():
        jobs = [_collect(cluster, p, n) for p, n in zip(prompts, lengths)]
        return await asyncio.wait_for(asyncio.gather(*jobs), timeout)

    return asyncio.run(main())


@pytest.mark.parametrize(
    "backend,prefill,decode",
    [
        ("collective", 1, 1), ("collective", 2, 2), ("object_store", 1, 1), ("object_store", 2, 2),
        pytest.param("nixl", 2, 2, marks=NEEDS_NIXL),
    ],
)
def test_disaggregated_greedy_matches_single_engine(ray_cluster, tiny_model, reference, backend, prefill, decode):
    prompts, lengths, want = reference
    cluster = _start(tiny_model, prefill, decode, backend)
    try:
        results = _run_all(cluster, prompts, lengths)
        for i, ((tokens, errors, _), expected) in enumerate(zip(results, want)):
            assert not errors, f"request {i} failed: {errors}"
            assert tokens == expected, f"request {i}: {tokens} != single engine {expected}"
        stats = cluster.stats()
        # A prompt split over several steps goes in parts with paged backends (pipelined).
        sent = sum(s["transfer"]["sent"] for w, s in stats.items() if w.startswith("prefill"))
        assert sent >= NUM_REQUESTS, f"expected at least {NUM_REQUESTS} KV transfers, saw {sent}"
        # Identical tokens alone would not tell a working receive path from local recomputes.
        decode = {w: s for w, s in stats.items() if w.startswith("decode")}
        received = sum(s["transfer"]["received"] for s in decode.values())
        assert received == sent, f"decode workers received {received} of the {sent} transfers sent"
        streams = {w: s["streams"] for w, s in decode.items()}
        assert all(s["channel"] > 0 and s["ray"] == 0 for s in streams.values()), f"not all on channels: {streams}"
        failures = {w: (s["transfer_failures"], s["transfer"]["failures"]) for w, s in decode.items()}
        assert all(n == 0 and not f for n, f in failures.values()), f"transfers failed or recomputed: {failures}"
        if prefill == 2:
            busy = [s["prompt_tokens"] > 0 for w, s in stats.items()]
            assert all(busy), f"every worker should have taken requests: {stats.keys()} {busy}"
        assert_blocks_freed(cluster)
    finally:
        cluster.shutdown()


@pytest.mark.parametrize(
    "backend,pipeline",
    [pytest.param("nixl", True, marks=NEEDS_NIXL), pytest.param("nixl", False, marks=NEEDS_NIXL), ("collective", True)],
)
def test_pipelined_prefill_hands_over_finished_chunks_early(ray_cluster, tiny_model, backend, pipeline):
    """With a 32-token chunk budget a 100-300 token prompt takes 4-10 steps; pipelined, the
    decode worker reads the blocks of each finished chunk while the next computes, and the
    tokens are the single engine's either way. Sent again, each prompt's full blocks are
    in the decode worker's prefix cache: only its last block is read."""
    rng = random.Random(5)
    prompts = [[rng.randrange(4000) for _ in range(rng.randint(100, 300))] for _ in range(6)]
    lengths = [8] * len(prompts)
    want = [o.token_ids for o in LLM(model=tiny_model, num_kv_blocks=256).generate(prompts, _params(8))]
    cfg = ClusterConfig.from_dict({
        "model": tiny_model, "prefill_workers": 1, "decode_workers": 1, "restart_workers": False,
        "transfer": {"backend": backend, "pipeline": pipeline, "checksums": True},
        "engine": {"num_kv_blocks": 256, "max_num_batched_tokens": 32},
    })
    cluster = DispatchedPools(cfg).start()
    try:
        results = _run_all(cluster, prompts, lengths)
        assert [r[1] for r in results] == [[]] * len(prompts), "no request may fail"
        assert [r[0] for r in results] == want
        stats = cluster.stats()
        sent, received = stats["prefill-0"]["transfer"]["sent"], stats["decode-0"]["transfer"]["received"]
        assert sent == received, f"every offer read: {sent} sent, {received} received"
        assert stats["decode-0"]["transfer_failures"] == 0 and not stats["decode-0"]["transfer"]["failures"], (
            stats["decode-0"]["transfer"]["failures"]
        )
        if pipeline:  # at least one part per request beyond its final read
            assert received >= 2 * len(prompts), f"{received} reads for {len(prompts)} chunked prompts"
        else:
            assert received == len(prompts)
        first_bytes = stats["decode-0"]["transfer"]["bytes_received"]
        again = _run_all(cluster, prompts, lengths)
        assert [r[1] for r in again] == [[]] * len(prompts) and [r[0] for r in again] == want
        again_bytes = cluster.stats()["decode-0"]["transfer"]["bytes_received"] - first_bytes
        blocks = [-(-len(p) // 16) for p in prompts]
        last = [b - (len(p) - 1) // 16 for b, p in zip(blocks, prompts)]  # 1 each: the held ones are full
        assert again_bytes * sum(blocks) == first_bytes * sum(last), (
            f"the second time, {again_bytes / first_bytes * sum(blocks):.1f} blocks were read, "
            f"not the {sum(last)} last ones")
        assert_blocks_freed(cluster)
    finally:
        cluster.shutdown()


def test_prefill_prefix_cache_hits_are_counted(pair):
    prompts, lengths = _workload(seed=5, n=12, shared_prefix=96)
    _set_transfer(pair)
    hits_before = asyncio.run(_load(pair.prefill_refs()[0])).prefix_cache_hits
    # One first, so the shared prefix is cached before the rest arrive.
    _run_all(pair, prompts[:1], lengths[:1])

    async def cached_tokens(prompt, n):  # what the usage will report
        return max([d.num_cached_tokens async for d in pair.dispatcher.generate(prompt, _params(n))])

    async def rest():
        return await asyncio.gather(*(cached_tokens(p, n) for p, n in zip(prompts[1:], lengths[1:])))

    cached = asyncio.run(rest())
    assert all(c >= 96 for c in cached), f"each request's usage should report the shared prefix: {cached}"
    hits = asyncio.run(_load(pair.prefill_refs()[0])).prefix_cache_hits - hits_before
    assert hits >= 11 * 96, f"expected >= {11 * 96} hit tokens, got {hits}"
    assert_blocks_freed(pair)


async def _load(ref):
    return await ref.handle.load.remote()


def test_ps_shows_each_pool_worker_by_its_id_and_role(pair):
    """Between calls Ray titles an actor's process ``ray::<its class>``: a pool worker's
    reads ``ray::<worker id>:<role's class>`` (``ray::decode-0:DecodeWorker``), not
    ``ray::PoolWorker`` whatever its role, and its answers say which process it is."""
    import psutil

    classes = {"prefill": "PrefillWorker", "decode": "DecodeWorker"}
    workers = [(w["worker_id"], classes[role], w["pid"]) for role, ws in pair.status().items() for w in ws]
    assert sorted(w[0] for w in workers) == ["decode-0", "prefill-0"], workers

    def title(pid: int) -> str:
        return " ".join(psutil.Process(pid).cmdline()).rstrip()  # (padded with spaces to its first length)

    for worker_id, cls, pid in workers:
        want = f"ray::{worker_id}:{cls}"
        # (While a call runs the title is ``ray::PoolWorker.<call>``: a health ping may be one.)
        wait_for(lambda: title(pid) == want, PATIENCE_S, lambda: f"{want}, not {title(pid)!r}")


def test_injected_transfer_failure_recomputes_same_tokens(ray_cluster, tiny_model, reference):
    prompts, lengths, want = reference
    cluster = _start(tiny_model, 1, 1, "collective", failure_policy="recompute", faults={"drop_rate": 1.0})
    try:
        results = _run_all(cluster, prompts[:8], lengths[:8])
        assert [r[0] for r in results] == want[:8], "recompute after a failed transfer must give the same tokens"
        decode_stats = cluster.stats()["decode-0"]
        assert decode_stats["transfer"]["failures"].get("injected", 0) == 8, decode_stats["transfer"]
        assert_blocks_freed(cluster)
    finally:
        cluster.shutdown()


def test_injected_transfer_failure_under_fail_policy_is_a_clear_error(pair, reference):
    prompts, lengths, _ = reference
    _set_transfer(pair, failure_policy="fail", faults={"drop_rate": 1.0})
    results = _run_all(pair, prompts[:4], lengths[:4])
    for tokens, errors, finish in results:
        assert finish == "error" and errors, f"expected a clear error, got {finish} {errors}"
        assert "transfer failed" in errors[0], errors
        assert tokens == [], "a failed request must not stream tokens"
    assert_blocks_freed(pair)


def test_transfer_slower_than_deadline_falls_back_to_recompute(pair, reference):
    prompts, lengths, want = reference
    _set_transfer(pair, timeout_s=0.5, faults={"delay_s": 1.0})
    before = pair.stats()["decode-0"]["transfer"]["failures"].get("timeout", 0)
    results = _run_all(pair, prompts[:4], lengths[:4])
    assert [r[0] for r in results] == want[:4]
    failures = pair.stats()["decode-0"]["transfer"]["failures"]
    assert failures.get("timeout", 0) - before >= 4, failures
    assert_blocks_freed(pair)


def test_a_decode_worker_killed_mid_stream_loses_no_stream(ray_cluster, tiny_model):
    import ray

    prompts, _ = _workload(seed=9, n=16)
    lengths = [200] * len(prompts)  # long enough to be mid-stream when the kill lands
    llm = LLM(model=tiny_model, num_kv_blocks=1024)
    want = [o.token_ids for o in llm.generate(prompts, [_params(n) for n in lengths])]
    cfg = ClusterConfig.from_dict(
        {
            "model": tiny_model,
            "prefill_workers": 1,
            "decode_workers": 2,
            "transfer": {"backend": "object_store"},
            "engine": {"num_kv_blocks": 1024},
            "restart_workers": False,
        }
    )
    cluster = DispatchedPools(cfg).start()
    try:
        victim = cluster.decode_refs()[0]

        progress = [0] * len(prompts)  # tokens streamed so far, per request

        async def main():
            jobs = [asyncio.ensure_future(_collect(cluster, p, n, progress, i))
                    for i, (p, n) in enumerate(zip(prompts, lengths))]  # fmt: skip
            # Until the victim runs several requests and every stream has had tokens:
            # only a stream whose tokens reached the router is moved (a migration); one
            # that had none is re-run.
            for _ in range(600):
                load = await victim.handle.load.remote()
                if load.running >= 3 and all(progress):
                    break
                await asyncio.sleep(0.05)
            assert load.running >= 3 and all(progress), f"the kill must land mid-stream: {load}, {progress}"
            assert not any(j.done() for j in jobs), "the kill must land mid-stream"
            ray.kill(victim.handle, no_restart=True)
            return await asyncio.wait_for(asyncio.gather(*jobs), 120)  # none may hang

        results = asyncio.run(main())
        assert [r[1] for r in results] == [[]] * len(results), "no stream may end with an error"
        assert [r[0] for r in results] == want, "moved streams must give the undisturbed engine's tokens"
        assert cluster.dispatcher.num_migrations >= 3, "the streams on the dead worker should have moved"
        replaced = cluster.check_health()
        assert replaced == ["decode-0"], replaced
        # Moved through the prefill worker: it sent each moved stream's KV once more (and
        # that of any stream re-run before its first token), and the surviving decode
        # worker recomputed nothing.
        stats = cluster.stats()
        assert stats["prefill-0"]["transfer"]["sent"] >= len(prompts) + cluster.dispatcher.num_migrations
        assert stats["decode-1"]["transfer_failures"] == 0
        assert_blocks_freed(cluster)
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("family", ["qwen3", "phi3", "gemma3", "mixtral", "qwen3_moe", "qwen2_window"])
def test_every_family_disaggregated_matches_single_engine(ray_cluster, tmp_path_factory, default_model, family):
    """Each family's checkpoint in 1P+1D over paged transfers: the single engine's tokens
    (which are transformers': test_hf_parity), every transfer received. Qwen3 (per-head
    q/k norms, a head_dim of its own), Phi-3 (fused projections), Gemma 3 (sliding and
    global layers), Mixtral and Qwen3-MoE (experts), a Qwen2 with one sliding layer;
    Mistral, whose every layer slides, has a test of its own below."""
    from tests.unit.test_hf_parity import FAMILY_INIT, INIT

    model = str(build_hf_checkpoint(tmp_path_factory.mktemp(family), family, default_model,
                                    **FAMILY_INIT.get(family, INIT)))
    prompts, lengths = _workload(seed=5, n=8)
    want = [o.token_ids for o in LLM(model=model).generate(prompts, [_params(n) for n in lengths])]
    cluster = _start(model, 1, 1, "collective", name=family)
    try:
        results = _run_all(cluster, prompts, lengths)
        assert [r[0] for r in results] == want, "1P+1D must give the single engine's tokens"
        decode = cluster.stats()["decode-0"]
        assert decode["transfer"]["received"] >= len(prompts) and decode["transfer_failures"] == 0
        assert_blocks_freed(cluster)
    finally:
        cluster.shutdown()


def test_a_sliding_window_model_disaggregated_matches_single_engine(ray_cluster, tmp_path_factory, default_model):
    """Mistral with every layer sliding (a 48-token window) in 1P+1D: the blocks behind the
    window at the prompt's end are neither sent nor kept by the decode worker, and a later
    prompt whose leading blocks the decode worker's prefix cache serves still gets the single
    engine's tokens (a cached block must hold its tokens' KV, never a stand-in's)."""
    model = str(build_hf_checkpoint(tmp_path_factory.mktemp("mistral-window"), "mistral", default_model,
                                    initializer_range=0.2))
    rng = random.Random(7)
    base = [rng.randrange(4000) for _ in range(200)]
    prompts = [base, base[:100] + [rng.randrange(4000) for _ in range(12)], base + [rng.randrange(4000) for _ in range(30)]]
    lengths = [12, 12, 12]
    want = [o.token_ids for o in LLM(model=model).generate(prompts, [_params(n) for n in lengths])]
    c = ModelConfig.from_pretrained(model)
    layout = KVLayout(c.num_layers, 16, c.num_kv_heads, c.head_dim, "float32")
    cluster = _start(model, 1, 1, "collective", name="window")
    try:
        got = [_run_all(cluster, [prompts[0]], [lengths[0]])[0][0]]
        sent = cluster.stats()["decode-0"]["transfer"]["bytes_received"]
        # 200 tokens in 13 blocks of 16; the 9 wholly before position 200 - 48 are not sent.
        assert sent == layout.nbytes(13 - 9), f"{sent} bytes received, {layout.nbytes(13)} for the whole prompt"
        got += [_run_all(cluster, [p], [n])[0][0] for p, n in zip(prompts[1:], lengths[1:])]  # one after another
        assert got == want, "1P+1D must give the single engine's tokens"
        assert_blocks_freed(cluster)
    finally:
        cluster.shutdown()


def test_short_prompts_computed_by_their_decode_worker_match_single_engine(ray_cluster, tiny_model, reference):
    """Per-request disaggregation: prompts of at most 64 tokens run whole on their decode
    worker (no reservation, no transfer), the others through the prefill worker; every
    output is the single engine's, and only the long prompts' KV moved."""
    import dataclasses

    from router.dispatch import Dispatcher

    prompts, lengths, want = reference
    cluster = _start(tiny_model, 1, 1, "collective", name="local")
    try:
        dispatch = dataclasses.replace(cluster.dispatcher.config, local_prefill_tokens=64)
        cluster.dispatcher.close()
        cluster.dispatcher = Dispatcher(cluster.prefill_refs, cluster.decode_refs, dispatch)
        results = _run_all(cluster, prompts, lengths)
        assert [r[0] for r in results] == want, "local or not, the single engine's tokens"
        short = sum(len(p) <= 64 for p in prompts)
        assert 0 < short < len(prompts), "the workload should have prompts on both sides of 64 tokens"
        assert cluster.dispatcher.num_local_prefills == {"short": short}
        received = cluster.stats()["decode-0"]["transfer"]["received"]
        assert received >= len(prompts) - short, "every long prompt's KV came from the prefill worker"
        assert cluster.stats()["prefill-0"]["prompt_tokens"] == sum(len(p) for p in prompts if len(p) > 64)
        assert_blocks_freed(cluster)
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("channel", ["tcp", "ray"])
def test_colocated_workers_match_single_engine(ray_cluster, tiny_model, reference, channel):
    prompts, lengths, want = reference
    cluster = _start(tiny_model, prefill=0, decode=2, token_channel=channel)
    try:
        results = _run_all(cluster, prompts, lengths)
        assert [r[0] for r in results] == want, "colocated workers must give the single engine's tokens"
        stats = cluster.stats()
        assert set(stats) == {"colocated-0", "colocated-1"}
        used, unused = ("channel", "ray") if channel == "tcp" else ("ray", "channel")
        streams = {w: s["streams"] for w, s in stats.items()}
        assert all(s[used] > 0 and s[unused] == 0 for s in streams.values()), f"not all over {used}: {streams}"
        assert_blocks_freed(cluster)
    finally:
        cluster.shutdown()


def test_topology_yaml_with_overrides(tmp_path):
    path = tmp_path / "topology.yaml"
    path.write_text(
        "prefill_workers: 2\n"
        "decode_workers: 3\n"
        "decode_resources: {num_cpus: 1, num_gpus: 1}\n"
        "transfer: {backend: object_store, failure_policy: fail}\n"
        "engine: {max_num_batched_tokens: 512}\n"
        "decode_engine: {num_kv_blocks: 100}\n"
    )
    cfg = ClusterConfig.from_yaml(path, decode_workers=4, prefill_workers=None)
    assert (cfg.prefill_workers, cfg.decode_workers) == (2, 4), "flags override the file, None keeps it"
    assert cfg.decode_resources.num_gpus == 1 and cfg.transfer.failure_policy == "fail"
    assert cfg.engine_config("decode").num_kv_blocks == 100
    assert cfg.engine_config("prefill").num_kv_blocks is None
    assert cfg.engine_config("prefill").max_num_batched_tokens == 512
    with pytest.raises(ValueError, match="unknown topology settings"):
        ClusterConfig.from_dict({"prefil_workers": 1})
    with pytest.raises(ValueError, match="backend"):
        ClusterConfig.from_dict({"transfer": {"backend": "carrier-pigeon"}})
    with pytest.raises(ValueError, match="unknown engine setting"):
        ClusterConfig.from_dict({"engine": {"blok_size": 8}})


def test_injected_transfer_failures_reach_the_metrics(pair, reference, metrics_dir):
    from tests.helpers import metric_sum, scrape

    prompts, lengths, _ = reference
    _set_transfer(pair, faults={"drop_rate": 1.0})
    before = metric_sum(scrape(metrics_dir), "tandem:kv_transfer_failures_total", role="decode", reason="injected")
    _run_all(pair, prompts[:3], lengths[:3])
    after = metric_sum(scrape(metrics_dir), "tandem:kv_transfer_failures_total", role="decode", reason="injected")
    assert after - before == 3, f"3 dropped transfers, counter moved by {after - before}"
    assert_blocks_freed(pair)


def test_stream_interval_sends_fewer_messages_with_the_same_tokens(ray_cluster, tiny_model, reference):
    prompts, lengths, want = reference
    cfg = ClusterConfig.from_dict(
        {"model": tiny_model, "prefill_workers": 0, "decode_workers": 1, "engine": {"num_kv_blocks": 512},
         "restart_workers": False, "stream_interval_s": 0.1}
    )
    cluster = DispatchedPools(cfg).start()

    async def deltas(prompt, n):
        return [d async for d in cluster.dispatcher.generate(prompt, _params(n))]

    try:
        i = max(range(len(lengths)), key=lambda j: lengths[j])  # the longest output
        got = asyncio.run(deltas(prompts[i], lengths[i]))
        assert [t for d in got for t in d.token_ids] == want[i]
        assert len(got) < lengths[i] / 2, f"{len(got)} messages for {lengths[i]} tokens"
        assert_blocks_freed(cluster)
    finally:
        cluster.shutdown()
