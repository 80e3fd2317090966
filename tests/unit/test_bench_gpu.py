"""The GPU benchmark's parts that run on CPU: its timed run computes every token, the
1P+1D hand-off it times is correct, and it keeps its results and profile table after
each measurement (its GPU parts run in scripts/gpu-check)."""

from __future__ import annotations

import json

from bench.gpu import (
    PROFILE_FORMAT,
    bench_prompts,
    causal_flops,
    engine_settings,
    handoff,
    profile_row,
    saver,
    table_peak_tbps,
)


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


def test_the_one_device_handoff_decodes_what_one_engine_generates(tiny_model):
    """1P+1D as bench.gpu times it, on CPU in fp32: the decode engine, given the prefill
    engine's packed KV and first token, goes on exactly as one engine would."""
    from engine import LLM, LLMEngine, SamplingParams

    settings = dict(device="cpu", dtype="float32", num_kv_blocks=64, enable_prefix_caching=False)
    prompts = bench_prompts(num_requests=3, prompt_len=40, vocab=1000, warmup_requests=0)[1]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prefill, decode = LLMEngine(model=tiny_model, **settings), LLMEngine(model=tiny_model, **settings)
    found = handoff(prefill, decode, prompts, params, "cpu")
    want = [o.token_ids for o in LLM(model=tiny_model, **settings).generate(prompts, params)]
    assert found["tokens"] == want, "the decode engine parted from one engine's greedy run"
    blocks = 3 * -(-40 // 16)
    assert found["kv_bytes"] > 0 and found["kv_bytes"] % blocks == 0, "the KV of every prompt block"
    assert found["handoff_s"] > 0
    assert decode.stats().num_blocks_in_use == 0 and prefill.stats().num_blocks_in_use == 0


def test_results_and_profile_table_are_rewritten_after_each_measurement(tmp_path):
    out, profile = tmp_path / "bench.json", tmp_path / "profile.json"
    save = saver(out, profile)
    result = {"device": "GPU", "versions": {"torch": "x"}, "copy": copy_row()}
    save(result)
    assert [r["op"] for r in json.loads(profile.read_text())["rows"]] == ["copy"]
    decode = profile_row("decode_attention", "bfloat16", {"batch": 64, "context": 4096}, 0.5, 3.5, "TB/s")
    result["decode"] = {"row": decode, "sweep": [{**decode, "params": {"batch": 1, "context": 1024}}]}
    save(result)
    table = json.loads(profile.read_text())
    assert table["format"] == PROFILE_FORMAT and table["device"] == "GPU"
    assert [(r["op"], r["params"].get("batch")) for r in table["rows"]] == [
        ("copy", None), ("decode_attention", 64), ("decode_attention", 1)
    ]
    assert set(table["rows"][1]) == {"op", "dtype", "params", "ms", "throughput", "unit"}
    assert json.loads(out.read_text())["decode"]["row"] == decode


def copy_row() -> dict:
    return {"tbps": 4.0, "row": profile_row("copy", "uint8", {"bytes": 1 << 30}, 0.5, 4.0, "TB/s")}


def test_causal_flops_count_each_query_key_pair_once():
    # 3 queries see 1, 2 and 3 keys: 6 pairs, 4 x head_dim flops each per head.
    assert causal_flops(3, num_heads=2, head_dim=8) == 6 * 4 * 8 * 2


def test_a_failing_measurement_is_recorded_and_the_later_ones_still_run(monkeypatch, tmp_path):
    import argparse

    import torch

    import bench.gpu as gpu

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(gpu, "copy_bandwidth", copy_row)
    row = profile_row("decode_attention", "bfloat16", {"batch": 64}, 0.5, 3.0, "TB/s")
    monkeypatch.setattr(gpu, "bench_decode", lambda copy, table: {"row": row, "sweep": [], "achieved_tbps": 3.0,
                                                                  "fraction_of_copy_peak": 0.75})  # fmt: skip
    monkeypatch.setattr(gpu, "bench_prefill", lambda: 1 / 0)
    real_sampling = gpu.bench_sampling
    monkeypatch.setattr(gpu, "bench_sampling", lambda: real_sampling((2,), (64,), "cpu"))
    monkeypatch.setattr(gpu, "build_llama_05b", lambda path, dtype: path)
    monkeypatch.setattr(gpu, "engine_section", lambda model_dir, workload: {}["no such key"])
    handoff_row = profile_row("kv_handoff", "bfloat16", {}, 1.0, 50.0, "GB/s")
    monkeypatch.setattr(gpu, "bench_transfer", lambda model_dir, **kw: {"row": handoff_row, "handoff_gbps": 50.0})
    real_checksums = gpu.bench_checksums
    monkeypatch.setattr(gpu, "bench_checksums", lambda: real_checksums(size_mib=1, device="cpu"))
    out, profile = tmp_path / "bench.json", tmp_path / "profile.json"
    steps = {"format": "tandem-step-profile/1", "device": "H200", "rows": [{"batch": 1, "step_ms": 2.0}]}
    monkeypatch.setattr(gpu, "bench_steps", lambda model_dir: steps)
    monkeypatch.setattr(gpu, "bench_batching", lambda model_dir, **kw: {"continuous_over_static": 1.8})
    args = argparse.Namespace(skip_engine=False, skip_transfer=False, skip_steps=False, num_requests=2, prompt_len=8,
                              output_len=2)  # fmt: skip
    result = gpu.run(args, saver(out, profile))
    assert sorted(result["errors"]) == ["engine", "prefill"], result["errors"]
    assert "ZeroDivisionError" in result["errors"]["prefill"]
    saved = json.loads(out.read_text())
    assert saved["transfer"]["handoff_gbps"] == 50.0, "the transfer ran after the engine failed"
    assert [r["op"] for r in json.loads(profile.read_text())["rows"]] == [
        "copy", "decode_attention", "kv_handoff", "kv_block_checksums_scattered"
    ]
    assert saved["checksums"]["gbps"]["scattered"] > 0 and saved["checksums"]["bytes"] == 1 << 20
    assert json.loads(profile.read_text())["step_profile"] == steps, "the step profile rides in the table"
    assert saved["batching"]["continuous_over_static"] == 1.8, "batching ran after the engine failed"
    headline = gpu.summary(result)
    assert headline["decode_at_least_70%_of_copy"] is True and headline["failed"] == ["engine", "prefill"]
    assert len(headline["sampling_vs_multinomial"]) == 1, "the sampling ran after the prefill failed"
