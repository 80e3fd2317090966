"""KV transfer between two Ray actors that see a GPU: the collective backend.

Its pairwise gloo channel stages GPU tensors through host memory and the receiver
hands back CUDA tensors. The checks follow the CPU conformance suite in
``tests/integration/test_kv_transfer.py``, whose helpers they reuse; the two actors may
share one GPU.

Needs CUDA and ray: on CPU the conformance suite covers the same code, and the GPU
image has no ray, so ray (and the suite that imports it) is imported only once both
are known to be there.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.gpu.device import ON_GPU

pytestmark = [
    pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (the CPU suite covers the rest)"),
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None, reason="ray is not installed (the GPU image has none)"
    ),
]


@pytest.fixture(scope="module")
def peers(ray_cluster):
    """Two actors sharing the GPUs (Ray finds them itself)."""
    import ray

    from kv_transfer.config import TransferConfig
    from kv_transfer.peer import TransferPeer

    actor = ray.remote(TransferPeer).options(num_cpus=0, num_gpus=0.5, max_concurrency=64)
    peers = [actor.remote(TransferConfig(backend="collective")) for _ in range(2)]
    yield peers
    for p in peers:
        ray.kill(p)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_arrives_intact_both_ways(peers, dtype):
    from kv_transfer import KVLayout
    from tests.integration.test_kv_transfer import _meta, _transfer

    layout = KVLayout(4, 16, 8, 128, dtype)
    for src, dst in ((0, 1), (1, 0)):
        meta = _meta(f"intact-{dtype}-{src}", peers[dst], num_blocks=32, layout=layout)
        sent, got = _transfer(peers[src], peers[dst], meta, seed=src + 1)
        assert got == sent, f"KV sent from rank {src} arrived changed at rank {dst}"


def test_transfers_in_flight_together_each_deliver_their_own_bytes(peers):
    import ray

    from tests.integration.test_kv_transfer import _meta

    metas = [_meta(f"many-{i}", peers[1], num_blocks=1 + i) for i in range(6)]
    prepared = [ray.get(peers[0].prepare.remote(m, 10 + i)) for i, m in enumerate(metas)]
    pulls = [peers[1].pull.remote(m, payload) for m, (payload, _) in zip(metas, prepared)]
    ray.get([peers[0].push.remote(m) for m in metas], timeout=60)
    got = [r[0] for r in ray.get(pulls, timeout=60)]
    assert got == [s for _, s in prepared], "each transfer must deliver its own bytes"
    ray.get([peers[0].release.remote(m) for m in metas])


def test_transfer_past_its_deadline_fails_and_the_next_one_arrives(peers):
    from tests.integration.test_kv_transfer import assert_a_late_transfer_fails_and_the_next_arrives

    assert_a_late_transfer_fails_and_the_next_arrives(peers[0], peers[1])
