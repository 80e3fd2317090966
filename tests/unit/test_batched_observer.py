"""``BatchedObserver`` writes exactly what plain ``Histogram.observe`` calls would, later."""

import random

from prometheus_client import CollectorRegistry, Histogram

from engine.wire.metrics import TOKEN_LATENCY_BUCKETS, BatchedObserver


def _samples(histogram: Histogram) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in histogram.collect() for s in m.samples
            if not s.name.endswith("_created")}


def _pair():
    registry = CollectorRegistry()
    plain = Histogram("plain", "", buckets=TOKEN_LATENCY_BUCKETS, registry=registry)
    batched = Histogram("batched", "", buckets=TOKEN_LATENCY_BUCKETS, registry=registry)
    return plain, batched


def _renamed(samples: dict, old: str, new: str) -> dict:
    return {(name.replace(old, new, 1), labels): value for (name, labels), value in samples.items()}


def test_after_a_flush_the_series_equals_plain_observes_bucket_for_bucket():
    plain, batched = _pair()
    observer = BatchedObserver(batched, flush_every=7)
    rng = random.Random(0)
    # Amounts on bucket bounds (a bound is inclusive), between them, and past the last.
    amounts = [rng.choice(TOKEN_LATENCY_BUCKETS) for _ in range(40)] + [rng.uniform(0, 100) for _ in range(60)]
    for amount in amounts:
        times = rng.randint(1, 3)
        for _ in range(times):
            plain.observe(amount)
        observer.observe(amount, times)
    observer.flush()
    want = _samples(plain)
    got = _renamed(_samples(batched), "batched", "plain")
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert abs(got[key] - value) < 1e-9, key


def test_observations_are_written_every_flush_every_and_on_flush():
    _, batched = _pair()
    observer = BatchedObserver(batched, flush_every=4)
    count = lambda: _samples(batched)[("batched_count", ())]  # noqa: E731
    observer.observe(0.01, 3)
    assert count() == 0, "held in memory below flush_every"
    observer.observe(0.01)
    assert count() == 4
    observer.observe(0.02)
    observer.flush()
    assert count() == 5
    observer.flush()  # nothing pending: nothing written twice
    assert count() == 5
