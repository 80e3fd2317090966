"""Losing a node: the pools of a two-node Ray lose one node under a streaming load.

A head node and a worker node (``ray.cluster_utils.Cluster``, both on this machine)
each offer the custom resources the pools ask for, and each pool's placement group is
spread over both, so a prefill and a decode worker live on the worker node (checked by
the actors' node ids). While greedy requests stream through the dispatcher, the worker
node goes: removed (its raylet stops, takes its workers down and tells the GCS), or
crashed (raylet and workers killed at once; the GCS notices seconds later, so the first
replacements may go into bundles still on the dead node). Every request must complete
with the single engine's tokens (the dead decode worker's streams move, prompts it or
the dead prefill worker held are computed again), the health thread must re-place the
dead workers on the head node (Ray reschedules their bundles there), no KV block may
leak, and the pools must serve new requests afterwards, the replacements included.

The module owns its Ray (a two-node one): a Ray already running in this process (the
session's ``ray_session``, tests/conftest.py) is shut down first and started again with
the session's settings at the end, so modules after this one find it as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import psutil
import pytest
import ray
from ray.cluster_utils import Cluster

from cluster.config import ClusterConfig
from engine import LLM, SamplingParams
from tests.helpers import PATIENCE_S, DispatchedPools, assert_blocks_freed, async_wait_for, wait_for

# The pools ask for one of these per worker. The head has room for every worker, so the
# dead node's can be re-placed there; the worker node, for one of each pool.
HEAD_RESOURCES = {"tandem_prefill": 2, "tandem_decode": 2}
NODE_RESOURCES = {"tandem_prefill": 1, "tandem_decode": 1}
# How soon the GCS declares a silent node dead: 3 missed checks, 1 s apart (about 3 s
# after a crash, measured), not Ray's 5, 3 s apart (15 s or more); each check may take
# 2 s, so a head node slowed down by a busy machine is not declared dead.
FAST_NODE_DEATH = {"health_check_period_ms": 1000, "health_check_timeout_ms": 2000,
                   "health_check_failure_threshold": 3}
N = 12  # requests in flight when the node goes; as many again after
ARRIVAL_S = 0.05  # between two requests' starts: some are still being prefilled when the node goes


def _session_env(tandem_home, metrics_dir) -> dict:
    """The environment ``tests.helpers.local_ray`` gives Ray's processes."""
    return {"TANDEM_HOME": str(tandem_home), "OMP_NUM_THREADS": "1", "PROMETHEUS_MULTIPROC_DIR": metrics_dir}


@pytest.fixture(scope="module")
def head(tandem_home, metrics_dir):
    """A Ray cluster of one head node, the driver connected to it (each test adds the
    worker node it loses). Shut down at the end, whatever happens."""
    session_ray = ray.is_initialized()
    if session_ray:  # one Ray per process: the session's goes until this module is done
        ray.shutdown()
    env = _session_env(tandem_home, metrics_dir)
    settings = {"num_cpus": 2, "resources": HEAD_RESOURCES, "include_dashboard": False,
                "_system_config": FAST_NODE_DEATH}
    nodes = Cluster(initialize_head=True, head_node_args=settings)
    try:
        ray.init(address=nodes.address, logging_level="WARNING", runtime_env={"env_vars": env})
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()
        if session_ray:  # as tests.helpers.local_ray starts it
            ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", runtime_env={"env_vars": env})


@pytest.fixture
def two_nodes(head):
    """The head and a worker node with room for one worker of each pool; yields
    (the ``Cluster``, the worker node), and removes the node at the end if the test did not."""
    worker_node = head.add_node(num_cpus=1, resources=NODE_RESOURCES)
    head.wait_for_nodes()
    yield head, worker_node
    if worker_node in head.worker_nodes:
        head.remove_node(worker_node)


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def workload(tiny_model):
    """2 N prompts of 8 to 200 tokens, 150 to 250 tokens out each, and the single engine's
    greedy output for each."""
    rng = random.Random(11)
    prompts = [[rng.randrange(4000) for _ in range(rng.randint(8, 200))] for _ in range(2 * N)]
    lengths = [rng.randint(150, 250) for _ in range(2 * N)]
    want = [o.token_ids for o in LLM(model=tiny_model, num_kv_blocks=1024).generate(
        prompts, [_params(n) for n in lengths])]
    return prompts, lengths, want


def _config(model: str) -> ClusterConfig:
    """2 prefill + 2 decode workers, each pool spread over the nodes by its custom resource;
    short transfer deadlines, so a transfer from a dead sender is given up quickly."""
    return ClusterConfig.from_dict({
        "model": model, "name": "node-loss", "prefill_workers": 2, "decode_workers": 2,
        "prefill_resources": {"num_cpus": 0.25, "custom": {"tandem_prefill": 1}},
        "decode_resources": {"num_cpus": 0.25, "custom": {"tandem_decode": 1}},
        "placement_strategy": "SPREAD",
        "transfer": {"backend": "collective", "checksums": True, "timeout_s": 5, "op_timeout_s": 10,
                     "lease_s": 15},
        "engine": {"num_kv_blocks": 512, "max_num_batched_tokens": 64},
        "health_check_s": 0.5,
    })


def _node_of(worker) -> str:
    """The id of the Ray node an actor runs on, from the GCS actor table."""
    from ray._private.state import actors  # the state API needs the dashboard

    return actors(actor_id=worker.handle._actor_id.hex())["Address"]["NodeID"]


async def _collect(pools, prompt, n, progress: list[int], index: int):
    """A request's (tokens, errors); ``progress[index]`` follows how many it has streamed."""
    tokens, errors = [], []
    async for delta in pools.dispatcher.generate(prompt, _params(n)):
        tokens += delta.token_ids
        progress[index] = len(tokens)
        if delta.error:
            errors.append(delta.error)
    return tokens, errors


async def _losing_a_node(pools, nodes, worker_node, graceful, doomed, prompts, lengths):
    """Start the requests ``ARRIVAL_S`` apart; remove ``worker_node`` once its decode
    worker streams 2+ of them while its prefill worker has a prompt in hand. Returns
    every request's result, and when the node went."""
    progress = [0] * len(prompts)
    prefill, decode = sorted(doomed, key=lambda w: not w.worker_id.startswith("prefill"))

    async def request(i):
        await asyncio.sleep(i * ARRIVAL_S)
        return await _collect(pools, prompts[i], lengths[i], progress, i)

    jobs = [asyncio.create_task(request(i)) for i in range(len(prompts))]

    async def both_busy():
        p, d = await asyncio.gather(prefill.handle.load.remote(), decode.handle.load.remote())
        prompting = p.queued_prefill_tokens or p.running_chunks or p.waiting or p.sending
        return prompting and d.running >= 2 and sum(n > 0 for n in progress) >= 2

    waited = await async_wait_for(both_busy, PATIENCE_S, lambda: (
        f"{decode.worker_id} streaming 2+ requests while {prefill.worker_id} prefills (streamed: {progress})"))
    streamed, without, lost_at = sum(progress), sum(n == 0 for n in progress), time.monotonic()
    await asyncio.to_thread(nodes.remove_node if graceful else _crasher(nodes), worker_node)
    results = await asyncio.wait_for(asyncio.gather(*jobs), 180)
    print(f"node lost {waited:.1f} s into the load, {streamed} tokens streamed, "
          f"{without} requests without any; the load ended {time.monotonic() - lost_at:.1f} s later")
    return results, lost_at


def _crasher(nodes):
    def crash(node):
        """Kill ``node``'s raylet and every process under it (its workers) at once, as
        when a machine fails: nothing tells the GCS, which finds out when its health
        checks of the node fail."""
        from ray._private import ray_constants

        raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
        below = raylet.children(recursive=True)
        nodes.remove_node(node, allow_graceful=False)
        for process in below:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
    return crash


def _run_all(pools, prompts, lengths):
    """Every request's (tokens, errors), all sent at once."""
    progress = [0] * len(prompts)

    async def main():
        return await asyncio.gather(*(_collect(pools, p, n, progress, i) for i, (p, n) in enumerate(
            zip(prompts, lengths))))

    return asyncio.run(asyncio.wait_for(main(), 120))


def _assert_exact(results, want) -> None:
    for i, ((tokens, errors), expected) in enumerate(zip(results, want)):
        assert not errors, f"request {i} failed: {errors}"
        assert tokens == expected, f"request {i}: {tokens} != single engine {expected}"


def _gone(pids: list[int]) -> bool:
    """No process of ``pids`` runs (a zombie waiting for its parent counts as gone)."""
    def running(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return not any(running(pid) for pid in pids)


def _replaced(pools, dead: set[str]) -> bool:
    """Each pool is back at its size, every worker a live one that answers."""
    refs = pools.workers()
    if (len(pools.prefill_refs()), len(pools.decode_refs())) != (2, 2) or any(w.key in dead for w in refs):
        return False
    try:
        ray.get([w.handle.ready.remote() for w in refs], timeout=PATIENCE_S)
    except ray.exceptions.RayActorError:  # a replacement that died: the next round replaces it
        return False
    return True


@pytest.mark.parametrize("graceful", [True, False], ids=["removed", "crashed"])
def test_a_lost_node_loses_no_request_and_its_workers_come_back_on_the_survivor(two_nodes, workload, tiny_model,
                                                                               graceful):
    """``removed``: the node's raylet is stopped (SIGTERM), takes its workers down and
    tells the GCS at once. ``crashed``: the raylet and its workers are killed (SIGKILL);
    the GCS finds out only when its health checks of the node fail, seconds later."""
    nodes, worker_node = two_nodes
    prompts, lengths, want = workload
    pools = DispatchedPools(_config(tiny_model)).start()
    try:
        placed = {w.worker_id: _node_of(w) for w in pools.workers()}
        doomed = [w for w in pools.workers() if placed[w.worker_id] == worker_node.node_id]
        assert sorted(w.worker_id.split("-")[0] for w in doomed) == ["decode", "prefill"], (
            f"each pool should have one worker on the worker node: {placed}")
        pids = [info["pid"] for info in ray.get([w.handle.ready.remote() for w in doomed])]

        results, lost_at = asyncio.run(
            _losing_a_node(pools, nodes, worker_node, graceful, doomed, prompts[:N], lengths[:N]))
        _assert_exact(results, want[:N])
        wait_for(lambda: _gone(pids), 10, f"the worker node's workers (pids {pids}) to exit")
        assert pools.dispatcher.num_migrations >= 1, "the dead decode worker's streams should have moved"
        _check_replaced_on(pools, doomed, nodes.head_node.node_id, lost_at)
        assert_blocks_freed(pools)

        _assert_replacements_serve(pools, doomed, prompts[N:], lengths[N:], want[N:])
    finally:
        pools.shutdown()


def _assert_replacements_serve(pools, doomed: list, prompts, lengths, want) -> None:
    """More requests complete exactly, the replacements of ``doomed`` taking part, and no
    block is kept."""
    before = {wid: s["prompt_tokens"] + s["generation_tokens"] for wid, s in pools.stats().items()}
    _assert_exact(_run_all(pools, prompts, lengths), want)
    after = {wid: s["prompt_tokens"] + s["generation_tokens"] for wid, s in pools.stats().items()}
    idle = [w.worker_id for w in doomed if after[w.worker_id] == before[w.worker_id]]
    assert not idle, f"the replacements {idle} took no part in the requests"
    assert_blocks_freed(pools)


def _check_replaced_on(pools, doomed: list, head: str, lost_at: float) -> None:
    """The pools get back to 2 + 2 live workers, all on the head node; prints what the
    loss cost (streams moved, transfers the surviving decode worker saw fail)."""
    dead = {w.key for w in doomed}
    wait_for(lambda: _replaced(pools, dead), PATIENCE_S, lambda: f"the pools back at 2 + 2 live workers: "
             f"{[(w.worker_id, w.key) for w in pools.workers()]}")
    now = {w.worker_id: _node_of(w) for w in pools.workers()}
    assert set(now.values()) == {head}, f"every worker should run on the head node {head} now: {now}"
    survivor = next(w.worker_id for w in pools.decode_refs() if w.worker_id not in {d.worker_id for d in doomed})
    stats = pools.stats()[survivor]
    print(f"replaced on the head node {time.monotonic() - lost_at:.1f} s after the loss; "
          f"streams moved: {pools.dispatcher.num_migrations}; transfers that failed on the surviving decode "
          f"worker: {stats['transfer_failures']} {stats['transfer']['failures']}")


def _listed(pools) -> tuple[int, int]:
    return len(pools.prefill_refs()), len(pools.decode_refs())


def test_with_no_room_left_the_pools_serve_on_the_survivors_until_room_comes(two_nodes, workload, tiny_model):
    """The head's spare room is taken (a placement group holds its last prefill and decode
    units) when the worker node goes, so the dead workers' replacements cannot be placed.
    Every request still completes with the single engine's tokens on the workers left;
    the replacements stay starting and unlisted (nothing is placed on them, the health
    thread goes on) while the pools serve; once room comes back they start, are listed
    and take part."""
    from ray.util.placement_group import placement_group, remove_placement_group

    nodes, worker_node = two_nodes
    prompts, lengths, want = workload
    pools = DispatchedPools(_config(tiny_model)).start()
    squatter = None
    try:
        doomed = [w for w in pools.workers() if _node_of(w) == worker_node.node_id]
        squatter = placement_group([{"tandem_prefill": 1}, {"tandem_decode": 1}], strategy="STRICT_PACK")
        assert squatter.wait(PATIENCE_S), "the head's spare units should be free to take"

        results, _ = asyncio.run(_losing_a_node(pools, nodes, worker_node, True, doomed, prompts[:N], lengths[:N]))
        _assert_exact(results, want[:N])
        wait_for(lambda: len(pools.starting()) == 2, PATIENCE_S, lambda: f"two replacements starting: {pools.starting()}")
        assert _listed(pools) == (1, 1), f"only the survivors are listed: {[w.worker_id for w in pools.workers()]}"
        status = pools.status()
        assert sum(w.get("starting", False) for ws in status.values() for w in ws) == 2, status
        assert_blocks_freed(pools)
        half = N + N // 2
        _assert_exact(_run_all(pools, prompts[N:half], lengths[N:half]), want[N:half])  # still serving

        remove_placement_group(squatter)
        squatter = None
        wait_for(lambda: _listed(pools) == (2, 2) and not pools.starting(), PATIENCE_S,
                 lambda: f"the replacements listed once room came back: starting {pools.starting()}")
        _assert_replacements_serve(pools, doomed, prompts[half:], lengths[half:], want[half:])
    finally:
        if squatter is not None:
            remove_placement_group(squatter)
        pools.shutdown()
