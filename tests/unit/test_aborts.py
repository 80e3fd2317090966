"""A gRPC Abort of a request this replica does not run asks every worker (another replica
may run it): the pass-ons are bounded per replica, so that made-up ids cannot multiply a
client's calls by the number of workers; Aborts of requests it runs are never bounded."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protos.tandem.v1 import generate_pb2 as pb
from router.aborts import AbortBudget, AbortConfig
from router.core import RouterConfig, RouterCore
from router.dispatch import WorkerRef
from router.grpc_api import GrpcStatusError
from router.server import Router


def test_the_budget_lets_a_burst_through_then_one_per_interval_with_the_wait_to_the_next():
    budget = AbortBudget(AbortConfig(per_s=2.0, burst=3))
    assert [budget.try_take(now=10.0) for _ in range(3)] == [None, None, None]
    assert budget.try_take(now=10.0) == 1, "empty: the next comes in 0.5 s, said in whole seconds"
    assert budget.try_take(now=10.5) is None and budget.try_take(now=10.5) == 1
    assert [budget.try_take(now=100.0) for _ in range(4)] == [None, None, None, 1], "refills to the burst, no more"


def test_the_budget_is_checked_on_creation_naming_the_field():
    with pytest.raises(ValueError, match="aborts.per_s must be > 0, got 0"):
        AbortConfig(per_s=0)
    with pytest.raises(ValueError, match="aborts.burst must be >= 1, got 0"):
        AbortConfig(burst=0)


def _router(model_dir, config: RouterConfig, prefill: list, decode: list):
    """An instance of the Serve deployment's class on a core with these worker handles, without Ray."""
    from engine.tokenizer import Tokenizer

    info = {"model_dir": str(model_dir), "name": "tiny", "max_model_len": 64, "block_size": 16, "max_kv_blocks": 8,
            "vocab_size": Tokenizer.from_pretrained(model_dir).vocab_size}
    workers = tuple([WorkerRef(f"{role}-{i}", w) for i, w in enumerate(ws)] for role, ws in (("p", prefill), ("d", decode)))
    router = object.__new__(Router.func_or_class)
    router.core = RouterCore(None, config, info, workers, {})
    return router


class _Worker:
    """A worker actor handle that counts the aborts it is sent."""

    def __init__(self) -> None:
        self.calls = 0
        self.abort_request = self.abort = self

    def remote(self, request_id: str) -> None:
        self.calls += 1


class _Context:
    """The little of a gRPC call's context the router's Abort uses."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def invocation_metadata(self):
        return ()

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


# Serve's ingress wrapper has an async __del__: an instance made without Serve warns when collected.
@pytest.mark.filterwarnings("ignore:coroutine 'ingress.<locals>:RuntimeWarning")
def test_aborts_of_unknown_ids_reach_every_worker_only_within_the_budget(default_model, monkeypatch):
    monkeypatch.setattr("router.core.time.monotonic", lambda: 1000.0)  # no refill while the test runs
    workers = [_Worker() for _ in range(6)]
    router = _router(default_model, RouterConfig(aborts=AbortConfig(per_s=1.0, burst=5)), workers[:3], workers[3:])

    async def abort(rid: str) -> tuple[bool | None, _Context]:
        context = _Context()
        try:
            return (await router.Abort(pb.AbortRequest(request_id=rid), context)).found, context
        except GrpcStatusError:
            return None, context

    async def calls():
        return [await abort(f"made-up-{i}") for i in range(50)]

    answers = asyncio.run(calls())
    assert [found for found, _ in answers[:5]] == [False] * 5, "within the budget: passed on, not found here"
    refused = answers[5:]
    assert all(found is None and c.code == grpc.StatusCode.RESOURCE_EXHAUSTED for found, c in refused), refused[0]
    assert "aborts.per_s=1" in refused[0][1].details and "retry after 1s" in refused[0][1].details, refused[0][1].details
    assert [w.calls for w in workers] == [5] * 6, "each worker asked once per Abort passed on, 5 in all"
    assert asyncio.run(abort(""))[0] is False and sum(w.calls for w in workers) == 30, "no request has an empty id"
    dispatcher, aborted = router.core.dispatcher, []
    monkeypatch.setattr(dispatcher, "in_flight", lambda rid: rid == "mine")
    monkeypatch.setattr(dispatcher, "abort", lambda rid: aborted.append(rid) or True)
    assert asyncio.run(abort("mine"))[0] is True and aborted == ["mine"], "a request run here is aborted, budget or not"
