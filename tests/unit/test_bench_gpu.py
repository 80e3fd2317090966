"""The GPU benchmark's timed run computes every token (its GPU parts run in scripts/gpu-check)."""

from __future__ import annotations

from bench.gpu import bench_prompts, engine_settings, table_peak_tbps


def test_warm_up_prompts_share_no_leading_block_with_the_timed_prompts():
    warmup, timed = bench_prompts(num_requests=64, prompt_len=1024, vocab=32000)
    assert len(timed) == 64 and all(len(p) == 1024 for p in timed + warmup)
    timed_heads = {tuple(p[:16]) for p in timed}
    assert not timed_heads & {tuple(p[:16]) for p in warmup}, "a warm-up prompt would seed the prefix cache"


def test_benchmarked_engine_has_prefix_caching_off():
    settings = engine_settings("triton", 64)
    assert settings["enable_prefix_caching"] is False, "cached prefixes would shorten the timed run"
    assert settings["device"] == "cuda" and settings["dtype"] == "bfloat16"


def test_peak_bandwidth_matches_the_more_specific_device_name_first():
    assert table_peak_tbps("NVIDIA H100 PCIe") == 2.0
    assert table_peak_tbps("NVIDIA A100-SXM4-80GB") == 2.039
    assert table_peak_tbps("NVIDIA H200") == 4.8
    assert table_peak_tbps("Unknown") is None
