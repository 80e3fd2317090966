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


def _parameters(sig: inspect.Signature) -> list[tuple[str, object]]:
    # (Ray adds a ``_ray_trace_ctx`` keyword to an actor class's methods once it is made remote.)
    return [(p.name, p.default) for p in sig.parameters.values() if p.name != "self" and not p.name.startswith("_ray")]


def _check(impl: type | object, protocol: type, only: set[str] | None = None) -> None:
    """The real classes match the API parameter for parameter; a stand-in (whose calls
    come positionally, as the dispatcher makes them) takes the same positional arguments:
    every one the API has, and none it lacks beyond those."""
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
        args = _parameters(want)
        required = sum(default is inspect.Parameter.empty for _, default in args)
        for n in (required, len(args)):  # the fewest and the most the callers pass
            try:
                have.bind(*[None] * n)
            except TypeError as e:
                raise AssertionError(f"{impl}.{name}{have} cannot take {n} arguments as "
                                     f"{protocol.__name__}.{name}{want} does: {e}") from None


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
        for name in _api_methods(protocol):
            assert callable(getattr(PoolWorker, name, None)), f"PoolWorker does not forward {name}"


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
