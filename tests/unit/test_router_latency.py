"""The routers' latency reports for the pools' control loop: percentiles over a sliding
window, weighted per token, merged across replicas, and held against the SLO."""

from __future__ import annotations

import pytest

from router.latency import LatencyReport, LatencyWindow, merge


def test_the_report_is_the_p90_of_the_window_with_each_token_of_a_batch_counted():
    window = LatencyWindow(span_s=10.0)
    assert window.report(0.0) == LatencyReport(None, None, 0, 0)
    for i in range(10):  # TTFTs of 100, 200, ..., 1000 ms
        window.first_token(0.1 * (i + 1), now=1.0)
    window.tokens(9, 0.09, now=1.0)  # nine tokens 10 ms apart, delivered together
    window.tokens(1, 0.5, now=1.0)  # one token after 500 ms: a tenth of the tokens
    report = window.report(2.0)
    assert report.ttft_ms == pytest.approx(900) and report.requests == 10
    assert report.itl_ms == pytest.approx(10) and report.tokens == 10, "the slow gap is 10% of the tokens"
    window.tokens(1, 0.5, now=5.0)
    assert window.report(5.0).itl_ms == pytest.approx(500), "two slow tokens of eleven: past the 90th"
    assert window.report(11.5) == LatencyReport(None, 500.0, 0, 1), "what is older than span_s is gone"


def test_merged_reports_take_the_worst_replica_and_ignore_those_that_saw_nothing():
    a = LatencyReport(ttft_ms=300.0, itl_ms=20.0, requests=5, tokens=100)
    b = LatencyReport(ttft_ms=900.0, itl_ms=None, requests=2, tokens=0)
    idle = LatencyReport(None, None, 0, 0)
    assert merge([a, b, idle]) == LatencyReport(900.0, 20.0, 7, 100)
    assert merge([idle]) is None and merge([]) is None
