"""The hand-off state machine (``kv_transfer.handoff``): pure, driven with a hand-held clock."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kv_transfer.handoff import HandoffError, HandoffState, Receiver, Sender


def _reserved(n: int = 4, landed: int = 0, deadline: float = 10.0) -> Receiver:
    receiver = Receiver()
    receiver.reserve("a", list(range(100, 100 + n)), landed, deadline, pins=["pins-of-a"])
    return receiver


def test_parts_land_in_order_and_the_attempt_completes_only_when_its_whole_reservation_has():
    receiver = _reserved(4)
    assert receiver.begin_read("a", 0, 2, now=1.0, last=False) == [100, 101]
    assert receiver.end_read("a") is None
    with pytest.raises(HandoffError, match="cannot complete"):
        receiver.complete("a")
    assert receiver.begin_read("a", 2, 2, now=2.0, last=True) == [102, 103]
    assert receiver.end_read("a") is None
    ended = receiver.complete("a")
    assert ended.state == HandoffState.COMPLETE and ended.pins == ["pins-of-a"] and not ended.failed
    assert "a" not in receiver


def test_a_last_part_short_of_the_reservation_is_refused_before_anything_is_read():
    receiver = _reserved(4)
    with pytest.raises(HandoffError) as e:
        receiver.begin_read("a", 0, 3, now=1.0, last=True)
    assert e.value.reason == "incomplete"
    assert receiver.get("a").reading is None, "nothing may be recorded as being read"


@pytest.mark.parametrize("first, count, reason", [(1, 1, "order"), (0, 5, "layout")])
def test_a_part_out_of_order_or_past_the_reservation_is_refused(first, count, reason):
    receiver = _reserved(4)
    with pytest.raises(HandoffError) as e:
        receiver.begin_read("a", first, count, now=1.0, last=False)
    assert e.value.reason == reason


def test_a_duplicate_attempt_is_refused_and_the_first_one_is_left_alone():
    receiver = _reserved(4)
    with pytest.raises(ValueError, match="already"):
        receiver.reserve("a", [7, 8], 0, 10.0)
    assert receiver.get("a").block_ids == (100, 101, 102, 103)


def test_no_deadline_failure_or_abort_ends_an_attempt_while_its_read_runs():
    receiver = _reserved(4, deadline=5.0)
    receiver.begin_read("a", 0, 4, now=1.0, last=True)
    assert receiver.expire(now=9.0) == [] and receiver.fail("a", "sender") is None
    assert receiver.abort("a") is None
    ended = receiver.end_read("a")
    assert ended is not None and ended.pins == ["pins-of-a"] and not ended.failed, (
        "an abort during the read releases the blocks when it ends, without the failure policy"
    )


def test_a_stuck_read_keeps_its_blocks_until_it_settles_or_its_sender_is_gone():
    receiver = _reserved(2)
    receiver.begin_read("a", 0, 2, now=1.0, last=True, sender="prefill-0")
    ended = receiver.end_read("a", "stuck", stuck=True)
    assert ended.state == HandoffState.QUARANTINED and ended.failed and ended.pins is None
    assert receiver.expire(now=1e9) == [] and receiver.abort("a") is None and receiver.num_quarantined == 1
    assert receiver.sender_gone("prefill-1") == []
    assert [e.pins for e in receiver.sender_gone("prefill-0")] == [["pins-of-a"]]
    assert len(receiver) == 0


def test_a_deadline_expires_an_attempt_with_no_read_running():
    receiver = _reserved(2, deadline=5.0)
    assert receiver.expire(now=5.0) == []
    [ended] = receiver.expire(now=5.1)
    assert ended.state == HandoffState.EXPIRED and ended.failed and ended.pins == ["pins-of-a"]
    with pytest.raises(HandoffError) as e:
        receiver.begin_read("a", 0, 2, now=5.2, last=True)
    assert e.value.reason == "expired"


def test_the_sender_refuses_a_second_prefill_of_an_attempt_it_still_holds():
    sender = Sender()
    sender.begin("a", offered=1)
    with pytest.raises(ValueError, match="already"):
        sender.begin("a")
    assert sender.end("a", HandoffState.COMPLETE).state == HandoffState.COMPLETE
    assert sender.end("a", HandoffState.FAILED) is None, "an attempt ends once"
    sender.begin("a")  # its id is free again


class ReceiverMachine(RuleBasedStateMachine):
    """Random interleavings of reads, completions, deadlines, failures, aborts and peer
    deaths: every reservation's pins come back exactly once, never while a read may
    still write, and only a whole reservation completes."""

    def __init__(self) -> None:
        super().__init__()
        self.receiver = Receiver()
        self.now = 0.0
        self.count = 0
        self.released: list[str] = []  # pins handed back, by attempt
        self.reading: set[str] = set()  # reads begun and not yet ended, as the readers see it

    def _take(self, ended) -> None:
        for e in ended if isinstance(ended, list) else [ended]:
            if e is None:
                continue
            if e.pins is not None:
                assert e.pins == f"pins-{e.attempt_id}"
                self.released.append(e.attempt_id)

    def _live(self) -> list[str]:
        return sorted(self.receiver.records)

    @rule(size=st.integers(0, 5), landed=st.integers(0, 5), timeout=st.floats(0.5, 5))
    def reserve(self, size, landed, timeout):
        aid = f"a{self.count}"
        self.count += 1
        landed = min(landed, size)
        self.receiver.reserve(aid, list(range(size)), landed, self.now + timeout, pins=f"pins-{aid}")

    @precondition(lambda self: self.receiver.records)
    @rule(data=st.data(), count=st.integers(0, 5), last=st.booleans(), skew=st.integers(-1, 1))
    def begin_read(self, data, count, last, skew):
        aid = data.draw(st.sampled_from(self._live()))
        r = self.receiver.get(aid)
        try:
            targets = self.receiver.begin_read(aid, r.landed + skew, count, self.now, last=last, sender="s")
        except HandoffError:
            return
        assert r.state.live and r.reading is not None and len(targets) == count
        self.reading.add(aid)

    @precondition(lambda self: any(r.reading for r in self.receiver.records.values()))
    @rule(data=st.data(), outcome=st.sampled_from(["ok", "failed", "stuck"]))
    def end_read(self, data, outcome):
        aid = data.draw(st.sampled_from([a for a in self._live() if self.receiver.get(a).reading]))
        self.reading.discard(aid)
        self._take(self.receiver.end_read(aid, "" if outcome == "ok" else outcome, stuck=outcome == "stuck"))

    @precondition(lambda self: self.receiver.records)
    @rule(data=st.data(), action=st.sampled_from(["complete", "fail", "abort", "settle"]))
    def act(self, data, action):
        aid = data.draw(st.sampled_from(self._live()))
        if action == "complete":
            r = self.receiver.get(aid)
            whole = r.state.live and r.reading is None and r.landed == r.num_blocks
            try:
                self._take(self.receiver.complete(aid))
            except HandoffError:
                assert not whole, "a whole reservation with no read running must complete"
            else:
                assert whole, f"completed with {r.landed} of {r.num_blocks} blocks landed"
        elif action == "fail":
            self._take(self.receiver.fail(aid, "sender"))
        elif action == "abort":
            self._take(self.receiver.abort(aid))
        else:
            self._take(self.receiver.settled(aid))

    @rule(dt=st.floats(0, 3))
    def tick(self, dt):
        self.now += dt
        self._take(self.receiver.expire(self.now))

    @rule()
    def sender_dies(self):
        self._take(self.receiver.sender_gone("s"))

    @invariant()
    def pins_come_back_once_and_only_from_records_that_left(self):
        assert len(self.released) == len(set(self.released)), "pins released twice"
        assert not set(self.released) & set(self.receiver.records), "pins released while the record is kept"
        assert not set(self.released) & self.reading, "pins released while a read may still write into them"

    @invariant()
    def a_record_kept_is_live_or_quarantined_and_never_past_its_reservation(self):
        for r in self.receiver.records.values():
            assert r.state.live or r.state == HandoffState.QUARANTINED
            assert 0 <= r.landed <= r.num_blocks
            assert r.reading is None or r.state.live


TestReceiverMachine = ReceiverMachine.TestCase
TestReceiverMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_the_sender_records_may_be_begun_while_the_step_thread_walks_them():
    """The event loop begins an attempt while the step thread expires the records: the
    walk must not see the dict change under it (that killed a prefill worker's step
    thread under a drain-and-add load)."""
    import threading

    sender = Sender()
    started = []

    class Walked(type(sender.begin("a"))):
        @property
        def state(self):  # read by expire's walk: the other thread begins an attempt now
            if not started:
                started.append(threading.Thread(target=sender.begin, args=("b",)))
                started[0].start()
                started[0].join(0.2)  # it waits for the walk (with the lock), or changes the dict (without)
            return HandoffState.RESERVED

        @state.setter
        def state(self, value):
            pass

    sender.records["w"] = Walked("w", deadline=0.0)
    due = sender.expire(now=1.0)  # raised "dictionary changed size during iteration" without the lock
    assert [o.attempt_id for o in due] == ["w"]
    started[0].join(5)
    assert "b" in sender
