"""The worker actors against their API (``engine/wire/worker_api.py``): the real classes, the
pool worker that forwards to either, and the stand-ins the dispatcher's tests and the
token-path benchmark use. A method the router calls that one of them lacks, or whose
parameters differ by name, order or default, fails here."""

from __future__ import annotations

import inspect

import pytest

from engine.wire.worker_api import DecodeWorkerAPI, PrefillWorkerAPI, WorkerAPI


def _api_methods(protocol: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in inspect.getmembers(protocol, inspect.isfunction)
            if not name.startswith("_")}


def _parameters(sig: inspect.Signature) -> list[tuple[str, object, object]]:
    # (Ray adds a ``_ray_trace_ctx`` keyword to an actor class's methods once it is made remote.)
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()
            if p.name != "self" and not p.name.startswith("_ray")]


def _check(impl: type | object, protocol: type, only: set[str] | None = None) -> None:
    """The real classes match the API parameter for parameter (name, kind, default); a
    stand-in takes the calls the clients make: the leading arguments by position, the
    rest by keyword, the fewest and the most the API allows."""
    for name, want in _api_methods(protocol).items():
        if only is not None and name not in only:
            continue
        got = getattr(impl, name, None)
        assert got is not None, f"{impl} lacks {name} of {protocol.__name__}"
        got = getattr(got, "fn", None) or getattr(got, "_fn", None) or got  # a stand-in's call wraps its function
        have = inspect.signature(got)
        if isinstance(impl, type):
            assert _parameters(have) == _parameters(want), (
                f"{impl.__name__}.{name}{have} does not match {protocol.__name__}.{name}{want}")
            continue
        params = [p for p in want.parameters.values() if p.name != "self"]
        positional = [p for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        keywords = [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
        fewest = ([None] * sum(p.default is inspect.Parameter.empty for p in positional),
                  {p.name: None for p in keywords if p.default is inspect.Parameter.empty})
        most = ([None] * len(positional), {p.name: None for p in keywords})
        for args, kwargs in (fewest, most):
            try:
                have.bind(*args, **kwargs)
            except TypeError as e:
                raise AssertionError(f"{impl}.{name}{have} cannot take {len(args)} arguments and {sorted(kwargs)} "
                                     f"as {protocol.__name__}.{name}{want} does: {e}") from None


def test_the_real_workers_implement_their_roles_api():
    import ray

    from decode_worker.worker import ColocatedWorker, DecodeWorker
    from prefill_worker.worker import PrefillWorker

    for cls in (PrefillWorker, DecodeWorker, ColocatedWorker):
        ray.remote(cls)  # as the cluster makes them (Ray then adds its tracing keyword)

    for cls, protocol in ((PrefillWorker, PrefillWorkerAPI), (DecodeWorker, DecodeWorkerAPI),
                          (ColocatedWorker, DecodeWorkerAPI)):
        _check(cls, protocol)
        for name in _api_methods(protocol):
            want_async = inspect.iscoroutinefunction(getattr(protocol, name))
            got = getattr(cls, name)
            assert inspect.iscoroutinefunction(got) == want_async or inspect.isasyncgenfunction(got), name


def test_a_pool_worker_answers_both_roles_calls():
    from cluster.pool_worker import PoolWorker

    for protocol in (PrefillWorkerAPI, DecodeWorkerAPI):
        for name, want in _api_methods(protocol).items():
            assert callable(getattr(PoolWorker, name, None)), f"PoolWorker does not forward {name}"
            have = inspect.signature(getattr(PoolWorker, name))
            epoch = [p for p in _parameters(have) if p[0] == "epoch"]
            assert _parameters(have) == [*_parameters(want), *epoch], f"PoolWorker.{name}{have} != {want} (+ epoch)"


@pytest.mark.parametrize("fake", ["decode", "prefill", "colocated", "token_path"])
def test_the_stand_ins_take_the_calls_they_stand_in_for_as_the_workers_do(fake):
    from tests.unit import test_dispatch as td

    if fake == "decode":
        _check(td._FakeDecode(), DecodeWorkerAPI, {"load", "reserve", "abort"})
    elif fake == "prefill":
        _check(td._FakePrefill(), PrefillWorkerAPI, {"load", "prefill", "abort"})
    elif fake == "colocated":
        _check(td._FakeColocated("decode-0"), DecodeWorkerAPI, {"load", "submit", "abort"})
    else:
        from bench.token_path import StepWorker

        _check(StepWorker(4), DecodeWorkerAPI, {"load", "submit"})


def test_every_worker_api_is_a_worker_api():
    assert issubclass(PrefillWorkerAPI, WorkerAPI) and issubclass(DecodeWorkerAPI, WorkerAPI)


# The calls the cluster makes itself (``ray.get`` on each worker), which no client carries.
CLUSTER_CALLS = {"ready", "drain", "stats"}


@pytest.mark.parametrize("client,protocol", [("PrefillClient", "PrefillWorkerAPI"), ("DecodeClient", "DecodeWorkerAPI")])
def test_the_clients_make_every_call_of_their_roles_api_with_its_parameters(client, protocol):
    from engine.wire import clients, worker_api

    cls, api = getattr(clients, client), getattr(worker_api, protocol)
    calls = {name: inspect.signature(fn) for name, fn in inspect.getmembers(cls, inspect.isfunction)
             if not name.startswith("_")}
    assert set(calls) == set(_api_methods(api)) - CLUSTER_CALLS, f"{client} and {protocol} list other calls"
    for name, have in calls.items():
        want = inspect.signature(getattr(api, name))
        assert _parameters(have) == _parameters(want), f"{client}.{name}{have} does not match {protocol}.{name}{want}"


class _Handle:
    """An actor handle that records each ``<call>.remote(...)`` as (call, args, kwargs)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str):
        handle = self

        class _Call:
            def remote(self, *args, **kwargs):
                handle.calls.append((name, args, kwargs))

            def options(self, **_):
                return self

        return _Call()


def test_a_client_sends_the_epoch_with_placements_and_load_polls_only():
    """A worker that switched roles refuses what was placed by an older view of it; an abort
    or a notice about a transfer concerns whatever it holds, whatever its role now."""
    from engine.wire.clients import DecodeClient, PrefillClient

    handle = _Handle()
    decode, prefill = DecodeClient(handle, epoch=3), PrefillClient(handle, epoch=3)
    decode.load()
    decode.reserve("a", [1], None, subscriber="s")
    decode.submit("a", [1], None, subscriber="s", priority=2)
    prefill.prefill("a", [1], None, decode_worker=handle, reservation=None, resume_output=[7])
    decode.abort("a")
    decode.abort_request("a")
    decode.transfer_failed("a")
    decode.sender_gone("prefill-0")
    decode.receive_kv("meta", "payload", first_token=5)
    decode.receive_kv_part("meta", "payload", first_block=2)
    decode.token_channel()
    decode.subscribe("s")
    fenced = {name for name, _, kwargs in handle.calls if kwargs.get("epoch") == 3}
    assert fenced == {"load", "reserve", "submit", "prefill"}, fenced
    by_name = {name: (args, kwargs) for name, args, kwargs in handle.calls}
    assert by_name["submit"] == (("a", [1], None), {"subscriber": "s", "resume_output": (), "priority": 2, "epoch": 3})
    assert by_name["receive_kv_part"] == (("meta", "payload"), {"first_block": 2})

    handle.calls.clear()
    DecodeClient(handle).reserve("a", [1], None, subscriber="s")
    assert "epoch" not in handle.calls[0][2], "a worker that never switches roles takes no epoch"
