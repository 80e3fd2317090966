"""bench.local_prefill's figures from bench.serve's per-request records."""

from __future__ import annotations

from bench.local_prefill import by_group


def test_short_prompts_ttft_and_long_prompts_itl_medians_in_ms():
    requests = [
        {"ok": True, "group": "short", "ttft_s": 0.010, "itl_s": [0.5]},
        {"ok": True, "group": "short", "ttft_s": 0.030, "itl_s": [0.5]},
        {"ok": True, "group": "short", "ttft_s": 0.020, "itl_s": []},
        {"ok": True, "group": "long", "ttft_s": 9.0, "itl_s": [0.004, 0.006]},
        {"ok": True, "group": "long", "ttft_s": 9.0, "itl_s": [0.008]},
        {"ok": False, "group": "short", "ttft_s": None, "itl_s": []},
    ]
    assert by_group(requests) == {"completed": 5, "failed": 1, "short_ttft_p50_ms": 20.0, "long_itl_p50_ms": 6.0}
