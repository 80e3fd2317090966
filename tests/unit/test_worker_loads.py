"""The router's per-worker placement state (``router.worker_loads``), from plain records and
a clock passed in: no asyncio, no Ray."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.core.block_hash import BlockHasher
from engine.wire.messages import DecodeLoad, PrefillLoad, WorkerRef
from router.dispatch_config import DispatchConfig
from router.worker_loads import Affinity, WorkerLoads

HASHES = BlockHasher(seed="worker-loads").hash_blocks(list(range(40)), 16)  # two full blocks of 16


def _decode(worker_id: str, free_blocks: int = 100, running: int = 0) -> DecodeLoad:
    return DecodeLoad(worker_id, free_blocks=free_blocks, total_blocks=100, running=running, waiting=0,
                      waiting_for_kv=0)


def _prefill(worker_id: str, queued: int = 0) -> PrefillLoad:
    return PrefillLoad(worker_id, queued, 0, 0, 0, 0)


def _reporting(refs: list[WorkerRef], now: float = 0.0, **config) -> WorkerLoads:
    """A ``WorkerLoads`` that heard from each of ``refs`` (ids starting "decode" or "prefill") at ``now``."""
    loads = WorkerLoads(DispatchConfig(**config))
    for w in refs:
        report = _decode(w.worker_id) if w.worker_id.startswith("decode") else _prefill(w.worker_id)
        loads.note(w.worker_id, report, now)
    return loads


def test_a_worker_is_stale_without_a_report_and_once_its_report_is_older_than_load_poll_s():
    a, b = WorkerRef("decode-0", None), WorkerRef("decode-1", None)
    loads = WorkerLoads(DispatchConfig(load_poll_s=0.5))
    assert loads.stale([a, b], now=0.0) == [a, b], "no report yet: both must be asked"
    loads.note("decode-0", _decode("decode-0"), now=1.0)
    assert loads.stale([a, b], now=1.5) == [b], "a report exactly load_poll_s old is still fresh"
    assert loads.stale([a, b], now=1.625) == [a, b], "past load_poll_s it must be asked again"
    loads.forget("decode-0")
    assert loads.stale([a, b], now=1.0) == [a, b], "a forgotten report counts as none"


def test_nothing_is_placed_on_a_worker_without_a_report_a_draining_one_or_an_excluded_one():
    silent, draining, excluded, live = (WorkerRef(f"decode-{i}", None, draining=i == 1) for i in range(4))
    loads = _reporting([draining, excluded, live])
    chosen = {loads.choose_decode([silent, draining, excluded, live], 1, exclude={excluded.key})[0].worker_id
              for _ in range(8)}
    assert chosen == {"decode-3"}, f"only the reporting, listed, non-excluded worker may be chosen, got {chosen}"
    loads.forget("decode-3")
    assert loads.choose_decode([silent, draining, excluded, live], 1, exclude={excluded.key}) is None


def test_blocks_placed_on_a_decode_worker_count_against_it_until_it_answers():
    worker = WorkerRef("decode-0", None)
    loads = WorkerLoads(DispatchConfig())
    loads.note("decode-0", _decode("decode-0", free_blocks=10), now=0.0)
    assert loads.choose_decode([worker], 6) is not None and loads.pending_blocks("decode-0") == 6
    assert loads.choose_decode([worker], 6) is None, "6 of its 10 free blocks are pending: 6 more do not fit"
    loads.decode_answered("decode-0", 6)
    assert loads.pending_blocks("decode-0") == 0
    assert loads.choose_decode([worker], 6) is not None, "answered, the report alone counts"


def test_the_decode_prefix_index_is_by_incarnation_and_forgotten_when_the_worker_dies():
    first = WorkerRef("decode-0", None, incarnation="a")
    loads = _reporting([first])
    assert loads.choose_decode([first], 3, hashes=HASHES) == (first, 0)
    assert loads.choose_decode([first], 3, hashes=HASHES) == (first, 2), "its prefix cache holds both blocks now"
    replacement = WorkerRef("decode-0", None, incarnation="b")
    assert loads.choose_decode([replacement], 3, hashes=HASHES) == (replacement, 0), \
        "a replacement under the same id starts with an empty cache"
    loads.decode_gone(first)
    assert loads.choose_decode([first], 3, hashes=HASHES) is None, "a dead worker's report is gone"
    loads.note("decode-0", _decode("decode-0"), now=1.0)
    assert loads.choose_decode([first], 3, hashes=HASHES) == (first, 0), "and so is what its cache held"


def test_requests_sharing_an_affinity_follow_the_first_decode_worker_while_it_has_room():
    workers = [WorkerRef(f"decode-{i}", None) for i in range(3)]
    loads = _reporting(workers)
    affinity = Affinity()
    chosen = [loads.choose_decode(workers, 1, affinity=affinity)[0].key for _ in range(4)]
    assert chosen == [chosen[0]] * 4 and affinity.decode == chosen[0], chosen
    loads.note(chosen[0], _decode(chosen[0], free_blocks=0), now=1.0)
    elsewhere = loads.choose_decode(workers, 1, affinity=affinity)[0].key
    assert elsewhere != chosen[0] and affinity.decode == chosen[0], "full: placed elsewhere, the affinity kept"


def test_prompt_tokens_placed_on_a_prefill_worker_count_in_its_queue_until_the_prefill_ends():
    workers = [WorkerRef(f"prefill-{i}", None) for i in range(2)]
    loads = _reporting(workers, local_prefill_backlog_tokens=500)
    first = loads.choose_prefill(workers, 1000)
    second = loads.choose_prefill(workers, 1000)
    assert first != second, "the first one's 1000 pending tokens make the other the less queued"
    loads.note("decode-0", _decode("decode-0"), now=0.0)
    assert loads.prefill_here(workers, 100, 0, "decode-0") == "prefill_busy", \
        "both workers' reports say 0 queued, but 1000 tokens are pending on each"
    loads.prefill_ended(first.worker_id, 1000)
    assert loads.pending_tokens(first.worker_id) == 0
    assert loads.prefill_here(workers, 100, 0, "decode-0") is None, "one worker is free again"


def test_a_dead_prefill_worker_loses_its_report_and_its_prefix_index():
    workers = [WorkerRef(f"prefill-{i}", None) for i in range(2)]
    loads = _reporting(workers)
    cached = loads.choose_prefill(workers, 40, HASHES)
    assert loads.choose_prefill(workers, 40, HASHES) == cached, "the worker caching the prefix is preferred"
    loads.prefill_gone(cached.worker_id)
    assert loads.prefill_prefixes.matched_blocks(cached.worker_id, HASHES) == 0
    assert loads.choose_prefill([cached], 40, HASHES) is None, "nothing goes to it until it reports again"


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("decode"), st.integers(1, 8)),
        st.tuples(st.just("prefill"), st.integers(1, 500)),
        st.tuples(st.just("answer"), st.integers(0, 100)),
        st.tuples(st.just("end"), st.integers(0, 100)),
        st.tuples(st.just("report"), st.integers(0, 2), st.integers(0, 30), st.integers(0, 4)),
    ),
    max_size=40,
)


@given(_OPS, st.sampled_from(["load", "round_robin"]))
def test_pending_counts_never_go_negative_never_overcommit_and_return_to_zero_once_every_placement_ended(
    ops, placement,
):
    decodes = [WorkerRef(f"decode-{i}", None, draining=i == 3) for i in range(4)]  # decode-3 drains
    prefills = [WorkerRef(f"prefill-{i}", None) for i in range(2)]
    loads = WorkerLoads(DispatchConfig(placement=placement, max_running_per_decode=4))
    for w in decodes:
        loads.note(w.worker_id, _decode(w.worker_id, free_blocks=20), now=0.0)
    for w in prefills:
        loads.note(w.worker_id, _prefill(w.worker_id), now=0.0)
    placed: list[tuple[str, int]] = []  # decode placements not yet answered
    prefilling: list[tuple[str, int]] = []  # prefills not yet ended
    for op in ops:
        if op[0] == "decode" and (chosen := loads.choose_decode(decodes, op[1])) is not None:
            worker = chosen[0]
            assert not worker.draining, "a draining worker was chosen"
            free = loads.reports()[worker.worker_id].free_blocks
            assert loads.pending_blocks(worker.worker_id) <= free, \
                f"{worker.worker_id} has {loads.pending_blocks(worker.worker_id)} blocks pending, {free} free"
            placed.append((worker.worker_id, op[1]))
        elif op[0] == "prefill":
            prefilling.append((loads.choose_prefill(prefills, op[1]).worker_id, op[1]))
        elif op[0] == "answer" and placed:
            loads.decode_answered(*placed.pop(op[1] % len(placed)))
        elif op[0] == "end" and prefilling:
            loads.prefill_ended(*prefilling.pop(op[1] % len(prefilling)))
        elif op[0] == "report":
            loads.note(f"decode-{op[1]}", _decode(f"decode-{op[1]}", free_blocks=op[2], running=op[3]), now=1.0)
        for w in decodes:
            assert loads.pending_blocks(w.worker_id) == sum(n for i, n in placed if i == w.worker_id) >= 0
        for w in prefills:
            assert loads.pending_tokens(w.worker_id) == sum(n for i, n in prefilling if i == w.worker_id) >= 0
    for worker_id, blocks in placed:
        loads.decode_answered(worker_id, blocks)
    for worker_id, tokens in prefilling:
        loads.prefill_ended(worker_id, tokens)
    assert all(loads.pending_blocks(w.worker_id) == 0 for w in decodes), "blocks left pending after every answer"
    assert all(loads.pending_tokens(w.worker_id) == 0 for w in prefills), "tokens left pending after every prefill"
