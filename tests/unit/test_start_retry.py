"""A start that times out is retried with backoff (KubeRay submits an application once per
config: a build that gave up would leave the service failed), and a running controller
takes a changed ``start_timeout_s``."""

from __future__ import annotations

import pytest

from cluster import controller as controller_module
from cluster.config import ClusterConfig
from cluster.controller import ClusterController
from cluster.pools import StartTimeout
from cluster.service import start_retrying


def test_a_timed_out_start_is_tried_again_with_a_growing_backoff_until_one_succeeds():
    outcomes = [StartTimeout("no GPU yet")] * 7 + [{"name": "m"}]
    slept: list[float] = []

    def start():
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert start_retrying(start, sleep=slept.append) == {"name": "m"}
    assert slept == [10, 20, 40, 80, 160, 300, 300], "doubling from 10 s, at most 5 min"


def test_attempts_bound_the_retries_and_other_errors_are_not_retried():
    calls, slept = [], []

    def timing_out():
        calls.append(1)
        raise StartTimeout("no room")

    with pytest.raises(StartTimeout):
        start_retrying(timing_out, attempts=3, sleep=slept.append)
    assert len(calls) == 3 and slept == [10, 20]

    def broken():
        calls.append(1)
        raise ValueError("unknown engine setting")

    calls.clear()
    with pytest.raises(ValueError):
        start_retrying(broken, sleep=slept.append)
    assert len(calls) == 1, "a start that fails for another reason fails the application at once"


def test_a_running_controller_starts_its_next_attempt_under_the_timeout_it_is_given(monkeypatch):
    seen: list[float] = []

    class NoRoom:
        def __init__(self, config: ClusterConfig) -> None:
            self.config = config

        def start(self):
            seen.append(self.config.start_timeout_s)
            raise StartTimeout(f"not placed within start_timeout_s={self.config.start_timeout_s:g} s")

    monkeypatch.setattr(controller_module, "TandemCluster", NoRoom)
    controller = ClusterController(ClusterConfig(start_timeout_s=60))
    for timeout in (None, 900, None):
        with pytest.raises(StartTimeout):
            controller.start(timeout)
    assert seen == [60, 900, 900], "a changed timeout is taken, and kept for later starts"
