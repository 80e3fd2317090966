"""The hand-off state machine (``kv_transfer.handoff``): pure, driven with a hand-held clock."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kv_transfer.handoff import HandoffError, Offer, OfferState, ReceiptState, Receiver, Sender


def _reserved(n: int = 4, landed: int = 0, deadline: float = 10.0) -> Receiver:
    receiver = Receiver()
    receiver.reserve("a", list(range(100, 100 + n)), landed, deadline, pins=["pins-of-a"])
    return receiver


def test_parts_land_in_order_and_the_attempt_completes_only_when_its_whole_reservation_has():
    receiver = _reserved(4)
    assert receiver.next_read("a", 0, 2, now=1.0, last=False).block_ids == [100, 101]
    assert receiver.end_read("a") is None
    with pytest.raises(HandoffError, match="cannot complete"):
        receiver.complete("a")
    assert receiver.next_read("a", 2, 2, now=2.0, last=True).block_ids == [102, 103]
    assert receiver.end_read("a") is None
    ended = receiver.complete("a")
    assert ended.state == ReceiptState.COMPLETE and ended.pins == ["pins-of-a"] and not ended.failed
    assert "a" not in receiver


def test_a_last_part_short_of_the_reservation_is_refused_before_anything_is_read():
    receiver = _reserved(4)
    with pytest.raises(HandoffError) as e:
        receiver.next_read("a", 0, 3, now=1.0, last=True)
    assert e.value.reason == "incomplete"
    assert receiver.get("a").reading is None, "nothing may be recorded as being read"


@pytest.mark.parametrize("first, count, reason", [(1, 1, "order"), (0, 5, "layout")])
def test_a_part_out_of_order_or_past_the_reservation_is_refused(first, count, reason):
    receiver = _reserved(4)
    with pytest.raises(HandoffError) as e:
        receiver.next_read("a", first, count, now=1.0, last=False)
    assert e.value.reason == reason


def test_a_duplicate_attempt_is_refused_and_the_first_one_is_left_alone():
    receiver = _reserved(4)
    with pytest.raises(ValueError, match="already"):
        receiver.reserve("a", [7, 8], 0, 10.0)
    assert receiver.get("a").block_ids == (100, 101, 102, 103)


def test_no_deadline_failure_or_abort_ends_an_attempt_while_its_read_runs():
    receiver = _reserved(4, deadline=5.0)
    receiver.next_read("a", 0, 4, now=1.0, last=True)
    assert receiver.expire(now=9.0) == [] and receiver.fail("a", "sender") is None
    assert receiver.abort("a") is None
    ended = receiver.end_read("a")
    assert ended is not None and ended.pins == ["pins-of-a"] and not ended.failed, (
        "an abort during the read releases the blocks when it ends, without the failure policy"
    )


def test_a_stuck_read_keeps_its_blocks_until_it_settles_or_its_sender_is_gone():
    receiver = _reserved(2)
    receiver.next_read("a", 0, 2, now=1.0, last=True, sender="prefill-0")
    ended = receiver.end_read("a", "stuck", stuck=True)
    assert ended.state == ReceiptState.QUARANTINED and ended.failed and ended.pins is None
    assert receiver.expire(now=1e9) == [] and receiver.abort("a") is None and receiver.num_quarantined == 1
    assert receiver.sender_gone("prefill-1") == []
    assert [e.pins for e in receiver.sender_gone("prefill-0")] == [["pins-of-a"]]
    assert len(receiver) == 0


def test_a_deadline_expires_an_attempt_with_no_read_running():
    receiver = _reserved(2, deadline=5.0)
    assert receiver.expire(now=5.0) == []
    [ended] = receiver.expire(now=5.1)
    assert ended.state == ReceiptState.EXPIRED and ended.failed and ended.pins == ["pins-of-a"]
    with pytest.raises(HandoffError) as e:
        receiver.next_read("a", 0, 2, now=5.2, last=True)
    assert e.value.reason == "expired"


def test_a_read_with_no_first_block_starts_where_the_last_ended_and_gets_the_time_left():
    receiver = _reserved(4, landed=1, deadline=10.0)
    read = receiver.next_read("a", None, 3, now=4.0, last=True)
    assert (read.first, read.block_ids, read.time_left) == (1, [101, 102, 103], 6.0)


def test_a_sweep_expires_the_overdue_aborts_the_requests_gone_and_leaves_a_running_read_be():
    receiver = Receiver()
    for aid, deadline in (("late", 1.0), ("gone", 9.0), ("reading", 9.0), ("kept", 9.0)):
        receiver.reserve(aid, [1, 2], 0, deadline, pins=f"pins-{aid}")
    receiver.next_read("reading", 0, 2, now=0.5, last=True)
    ended = receiver.sweep(2.0, is_waiting={"late", "kept"}.__contains__)
    assert [(e.attempt_id, e.state, e.failed) for e in ended] == [
        ("late", ReceiptState.EXPIRED, True), ("gone", ReceiptState.FAILED, False)
    ]
    assert sorted(receiver.states()) == ["kept", "reading"], "a read running keeps its record until it ends"
    assert receiver.end_read("reading").pins == "pins-reading", "the request gone is released as its read ends"


def test_the_sender_offers_each_computed_block_once_in_order_until_unwatched():
    sender: Sender[str] = Sender()
    sender.begin("a", offered=1, watch="parts-a")
    assert sender.watched() == [("a", "parts-a")]
    assert sender.offer_parts("a", [7]) is None, "the receiver has the first block already"
    assert sender.offer_parts("a", [7, 8, 9]) == (1, [8, 9])
    assert sender.offer_parts("a", [7, 8, 9]) is None, "nothing new"
    sender.unwatch("a")
    assert sender.offer_parts("a", [7, 8, 9, 10]) is None and sender.watched() == []


def test_the_sender_refuses_a_second_prefill_of_an_attempt_it_still_holds():
    sender = Sender()
    sender.begin("a", offered=1)
    with pytest.raises(ValueError, match="already"):
        sender.begin("a")
    assert sender.end("a", OfferState.COMPLETE).state == OfferState.COMPLETE
    assert sender.end("a", OfferState.FAILED) is None, "an attempt ends once"
    sender.begin("a")  # its id is free again


class ReceiverMachine(RuleBasedStateMachine):
    """Random interleavings of reads, completions, deadlines, sweeps, failures, aborts
    and peer deaths: every reservation's pins come back exactly once, never while a read
    may still write, only a whole reservation completes, and no record's state goes back."""

    def __init__(self) -> None:
        super().__init__()
        self.receiver = Receiver()
        self.now = 0.0
        self.count = 0
        self.released: list[str] = []  # pins handed back, by attempt
        self.reading: set[str] = set()  # reads begun and not yet ended, as the readers see it
        self.seen: dict[str, ReceiptState] = {}  # each record's latest state seen

    def _take(self, ended) -> None:
        for e in ended if isinstance(ended, list) else [ended]:
            if e is None:
                continue
            if e.pins is not None:
                assert e.pins == f"pins-{e.attempt_id}"
                self.released.append(e.attempt_id)

    def _live(self) -> list[str]:
        return sorted(self.receiver.states())

    @rule(size=st.integers(0, 5), landed=st.integers(0, 5), timeout=st.floats(0.5, 5))
    def reserve(self, size, landed, timeout):
        aid = f"a{self.count}"
        self.count += 1
        landed = min(landed, size)
        self.receiver.reserve(aid, list(range(size)), landed, self.now + timeout, pins=f"pins-{aid}")

    @precondition(lambda self: len(self.receiver))
    @rule(data=st.data(), count=st.integers(0, 5), last=st.booleans(), skew=st.sampled_from([-1, 0, 1, None]))
    def next_read(self, data, count, last, skew):
        aid = data.draw(st.sampled_from(self._live()))
        before = self.receiver.get(aid)
        first = None if skew is None else before.landed + skew  # None: where the last read ended
        try:
            read = self.receiver.next_read(aid, first, count, self.now, last=last, sender="s")
        except HandoffError:
            assert self.receiver.get(aid) == before, "a refused read must leave the record as it was"
            return
        r = self.receiver.get(aid)
        assert r.state.live and r.reading == (before.landed, count) and read.first == before.landed
        assert read.block_ids == list(r.block_ids[read.first : read.first + count])
        assert read.time_left == r.deadline - self.now >= 0, "the read gets the time left to the deadline"
        self.reading.add(aid)

    @precondition(lambda self: self.reading)
    @rule(data=st.data(), outcome=st.sampled_from(["ok", "failed", "stuck"]))
    def end_read(self, data, outcome):
        aid = data.draw(st.sampled_from(sorted(self.reading)))
        self.reading.discard(aid)
        self._take(self.receiver.end_read(aid, "" if outcome == "ok" else outcome, stuck=outcome == "stuck"))

    @precondition(lambda self: len(self.receiver))
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

    @rule(dt=st.floats(0, 3), data=st.data())
    def sweep(self, dt, data):
        self.now += dt
        waiting = data.draw(st.sets(st.sampled_from(self._live()))) if len(self.receiver) else set()
        before = {aid: self.receiver.get(aid) for aid in self._live()}
        ended = self.receiver.sweep(self.now, waiting.__contains__)
        self._take(ended)
        for e in ended:
            r = before[e.attempt_id]
            assert r.reading is None, "a sweep ended an attempt while its read ran"
            if e.state == ReceiptState.EXPIRED:
                assert self.now > r.deadline and e.failed
            else:
                assert e.attempt_id not in waiting and not e.failed, "only a request gone is aborted by a sweep"
        for aid in before:
            if aid in self.reading and aid not in waiting:
                assert self.receiver.get(aid).aborted, "a request gone during a read is aborted when it ends"

    @rule()
    def sender_dies(self):
        self._take(self.receiver.sender_gone("s"))

    @invariant()
    def pins_come_back_once_and_only_from_records_that_left(self):
        assert len(self.released) == len(set(self.released)), "pins released twice"
        assert not set(self.released) & set(self.receiver.states()), "pins released while the record is kept"
        assert not set(self.released) & self.reading, "pins released while a read may still write into them"

    @invariant()
    def a_record_kept_is_live_or_quarantined_and_never_past_its_reservation(self):
        for aid in self._live():
            r = self.receiver.get(aid)
            assert r.state.live or r.state == ReceiptState.QUARANTINED
            assert 0 <= r.landed <= r.num_blocks
            assert r.reading is None or r.state.live

    @invariant()
    def no_state_goes_back(self):
        for aid, state in self.receiver.states().items():
            assert state >= self.seen.get(aid, state), f"{aid}: {self.seen[aid].name} went back to {state.name}"
            self.seen[aid] = state


TestReceiverMachine = ReceiverMachine.TestCase
TestReceiverMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


class SenderMachine(RuleBasedStateMachine):
    """Random interleavings of prefills begun, parts offered, deadlines, reads asked,
    retirement and ends on the sender's side: parts are offered in order, each block
    once and never once unwatched; a read is asked only of a live record before the
    sender retires; an expiry and an end come once; and no record's state goes back."""

    def __init__(self) -> None:
        super().__init__()
        self.sender: Sender[str] = Sender()
        self.now = 0.0
        self.count = 0
        self.offered: dict[str, int] = {}  # the next block each pipelined attempt offers
        self.computed: dict[str, list[int]] = {}  # each attempt's blocks computed so far
        self.unwatched: set[str] = set()
        self.ended: set[str] = set()
        self.seen: dict[str, OfferState] = {}

    def _ids(self) -> list[str]:
        return sorted(self.sender.states())

    @rule(held=st.integers(0, 3), pipelined=st.booleans(), timeout=st.floats(0.5, 5))
    def begin(self, held, pipelined, timeout):
        aid = f"a{self.count}"
        self.count += 1
        self.sender.begin(aid, held, f"parts-{aid}" if pipelined else None, self.now + timeout)
        self.offered[aid], self.computed[aid] = held, list(range(held))
        if not pipelined:
            self.unwatched.add(aid)

    @precondition(lambda self: len(self.sender))
    @rule(data=st.data(), more=st.integers(0, 3))
    def step(self, data, more):
        """A step computes ``more`` blocks of one attempt; the step thread offers the new ones."""
        aid = data.draw(st.sampled_from(self._ids()))
        blocks = self.computed[aid]
        blocks += range(len(blocks), len(blocks) + more)
        assert (aid, f"parts-{aid}") in self.sender.watched() or aid in self.unwatched
        offered = self.sender.offer_parts(aid, blocks)
        if aid in self.unwatched or len(blocks) <= self.offered[aid]:
            assert offered is None, f"{aid}: {offered} offered (unwatched, or nothing new)"
            return
        first, new = offered
        assert first == self.offered[aid] and new == blocks[first:], "parts go in order, each block once"
        self.offered[aid] = len(blocks)

    @precondition(lambda self: len(self.sender))
    @rule(data=st.data(), action=st.sampled_from(["unwatch", "computed", "complete", "fail"]))
    def act(self, data, action):
        aid = data.draw(st.sampled_from(self._ids()))
        if action == "unwatch":
            self.sender.unwatch(aid)
            self.unwatched.add(aid)
        elif action == "computed":
            before = self.sender.states()[aid]
            self.sender.computed(aid)
            after = OfferState.HANDING_OVER if before == OfferState.COMPUTING else before
            assert self.sender.states()[aid] == after
        else:
            state = OfferState.COMPLETE if action == "complete" else OfferState.FAILED
            assert self.sender.end(aid, state).state == state
            assert self.sender.end(aid, state) is None, "a record ends once"
            self.ended.add(aid)

    @rule(dt=st.floats(0, 3))
    def tick(self, dt):
        self.now += dt
        computing = {aid for aid, s in self.sender.states().items() if s == OfferState.COMPUTING}
        expired = self.sender.expire(self.now)
        assert set(expired) <= computing and len(expired) == len(set(expired)), "only a computing record expires"
        assert all(self.sender.states()[aid] == OfferState.EXPIRED for aid in expired)

    @precondition(lambda self: self.count)
    @rule(data=st.data())
    def ask_read(self, data):
        aid = f"a{data.draw(st.integers(0, self.count - 1))}"
        state = self.sender.states().get(aid)
        allowed = state is not None and state.live and not self.sender.retiring
        assert self.sender.ask_read(aid) == allowed, f"{aid} ({state}) asked: retiring {self.sender.retiring}"

    @rule()
    def retire(self):
        self.sender.retire()
        assert not any(self.sender.ask_read(aid) for aid in self._ids()), "a retired sender asks no read"

    @invariant()
    def records_left_are_gone_and_no_state_goes_back(self):
        states = self.sender.states()
        assert not self.ended & set(states), "an ended record is still kept"
        assert {aid for aid, _ in self.sender.watched()} == set(states) - self.unwatched
        for aid, state in states.items():
            assert state >= self.seen.get(aid, state), f"{aid}: {self.seen[aid].name} went back to {state.name}"
            self.seen[aid] = state


TestSenderMachine = SenderMachine.TestCase
TestSenderMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_the_sender_records_may_be_begun_while_the_step_thread_walks_them():
    """The event loop begins an attempt while the step thread expires the records: the
    walk must not see the dict change under it (that killed a prefill worker's step
    thread under a drain-and-add load)."""
    import threading

    sender = Sender()
    started = []

    sender.begin("a")

    class Walked(Offer):
        @property
        def state(self):  # read by expire's walk: the other thread begins an attempt now
            if not started:
                started.append(threading.Thread(target=sender.begin, args=("b",)))
                started[0].start()
                started[0].join(0.2)  # it waits for the walk (with the lock), or changes the dict (without)
            return OfferState.COMPUTING

        @state.setter
        def state(self, value):
            pass

    sender._records["w"] = Walked("w", deadline=0.0)
    due = sender.expire(now=1.0)  # raised "dictionary changed size during iteration" without the lock
    assert due == ["w"]
    started[0].join(5)
    assert "b" in sender
