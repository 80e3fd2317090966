"""The RayService application builder (``cluster.service:app``) on a local Ray, called
as Serve's build task calls it (no Serve here).

- Builds that run at once share one start of the detached controller: one set of
  placement groups, one result; a finished start returns its result to later builds.
- A start past ``start_timeout_s`` removes every placement group it made (also the
  pools that were placed) and raises an error naming the pool, what it asked for and
  the deadline; the build tries again after a backoff (the next build, too, starts
  afresh), under the timeout its args give.
- The controller's name carries a hash of its settings: changed settings get a new
  controller and the old one is stopped with its pools; the same settings reuse it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from ray.util.placement_group import placement_group_table

from cluster import service
from cluster.config import ClusterConfig
from cluster.controller import controller_name
from cluster.pools import StartTimeout
from tests.helpers import wait_for

BUILDS_AT_ONCE = 3


def _args(model: str, start_timeout_s: float | None = None, worker_resources: dict | None = None,
          start_attempts: int | None = None, **topology) -> dict:
    """Application args as the chart renders them: a colocated worker on a tiny model."""
    settings = {
        "model": model,
        "prefill_workers": 0,
        "decode_workers": 1,
        "decode_resources": {"num_cpus": 0.25},
        "prefill_resources": {"num_cpus": 0.25},
        "transfer": {"backend": "object_store"},
        "engine": {"num_kv_blocks": 64},
        "restart_workers": False,
        **topology,
    }
    args = {"topology": settings, "worker_resources": worker_resources or {}}
    if start_timeout_s is not None:
        args["start_timeout_s"] = start_timeout_s
    if start_attempts is not None:
        args["start_attempts"] = start_attempts
    return args


def _controllers() -> list[str]:
    return sorted(n for n in ray.util.list_named_actors() if "-controller" in n)


def _groups_since(before: set[str]) -> dict[str, str]:
    """The state of each placement group made since ``before`` (their ids)."""
    return {pg: t["state"] for pg, t in placement_group_table().items() if pg not in before}


def _build_at_once(args: dict, n: int = BUILDS_AT_ONCE) -> list:
    """``n`` builds started together: each an application, or the error it raised."""
    def build(_):
        try:
            return service.app(args)
        except Exception as e:
            return e

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(build, range(n)))


@pytest.fixture
def builder(ray_cluster):
    """The builder's module, with no controller left over after the test."""
    yield service
    for name in _controllers():
        ray.kill(ray.get_actor(name), no_restart=True)
    wait_for(lambda: not _controllers(), 30, "the test's controllers to be gone")


def test_builds_at_once_share_one_start(builder, tiny_model):
    before = set(placement_group_table())
    results = _build_at_once(_args(tiny_model))
    assert not [r for r in results if isinstance(r, Exception)], results
    (name,) = _controllers()
    groups = _groups_since(before)
    assert list(groups.values()) == ["CREATED"], f"one pool, so one placement group; got {groups}"
    controller = ray.get_actor(name)
    info = ray.get(controller.start.remote())  # a finished start: its result, nothing new placed
    assert info == ray.get(controller.model_info.remote()) and info["decode_workers"] == 1
    assert _groups_since(before) == groups
    _prefill, decode = ray.get(controller.workers.remote())
    assert len(decode) == 1, f"one worker expected, the controller has {decode}"


def test_a_start_past_its_deadline_removes_its_placement_groups(builder, tiny_model):
    """The prefill pool is placed; the decode pool asks for a resource no node offers.
    (One start a build here: ``start_attempts``; the next test retries.)"""
    before = set(placement_group_table())
    args = _args(tiny_model, start_timeout_s=2, prefill_workers=1, start_attempts=1,
                 worker_resources={"decode": {"tandem_missing": 1}})
    results = _build_at_once(args, 2)
    for error in results:
        assert isinstance(error, StartTimeout), f"expected a StartTimeout, got {error!r}"
        assert "decode pool: 1 worker(s) asking" in str(error) and "'tandem_missing': 1" in str(error), error
        assert "start_timeout_s=2 s" in str(error) and "'tandem_missing': 0}" in str(error), error
    first = _groups_since(before)
    assert len(first) == 2, f"one start (prefill and decode groups) for both builds; got {first}"
    wait_for(lambda: set(_groups_since(before).values()) == {"REMOVED"}, 30,
             lambda: f"every placement group of the failed start removed: {_groups_since(before)}")

    with pytest.raises(StartTimeout):  # a failed start is not kept: the next build tries again
        builder.app(args)
    assert len(_groups_since(before)) == 4
    wait_for(lambda: set(_groups_since(before).values()) == {"REMOVED"}, 30,
             lambda: f"the second start's placement groups removed: {_groups_since(before)}")


def test_a_build_retries_a_timed_out_start_under_the_timeout_it_is_given_and_each_try_cleans_up(
    builder, tiny_model, monkeypatch,
):
    """A build whose start times out tries again after a backoff (shortened here), each
    failed start having removed its placement groups; a build with a longer timeout finds
    the same controller (the timeout is not in its name) and starts under the new one."""
    monkeypatch.setattr(service, "START_BACKOFF_S", (0.1, 0.1))
    before = set(placement_group_table())
    missing = {"decode": {"tandem_missing": 1}}
    with pytest.raises(StartTimeout, match="start_timeout_s=1 s"):
        builder.app(_args(tiny_model, start_timeout_s=1, start_attempts=3, worker_resources=missing))
    assert len(_groups_since(before)) == 3, "three starts, one group each"
    wait_for(lambda: set(_groups_since(before).values()) == {"REMOVED"}, 30,
             lambda: f"every start's placement group removed: {_groups_since(before)}")
    (name,) = _controllers()
    with pytest.raises(StartTimeout, match="start_timeout_s=2 s"):
        builder.app(_args(tiny_model, start_timeout_s=2, start_attempts=1, worker_resources=missing))
    assert _controllers() == [name], "a changed timeout keeps the controller"


def test_changed_settings_get_a_new_controller_and_stop_the_old(builder, tiny_model):
    before = set(placement_group_table())
    builder.app(_args(tiny_model))
    (old,) = _controllers()
    (old_group,) = _groups_since(before)

    builder.app(_args(tiny_model, decode_workers=2))
    (new,) = _controllers()
    assert new != old, "a changed topology must not reuse the controller of the old one"
    assert ray.get(ray.get_actor(new).model_info.remote())["decode_workers"] == 2
    wait_for(lambda: _groups_since(before)[old_group] == "REMOVED", 30, "the old controller's pool removed")

    groups = _groups_since(before)
    builder.app(_args(tiny_model, decode_workers=2, start_timeout_s=900))  # the same settings
    assert _controllers() == [new] and _groups_since(before) == groups, "the same settings reuse the controller"


@pytest.mark.parametrize(
    "change",
    [
        {"model": "tandem-tiny-llama"},
        {"decode_workers": 2},
        {"engine": {"max_num_seqs": 8}},
        {"transfer": {"backend": "collective"}},
        {"decode_resources": {"num_cpus": 1, "custom": {"tandem_decode": 1}}},
    ],
)
def test_the_controller_name_changes_with_every_setting_the_pools_run_with(change):
    base = ClusterConfig.from_dict({"model": "smollm2-135m-instruct", "prefill_workers": 1})
    changed = ClusterConfig.from_dict({"model": "smollm2-135m-instruct", "prefill_workers": 1, **change})
    assert controller_name(base) != controller_name(changed)
    assert controller_name(base) != controller_name(base, metrics_port=8081)
    assert controller_name(base) == controller_name(base.replace(start_timeout_s=5))  # a bound, not a setting
    assert controller_name(base).startswith("tandem-controller-")
