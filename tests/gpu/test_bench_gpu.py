"""``bench.gpu``'s measurements run end to end at small sizes, on the test device, before
``scripts/gpu-check`` times them at full size: a broken call fails here, in the kernels
step, not after minutes of the benchmark. The numbers are not checked (on CPU they time
Triton's interpreter); what each measurement reports is."""

from __future__ import annotations

import pytest

from bench.gpu import (
    bench_batching,
    bench_decode,
    bench_prefill,
    bench_sampling,
    bench_steps,
    bench_transfer,
    copy_bandwidth,
)
from tests.gpu.device import DEVICE

pytest.importorskip("triton", reason="triton is not installed (it comes with the gpu extra)")

HEADS = dict(num_heads=8, num_kv_heads=2, head_dim=32, block_size=16)


def test_copy_decode_and_prefill_report_bandwidth_flops_and_profile_rows():
    copy = copy_bandwidth(1 << 20, DEVICE)
    assert copy["tbps"] > 0 and copy["row"]["op"] == "copy"
    decode = bench_decode(
        copy["tbps"], None, DEVICE, dict(batch=3, context=80, partition_size=32, **HEADS), [(1, 40)]
    )
    assert decode["achieved_tbps"] > 0 and decode["fraction_of_copy_peak"] > 0
    assert decode["speedup_vs_torch"] > 0 and decode["fraction_of_table_peak"] is None
    assert [r["params"]["batch"] for r in [decode["row"], *decode["sweep"]]] == [3, 1]
    prefill = bench_prefill(DEVICE, dict(chunks=2, chunk_len=24, **HEADS), [(1, 16)])
    assert prefill["achieved_tflops"] > 0 and prefill["row"]["unit"] == "TFLOP/s"
    assert [r["params"]["chunk_len"] for r in [prefill["row"], *prefill["sweep"]]] == [24, 16]


def test_sampling_times_the_seeded_draw_against_multinomial_at_each_shape():
    rows = bench_sampling((2, 5), (64,), DEVICE)["rows"]
    assert [(r["batch"], r["vocab"]) for r in rows] == [(2, 64), (5, 64)]
    assert all(r["sample_ms"] > 0 and r["multinomial_ms"] > 0 and r["ratio_vs_multinomial"] > 0 for r in rows)


def test_one_device_transfer_reports_handoff_bandwidth_and_equal_requests(tiny_model):
    small = dict(kv_cache_memory=16 << 20, swap_space=16 << 20)
    found = bench_transfer(tiny_model, num_requests=2, prompt_len=40, output_len=3, device=DEVICE, **small)
    assert found["kv_bytes"] > 0 and found["handoff_gbps"] > 0
    assert 0 <= found["requests_equal_to_one_engine"] <= 2
    assert found["row"]["op"] == "kv_handoff" and found["row"]["params"]["layers"] == 2


def test_engine_steps_make_a_step_profile_the_simulator_fits(tiny_model):
    from sim.cost import DEVICES, ModelSpec
    from sim.fitting import fit

    shape = dict(batches=(1, 2), contexts=(24,), steps=2, prefill_lengths=(16,), mixed_batches=(2,),
                 mixed_lengths=(16,))  # fmt: skip
    table = bench_steps(tiny_model, DEVICE, shape)
    assert table["format"] == "tandem-step-profile/1" and table["device"] in DEVICES
    # decode at batches 1 and 2, one prompt of 16 and four at once, a decode of 2 beside one
    assert [(r["batch"], r["prefill_tokens"]) for r in table["rows"]] == [(1, 0), (2, 0), (1, 16), (4, 64), (3, 16)]
    assert all(r["step_ms"] > 0 for r in table["rows"])
    corrections = fit(DEVICES[table["device"]], ModelSpec(**table["model"]), table["rows"])
    assert corrections.overhead_s + corrections.per_request_s + corrections.per_token_s > 0


def test_continuous_and_static_batching_generate_the_same_requests_and_report_a_ratio(tiny_model):
    small = dict(kv_cache_memory=16 << 20, swap_space=16 << 20)
    found = bench_batching(tiny_model, DEVICE, num_requests=4, max_num_seqs=2, prompt_lens=(8, 16),
                           output_lens=(1, 6), warmup_tokens=2, **small)  # fmt: skip
    continuous, static = found["continuous"], found["static"]
    assert continuous["output_tokens"] == static["output_tokens"] >= 4, "each mode generates every request's tokens"
    assert found["continuous_over_static"] > 0 and continuous["seconds"] > 0 and static["seconds"] > 0
