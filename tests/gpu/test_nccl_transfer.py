"""KV transfer over NCCL: the collective backend between two Ray actors with a GPU each.

The actors see CUDA, so the backend picks NCCL (through cupy). NCCL refuses two ranks
of one communicator on the same GPU ("Duplicate GPU detected"), so this needs two
devices. The checks follow the CPU conformance suite in
``tests/integration/test_kv_transfer.py``, whose helpers they reuse.
"""

from __future__ import annotations

import pytest
import ray
import torch

from kv_transfer import KVLayout, TransferError
from kv_transfer.config import TransferConfig
from kv_transfer.peer import TransferPeer
from tests.integration.test_kv_transfer import _meta, _transfer

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="NCCL needs one GPU per rank (it refuses two ranks on one GPU); "
    "fewer than 2 CUDA devices here",
)


@pytest.fixture(scope="module")
def peers(tandem_home):
    """Two actors, one GPU each, in one NCCL group."""
    started = not ray.is_initialized()
    if started:
        env = {"TANDEM_HOME": str(tandem_home)}
        ray.init(include_dashboard=False, logging_level="WARNING", runtime_env={"env_vars": env})
    actor = ray.remote(TransferPeer).options(num_cpus=0, num_gpus=1, max_concurrency=64)
    peers = [actor.remote(TransferConfig(backend="collective")) for _ in range(2)]
    ray.get([p.join.remote(2, rank, 0) for rank, p in enumerate(peers)], timeout=120)
    yield peers
    for p in peers:
        ray.kill(p)
    if started:
        ray.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_arrives_intact_both_ways(peers, dtype):
    layout = KVLayout(4, 16, 8, 128, dtype)
    for src, dst in ((0, 1), (1, 0)):
        meta = _meta(f"intact-{dtype}-{src}", src, dst, num_blocks=32, layout=layout)
        sent, got = _transfer(peers[src], peers[dst], meta, seed=src + 1)
        assert got == sent, f"KV sent from rank {src} arrived changed at rank {dst}"


def test_transfers_in_flight_together_each_deliver_their_own_bytes(peers):
    metas = [_meta(f"many-{i}", 0, 1, num_blocks=1 + i) for i in range(6)]
    prepared = [ray.get(peers[0].prepare.remote(m, 10 + i)) for i, m in enumerate(metas)]
    pulls = [peers[1].pull.remote(m, payload) for m, (payload, _) in zip(metas, prepared)]
    ray.get([peers[0].push.remote(m) for m in metas], timeout=60)
    got = [r[0] for r in ray.get(pulls, timeout=60)]
    assert got == [s for _, s in prepared], "each transfer must deliver its own bytes"
    ray.get([peers[0].release.remote(m) for m in metas])


def test_transfer_past_its_deadline_fails_and_the_next_one_arrives(peers):
    meta = _meta("late", 0, 1, deadline_s=-1.0)
    payload, _ = ray.get(peers[0].prepare.remote(meta, 3))
    with pytest.raises(TransferError, match="deadline|timed out"):
        ray.get(peers[1].pull.remote(meta, payload), timeout=30)
    with pytest.raises(TransferError, match="deadline"):
        ray.get(peers[0].push.remote(meta), timeout=30)
    ray.get(peers[0].release.remote(meta))
    sent, got = _transfer(peers[0], peers[1], _meta("after-late", 0, 1), seed=4)
    assert got == sent, "the transfer after a late one must arrive intact"
