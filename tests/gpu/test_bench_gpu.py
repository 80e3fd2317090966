"""``bench.gpu``'s measurements run end to end at small sizes, on the test device, before
``scripts/gpu-check`` times them at full size: a broken call fails here, in the kernels
step, not after minutes of the benchmark. The numbers are not checked (on CPU they time
Triton's interpreter); what each measurement reports is."""

from __future__ import annotations

import pytest

from bench.gpu import bench_decode, bench_prefill, bench_transfer, copy_bandwidth
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


def test_one_device_transfer_reports_handoff_bandwidth_and_equal_requests(tiny_model):
    small = dict(kv_cache_memory=16 << 20, swap_space=16 << 20)
    found = bench_transfer(tiny_model, num_requests=2, prompt_len=40, output_len=3, device=DEVICE, **small)
    assert found["kv_bytes"] > 0 and found["handoff_gbps"] > 0
    assert 0 <= found["requests_equal_to_one_engine"] <= 2
    assert found["row"]["op"] == "kv_handoff" and found["row"]["params"]["layers"] == 2
