"""The request's way through a live service (``sim.service_path``): grouping measured delays
by the requests in flight, drawing from a group, and fitting them on a calibration run."""

from __future__ import annotations

import json

import pytest

from sim.cost import model_spec
from sim.fitting import PROFILES, cost_model
from sim.report import summary
from sim.service_path import ServicePath, in_flight_at_send
from sim.simulator import Simulator
from sim.workload import generate, parse_spec


def test_delays_are_grouped_by_requests_in_flight_with_enough_in_each_group():
    in_flight = [0, 0, 2, 2, 2, 3, 5, 5, 5, 5, 6]
    path = ServicePath.fit(in_flight, [float(i) for i in range(1, 12)], min_samples=3)
    # 0 alone has two: the 2s join it (never split); 3 starts the next, which takes the
    # rest, since a last group of one (6) would be too small.
    assert path.starts == (0, 3)
    assert path.groups == ((1, 2, 3, 4, 5), (6, 7, 8, 9, 10, 11))
    # A negative delay (the simulation was slower than the service) counts as none.
    assert ServicePath.fit([0, 0, 1], [-0.004, 0.002, 0.003], min_samples=1).groups == ((0.0, 0.002), (0.003,))


def test_a_draw_is_its_groups_quantile_pulled_toward_the_median_by_the_spread():
    path = ServicePath((0, 2), ((0.010, 0.020, 0.030), (0.100,)), spread=1.0)
    assert path.delay_s(0, 0.0) == pytest.approx(0.010)
    assert path.delay_s(1, 0.75) == pytest.approx(0.025)  # between 20 and 30 ms, count 1 in the first group
    assert path.delay_s(9, 0.3) == pytest.approx(0.100)  # past the last start: the last group
    half = ServicePath(path.starts, path.groups, spread=0.5)
    assert half.delay_s(0, 0.0) == pytest.approx(0.015)
    assert half.delay_s(0, 0.5) == pytest.approx(0.020)
    assert not path.is_fixed and ServicePath.fixed(0.02).is_fixed and ServicePath().delay_s(3, 0.5) == 0.0
    assert ServicePath.from_json(json.loads(json.dumps(half.to_json()))) == half
    with pytest.raises(ValueError, match="a delay in each group"):
        ServicePath((0, 1), ((0.01,), ()))


def test_in_flight_counts_the_others_sent_before_and_not_yet_ended():
    assert in_flight_at_send([0.0, 1.0, 2.0, 3.0], [5.0, 1.5, 2.5, 4.0]) == [0, 1, 1, 1]


def test_a_calibration_run_measured_with_a_known_delay_gives_that_delay_back(tmp_path):
    """A "live" run made by the simulator itself, every request 30 ms later on its way
    through the service: ``bench.sim``'s fit finds 30 ms in every group."""
    from bench.sim import _live_topology, with_service_path

    tiny = model_spec("tandem-tiny-llama")
    table = tmp_path / "live.json"
    table.write_text((PROFILES / "cpu-tandem-tiny-llama.json").read_text())  # steps timed alone: no contention
    cost = cost_model("cpu", tiny, table)
    cost.service_path = ServicePath.fixed(0.030)
    trace = generate(parse_spec("synthetic:n=60,rate=4,in=128,out=16,seed=3"))
    result = Simulator(_live_topology("1P+1D", 512), cost, trace).run()
    requests = [{"sent_s": r.req.arrival_s, "prompt_tokens": r.req.prompt_tokens,
                 "requested_output_tokens": r.req.output_tokens, "ok": True,
                 "ttft_s": r.token_times[0] - r.req.arrival_s} for r in result.records]
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"runs": [{"request_rate": "4", "summary": summary(result),
                                                 "requests": requests}]}))
    with_service_path("1P+1D", table, calibration, 512)
    fitted = ServicePath.from_json(json.loads(table.read_text())["service_path"])
    assert len(fitted.groups) > 1  # 60 requests at 4 req/s: some sent alone, some beside others
    assert [d for group in fitted.groups for d in group] == pytest.approx([0.030] * 60, abs=1e-9)

