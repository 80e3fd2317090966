"""The scheduler's queues: the order each policy gives, built from plain requests."""

from __future__ import annotations

import pytest

from engine.core.request import Request
from engine.core.request_queues import FcfsQueue, PriorityQueue, SortedRequests, order_key, waiting_queue
from engine.wire.sampling_params import SamplingParams


def _requests(*priorities: int) -> list[Request]:
    reqs = []
    for seq_no, priority in enumerate(priorities):
        r = Request(f"r{seq_no}", [1, 2, 3], SamplingParams(), priority=priority)
        r.seq_no = seq_no
        reqs.append(r)
    return reqs


def _drain(queue) -> list[str]:
    out = []
    while queue.peek() is not None:
        out.append(queue.pop().request_id)
    return out


def test_fcfs_hands_out_arrival_order_and_a_sent_back_request_first():
    queue = waiting_queue("fcfs")
    assert isinstance(queue, FcfsQueue)
    r0, r1, r2 = _requests(0, 0, 0)
    for r in (r1, r2):
        queue.push(r)
    queue.push_back_in(r0)  # preempted: it ran before the others waited
    assert len(queue) == 3
    assert _drain(queue) == ["r0", "r1", "r2"]


def test_priority_hands_out_the_lowest_value_first_and_ties_by_arrival():
    queue = waiting_queue("priority")
    assert isinstance(queue, PriorityQueue)
    reqs = _requests(5, 1, 1, 0)
    for r in reqs:
        queue.push(r)
    queue.remove(reqs[2])
    assert _drain(queue) == ["r3", "r1", "r0"], "priority 0, then 1 (r2 removed), then 5"


def test_priority_sends_a_preempted_request_back_to_its_place_not_the_front():
    queue = PriorityQueue()
    urgent, preempted = _requests(0, 3)
    queue.push(urgent)
    queue.push_back_in(preempted)
    assert _drain(queue) == ["r0", "r1"]


@pytest.mark.parametrize("policy, order", [("fcfs", ["r0", "r1", "r2"]), ("priority", ["r1", "r2", "r0"])])
def test_sorted_requests_keep_the_policy_order_whatever_the_order_added(policy, order):
    requests = SortedRequests(order_key(policy))
    reqs = _requests(9, 0, 4)
    for r in reversed(reqs):
        requests.add(r)
    assert [r.request_id for r in requests] == order
    assert requests.first().request_id == order[0] and requests.last().request_id == order[-1]
    requests.remove(requests.last())
    assert [r.request_id for r in requests] == order[:-1] and len(requests) == 2


def test_removing_a_request_that_is_not_in_the_set_is_an_error():
    requests = SortedRequests(order_key("fcfs"))
    a, b = _requests(0, 0)
    requests.add(a)
    with pytest.raises(ValueError, match="'r1' is not in this set"):
        requests.remove(b)
