"""Tensor-parallel workers in the service's settings and pools, without Ray (its calls are faked).

A worker at ``tensor_parallel_size`` N asks one placement group of N bundles on one node:
its own bundle, then a bundle of the same CPUs and GPUs (no custom resources) a rank; its
actor gets what starts the other ranks there. At one rank the pools place and start workers
as they always did. Above one rank the service must be colocated (the KV transfer between
workers runs at one rank only), refused with a message naming the limit, in the config, the
flags and the Helm chart alike.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

import cluster.pool_placement as pool_placement
import cluster.pools as pools
from cluster.config import ClusterConfig, Resources
from cluster.rank_actors import RayRankGroup
from kv_transfer.config import TransferConfig

TP2 = {"tensor_parallel_size": 2}


@pytest.mark.parametrize("settings", [
    dict(decode_engine=TP2),
    dict(prefill_engine=TP2),
    dict(engine=TP2),
], ids=["decode", "prefill", "both"])
def test_a_disaggregated_service_above_one_rank_needs_nixl_naming_the_limit(settings):
    """Only nixl reads a rank's share of a block in place (``kv_transfer.sharded``)."""
    with pytest.raises(ValueError, match=r"tensor_parallel_size .* needs transfer.backend nixl, got 'collective'"):
        ClusterConfig(prefill_workers=1, transfer=TransferConfig(backend="collective"), **settings)
    config = ClusterConfig(prefill_workers=1, transfer=TransferConfig(backend="nixl"), **settings)
    assert {config.tensor_parallel_size("prefill"), config.tensor_parallel_size("decode")} >= {2}


def test_a_colocated_service_takes_tensor_parallel_workers_one_gpu_a_rank():
    config = ClusterConfig(prefill_workers=0, decode_engine=TP2,
                           decode_resources=Resources(num_cpus=2, num_gpus=1, custom={"tandem_decode": 1}))
    assert config.tensor_parallel_size("colocated") == 2
    assert config.worker_bundles("colocated") == [{"CPU": 2, "GPU": 1, "tandem_decode": 1}, {"CPU": 2, "GPU": 1}]
    with pytest.raises(ValueError, match="decode_resources.num_gpus is 2: .* 0 or 1 GPU a rank"):
        ClusterConfig(prefill_workers=0, decode_engine=TP2, decode_resources=Resources(num_gpus=2))


class _PG:
    """A placement group the faked ``placement_group`` made: its bundles and strategy."""

    def __init__(self, bundles, strategy) -> None:
        self.bundle_specs, self.strategy = bundles, strategy

    def wait(self, timeout_s) -> bool:
        return True


@pytest.fixture
def placed(monkeypatch):
    made: list[_PG] = []
    monkeypatch.setattr(pool_placement, "placement_group", lambda bundles, strategy="PACK": made.append(
        _PG(bundles, strategy)) or made[-1])
    return made


def test_at_one_rank_a_pool_is_one_group_of_a_bundle_a_worker(placed):
    c = pools.TandemCluster(ClusterConfig(prefill_workers=0, decode_workers=3))
    c._place_pools(deadline=float("inf"))
    assert [(pg.bundle_specs, pg.strategy) for pg in placed] == [([{"CPU": 0.25}] * 3, "PACK")]
    assert [(s.pg, s.bundle) for s in c._slots] == [(placed[0], i) for i in range(3)]
    assert c._own_pgs == []


def test_above_one_rank_each_worker_has_a_group_of_a_bundle_a_rank_on_one_node(placed):
    c = pools.TandemCluster(ClusterConfig(prefill_workers=0, decode_workers=2, decode_engine={"tensor_parallel_size": 3}))
    c._place_pools(deadline=float("inf"))
    assert [(pg.bundle_specs, pg.strategy) for pg in placed] == [([{"CPU": 0.25}] * 3, "STRICT_PACK")] * 2
    assert [(s.pg, s.bundle) for s in c._slots] == [(placed[0], 0), (placed[1], 0)]
    assert c._own_pgs == placed, "a worker's own group goes with it when it is drained"


class _Remote:
    """``ray.remote(cls)``: records the actor options and constructor arguments."""

    def __init__(self, cls) -> None:
        self.cls = cls

    def options(self, **options):
        self.options_ = options
        return self

    def remote(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
        return self


@pytest.mark.parametrize("size", [1, 2])
def test_a_workers_actor_gets_what_starts_its_other_ranks_in_the_next_bundles(monkeypatch, placed, size):
    monkeypatch.setattr(pools.ray, "remote", _Remote)
    c = pools.TandemCluster(ClusterConfig(prefill_workers=0, decode_engine={"tensor_parallel_size": size},
                                          decode_resources=Resources(num_cpus=0.5, custom={"tandem_decode": 1})))
    c._place_pools(deadline=float("inf"))
    (slot,) = c._slots
    actor = c._spawn(slot).handle
    assert actor.options_["resources"] == {"tandem_decode": 1} and actor.options_["num_cpus"] == 0.5
    if size == 1:
        assert "ranks" not in actor.kwargs, "one rank: the worker starts as it always did"
    else:
        name = actor.options_["name"]
        assert actor.kwargs["ranks"] == RayRankGroup(2, slot.pg, 0, 0.5, 0.0, name)


# -- the Helm chart --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chart():
    pytest.importorskip("helm_python", reason="pip install helm-python-sdk (the test extra)")
    from tests.unit.test_deploy import CHART, OfflineChart

    c = OfflineChart.load(CHART)
    yield c
    c.close()


def _topology(chart, values: dict) -> dict:
    from tests.unit.test_deploy import RELEASE, _by_kind, _split

    (rs,) = _by_kind(_split(chart.render(values, name=RELEASE)), "RayService")
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    return app["args"]["topology"]


def test_the_decode_groups_tensor_parallel_size_reaches_a_colocated_topology(chart):
    colocated = {"prefill_workers": 0, "decode_engine": {"kv_cache_memory": 1 << 30}}
    topology = _topology(chart, {"decode": {"tensorParallelSize": 2}, "serve": {"topology": colocated}})
    assert topology["decode_engine"] == {"kv_cache_memory": 1 << 30, "tensor_parallel_size": 2}
    assert ClusterConfig.from_dict(topology).tensor_parallel_size("colocated") == 2
    assert "decode_engine" not in _topology(chart, {}), "one rank renders the topology as it always did"


def test_each_groups_tensor_parallel_size_reaches_a_disaggregated_topology_over_nixl(chart):
    topology = _topology(chart, {"prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 1}})
    assert topology["transfer"]["backend"] == "nixl", "the chart's default transfer reads each rank's share"
    config = ClusterConfig.from_dict(topology)
    assert (config.tensor_parallel_size("prefill"), config.tensor_parallel_size("decode")) == (2, 1)


@pytest.mark.parametrize("values, message", [
    ({"decode": {"tensorParallelSize": 2}, "serve": {"topology": {"transfer": {"backend": "collective"}}}},
     "decode.tensorParallelSize 2: with a prefill pool, above one rank needs serve.topology.transfer.backend nixl"),
    ({"prefill": {"tensorParallelSize": 2}, "serve": {"topology": {"prefill_workers": 0}}},
     "prefill.tensorParallelSize 2: a colocated topology"),
    ({"serve": {"topology": {"engine": TP2}}}, "serve.topology.engine.tensor_parallel_size: set prefill."),
])
def test_tensor_parallel_values_the_app_would_refuse_fail_to_render(chart, values, message):
    from helm_python import HelmRenderError

    with pytest.raises(HelmRenderError, match=re.escape(message)):
        chart.render(values, name="tandem")


def test_a_tensor_parallel_worker_must_fit_one_pods_gpus(chart):
    gpu = {"prefill_workers": 0, "decode_resources": {"num_cpus": 1, "num_gpus": 1}}
    fits = {"decode": {"gpus": 2, "tensorParallelSize": 2}, "serve": {"topology": gpu}}
    chart.render(fits, name="tandem")
    from helm_python import HelmRenderError

    with pytest.raises(HelmRenderError, match=re.escape("decode: 1 workers asking 2 GPU each do not fit 1 pods "
                                                             "offering 1 each")):
        chart.render({**fits, "decode": {"gpus": 1, "tensorParallelSize": 2}}, name="tandem")


def test_the_values_schema_takes_a_groups_tensor_parallel_size():
    from pathlib import Path

    schema = json.loads((Path(__file__).resolve().parents[2] / "deploy" / "helm" / "tandem" / "values.schema.json")
                        .read_text())
    assert schema["definitions"]["group"]["properties"]["tensorParallelSize"]["minimum"] == 1


# -- a worker's side of its rank actors ----------------------------------------------------


class _BrokenGroup:
    """Two ranks whose collectives fail (rank 1 died mid-step)."""

    rank, size = 0, 2

    def broadcast_object(self, obj=None):
        raise RuntimeError("Connection closed by peer")

    def close(self) -> None:
        pass


class _DeadRanks:
    """``RankProcesses`` whose rank 1 died."""

    def __init__(self) -> None:
        self.stopped: list[bool] = []

    def failure(self, wait_s: float = 2.0) -> str:
        return "rank 1: its actor died"

    def stop(self, graceful: bool) -> None:
        self.stopped.append(graceful)


def test_a_failed_step_ends_the_worker_before_its_requests_are_failed_one_by_one():
    from cluster.rank_actors import WorkerTensorParallel
    from engine.ranks import RankFailure

    ended: list[str] = []
    ranks = _DeadRanks()
    tp = WorkerTensorParallel(_BrokenGroup(), ranks, on_failure=ended.append)
    with pytest.raises(RankFailure):
        tp.execute(runner=None, step=None)
    assert len(ended) == 1 and "rank 1: its actor died" in ended[0] and "Connection closed" in ended[0]
    assert ranks.stopped == [False], "the other ranks are killed first"
