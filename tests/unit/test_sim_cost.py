"""The cost model: step times grow with the work, never beat the datasheet roofline, and a
profile table's fit recovers the corrections that made it."""

from __future__ import annotations

import json

import pytest

from engine.core.step_shape import shape_of
from sim.contention import ANY_ROLE, Contention
from sim.cost import DEVICES, Corrections, CostModel, StepShape, decode_shape, model_spec, prefill_shape
from sim.fitting import cost_model, profile_row, read_profile, relative_error, step_profile
from sim.service_path import ServicePath

LLAMA = model_spec("llama-3.1-8b")


@pytest.mark.parametrize("kind", ["A100", "H100", "H200", "B200"])
def test_decode_steps_grow_with_batch_and_context(kind):
    cost = cost_model(kind, LLAMA)
    by_batch = [cost.step_s(decode_shape(b, 1024)) for b in (1, 8, 64, 256)]
    by_context = [cost.step_s(decode_shape(32, c)) for c in (128, 1024, 4096)]
    assert by_batch == sorted(by_batch) and by_batch[0] < by_batch[-1], by_batch
    assert by_context == sorted(by_context) and by_context[0] < by_context[-1], by_context


@pytest.mark.parametrize("kind", ["A100", "H100", "H200", "B200"])
def test_prefill_steps_grow_with_tokens_and_with_the_square_of_the_prompt(kind):
    cost = cost_model(kind, LLAMA)
    times = [cost.step_s(prefill_shape([n])) for n in (128, 512, 2048, 8192)]
    assert times == sorted(times), times
    # Same tokens, one long prompt instead of many short ones: more attention pairs, more time.
    assert cost.step_s(prefill_shape([4096])) > cost.step_s(prefill_shape([512] * 8))


@pytest.mark.parametrize("kind", ["A100", "H100", "H200", "B200"])
def test_no_step_beats_the_datasheet_roofline(kind):
    spec = DEVICES[kind]
    cost = cost_model(kind, LLAMA)
    for shape in (decode_shape(1, 16), decode_shape(256, 2048), prefill_shape([8192]), prefill_shape([64] * 16)):
        weights = LLAMA.layer_params * spec.dtype_bytes
        flops = 2 * LLAMA.layer_params * shape.num_tokens
        floor = max(weights / spec.hbm_bw, flops / spec.flops)
        assert cost.step_s(shape) >= floor, f"{kind} {shape}: {cost.step_s(shape)} s under the roofline {floor} s"


def test_a_small_batch_decode_step_is_bound_by_memory_bandwidth():
    h100, h200 = cost_model("H100", LLAMA), cost_model("H200", LLAMA)
    shape = decode_shape(1, 512)
    # Same FLOP/s, 1.43x the bandwidth: the memory-bound step is faster on the H200.
    assert h200.roofline_s(shape) < h100.roofline_s(shape) / 1.3
    # ... while a long prefill, compute-bound, takes the same time on both.
    big = prefill_shape([8192])
    assert h200.roofline_s(big) == pytest.approx(h100.roofline_s(big))


def test_transfer_time_is_latency_plus_bytes_over_the_link():
    ib = cost_model("H100", LLAMA, link="ib")
    nvlink = cost_model("H100", LLAMA, link="nvlink")
    one_gb = 10**9
    assert ib.transfer_s(2 * one_gb) - ib.transfer_s(one_gb) == pytest.approx(one_gb / DEVICES["H100"].ib_bw)
    assert nvlink.transfer_s(one_gb) < ib.transfer_s(one_gb)
    assert ib.transfer_s(0) == ib.link_latency_s


def test_kv_blocks_fit_beside_the_weights_and_a_model_too_large_is_refused():
    cost = cost_model("H100", LLAMA)
    blocks = cost.kv_blocks_fitting(16)
    per_block = LLAMA.bytes_per_block(16, 2)
    assert blocks * per_block + LLAMA.num_params * 2 <= 0.9 * DEVICES["H100"].memory_bytes
    assert (blocks + 1) * per_block + LLAMA.num_params * 2 > 0.9 * DEVICES["H100"].memory_bytes - per_block
    with pytest.raises(ValueError, match="does not fit"):
        CostModel(DEVICES["cpu"], model_spec("qwen2.5-14b")).kv_blocks_fitting(16)


def test_shape_of_reads_the_schedulers_plan():
    from engine.core.block_pool import KVCacheManager
    from engine.core.request import Request
    from engine.core.scheduler import Scheduler, SchedulerConfig
    from engine.wire.sampling_params import SamplingParams

    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100), KVCacheManager(64, 16, enable_caching=False))
    sched.add_request(Request("a", list(range(60)), SamplingParams(max_tokens=4)))
    sched.add_request(Request("b", list(range(100, 180)), SamplingParams(max_tokens=4)))
    shape = shape_of(sched.schedule())
    # a: 60 tokens whole; b: the 40 the budget leaves, from position 0, not sampled yet.
    assert (shape.batch, shape.num_tokens, shape.prefill_tokens, shape.num_sampled) == (2, 100, 100, 1)
    assert shape.attn_pairs == 60 * 61 // 2 + 40 * 41 // 2
    assert shape.kv_read_tokens == 100


def _synthetic_rows(cost: CostModel) -> list[dict]:
    shapes = [decode_shape(b, c) for b in (1, 2, 4, 8, 16, 32) for c in (64, 256)]
    shapes += [prefill_shape([n]) for n in (16, 64, 128, 256, 512)] + [prefill_shape([128] * 4)]
    return [profile_row(s, cost.step_s(s) * 1e3) for s in shapes]


def test_fitting_a_profile_table_recovers_the_corrections_that_made_it(tmp_path):
    tiny = model_spec("tandem-tiny-llama")
    truth = Corrections(overhead_s=4e-3, per_request_s=0.5e-3, mfu=1.0, mbu=1.0, per_token_s=30e-6,
                        per_pair_s=2e-9, per_kv_token_s=1e-6)
    made = CostModel(DEVICES["cpu"], tiny, truth)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(step_profile("cpu", tiny, 4, _synthetic_rows(made))))
    fitted = cost_model("cpu", tiny, profile=path)
    assert fitted.corrections.source == str(path)
    assert fitted.corrections.overhead_s == pytest.approx(truth.overhead_s, rel=0.05)
    assert fitted.corrections.per_request_s == pytest.approx(truth.per_request_s, rel=0.05)
    assert relative_error(fitted, read_profile(path)["rows"]) < 0.01


def test_steps_timed_on_a_shared_host_give_the_costs_alone_and_the_contention(tmp_path):
    """Live rows (``bench.sim``'s ``live_profile``): steps begun alone fit the corrections;
    those begun beside k other workers' steps, slower by a factor, give ``contention[k]``
    (a k no step had takes the one below); the table's service path is read too."""
    tiny = model_spec("tandem-tiny-llama")
    truth = Corrections(overhead_s=4e-3, per_request_s=0.5e-3, mfu=1.0, mbu=1.0, per_token_s=30e-6)
    made = CostModel(DEVICES["cpu"], tiny, truth)
    rows = [{**row, "others_busy": 0} for row in _synthetic_rows(made) * 2]
    rows += [{**row, "step_ms": row["step_ms"] * f, "others_busy": 1}
             for row in _synthetic_rows(made) for f in (1.2, 1.3, 1.4)]
    rows += [{**row, "step_ms": row["step_ms"] * 1.9, "others_busy": 3} for row in _synthetic_rows(made)]
    rows.append({**profile_row(StepShape(), 0.2), "others_busy": 1})  # a turn whose plan came out empty
    path = tmp_path / "live.json"
    service = ServicePath((0, 2), ((0.020, 0.025, 0.030), (0.050,)), spread=0.5)
    path.write_text(json.dumps({**step_profile("cpu", tiny, 4, rows), "service_path": service.to_json()}))
    cost = cost_model("cpu", tiny, profile=path)
    assert cost.corrections.overhead_s == pytest.approx(truth.overhead_s, rel=0.05)
    assert cost.corrections.per_request_s == pytest.approx(truth.per_request_s, rel=0.05)
    assert cost.contention.by_role[ANY_ROLE].factors == pytest.approx((1.0, 1.3, 1.3, 1.9), rel=0.01)
    assert cost.service_path == service
    # A table of steps timed alone (bench.steps) has no contention and no service path.
    path.write_text(json.dumps(step_profile("cpu", tiny, 4, _synthetic_rows(made))))
    assert not cost_model("cpu", tiny, profile=path).contention
    assert cost_model("cpu", tiny, profile=path).service_path == ServicePath()


def test_a_profile_of_another_device_or_format_is_refused(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(step_profile("cpu", LLAMA, 4, [profile_row(decode_shape(1, 8), 5.0)])))
    with pytest.raises(ValueError, match="measured on 'cpu'"):
        cost_model("H100", LLAMA, profile=path)
    path.write_text('{"format": "something-else", "rows": []}')
    with pytest.raises(ValueError, match="not a tandem-step-profile/1 table"):
        read_profile(path)


def test_an_empty_step_costs_nothing_and_unknown_kinds_are_named():
    assert cost_model("H100", LLAMA).step_s(StepShape()) == 0.0
    with pytest.raises(ValueError, match="unknown device kind 'TPU'"):
        cost_model("TPU", LLAMA)
    with pytest.raises(ValueError, match="unknown model 'gpt-5'"):
        model_spec("gpt-5")


def test_the_shipped_cpu_profile_fits_this_machines_steps_within_a_quarter():
    from pathlib import Path

    from sim.cost import ModelSpec

    path = Path(__file__).resolve().parents[2] / "sim" / "profiles" / "cpu-tandem-tiny-llama.json"
    doc = read_profile(path)
    cost = cost_model("cpu", ModelSpec(**doc["model"]), profile=path)
    err = relative_error(cost, doc["rows"])
    assert err < 0.25, f"the fitted CPU model is off by {err:.0%} on average on its own table"
    # What issue 12 measured: a CPU decode step grows with its batch.
    assert cost.step_s(decode_shape(32, 128)) > 2 * cost.step_s(decode_shape(1, 128))


def test_a_bench_gpu_table_sets_the_measured_shares_of_peak(tmp_path):
    path = tmp_path / "gpu-profile.json"
    rows = [{"op": "copy", "dtype": "uint8", "params": {}, "ms": 1.0, "throughput": 4.0, "unit": "TB/s"},
            {"op": "decode_attention", "dtype": "bfloat16", "params": {}, "ms": 1.0, "throughput": 3.6, "unit": "TB/s"},
            {"op": "prefill_attention", "dtype": "bfloat16", "params": {}, "ms": 1.0, "throughput": 494.5,
             "unit": "TFLOP/s"}]
    path.write_text(json.dumps({"format": "tandem-gpu-profile/1", "device": "NVIDIA H200", "rows": rows}))
    cost = cost_model("H200", LLAMA, profile=path)
    assert cost.corrections.mbu == pytest.approx(3.6e12 / DEVICES["H200"].hbm_bw)
    assert cost.corrections.mfu == pytest.approx(0.5)
    with pytest.raises(ValueError, match="measured on 'NVIDIA H200', not 'H100'"):
        cost_model("H100", LLAMA, profile=path)


def test_the_h200_table_fits_the_engines_own_steps_and_their_cost_grows_with_depth():
    """The table ``scripts/gpu-check`` measured on an H200 carries the engine's step profile
    (a ~0.35B Llama): the fit must describe those steps, and its per-step constant must be
    charged per layer, so that a deeper model pays more of it."""
    from dataclasses import replace
    from pathlib import Path

    from sim.cost import ModelSpec

    path = Path(__file__).resolve().parents[2] / "sim" / "profiles" / "H200-bench-gpu.json"
    doc = read_profile(path)
    model = ModelSpec(**doc["step_profile"]["model"])
    measured, assumed = cost_model("H200", model, profile=path), cost_model("H200", model)
    rows = doc["step_profile"]["rows"]
    assert relative_error(measured, rows) < 0.25 < relative_error(assumed, rows)
    c = measured.corrections
    assert c.overhead_s == 0 and c.per_layer_s > 0 and c.mbu < 1 and c.mfu < 1
    deeper = cost_model("H200", replace(model, num_layers=2 * model.num_layers), profile=path)
    fixed = [cost.step_s(decode_shape(1, 16)) - cost.roofline_s(decode_shape(1, 16)) for cost in (measured, deeper)]
    assert fixed[1] == pytest.approx(2 * fixed[0], rel=0.05)


def test_a_mixed_step_is_the_sum_of_its_decode_and_prefill_work():
    from sim.cost import merge

    mixed = merge(decode_shape(4, 100), prefill_shape([64]))
    assert (mixed.batch, mixed.num_tokens, mixed.prefill_tokens, mixed.num_sampled) == (5, 68, 64, 5)
    assert mixed.attn_pairs == 4 * 101 + 64 * 65 // 2
    cost = cost_model("H100", LLAMA)
    assert cost.step_s(mixed) >= max(cost.step_s(decode_shape(4, 100)), cost.step_s(prefill_shape([64])))


def test_contention_is_kept_by_role_and_grows_with_the_requests_in_flight():
    """Prefill steps slowed 1.5x beside another worker's, decode steps 1.1x; every decode
    step slower by 2% a request in flight: the slope is found within each count of others
    mid-step, and a factor is the mean at that count, moved by the slope from its mean
    in-flight count."""
    steps = [("prefill", 0, 2, 1.0)] * 6 + [("prefill", 1, 3, 1.5)] * 6
    steps += [("decode", k, n, (1.1 if k else 1.0) + 0.02 * (n - 4)) for k in (0, 1) for n in range(9)]
    fitted = Contention.fit(steps)
    prefill, decode = fitted.by_role["prefill"], fitted.by_role["decode"]
    assert prefill.factors == pytest.approx((1.0, 1.5)) and prefill.per_request == pytest.approx(0.0)
    assert decode.factors == pytest.approx((1.0, 1.1)) and decode.in_flight == pytest.approx((4, 4))
    assert decode.per_request == pytest.approx(0.02)
    assert fitted.factor("decode", 1, 8) == pytest.approx(1.18)
    assert fitted.factor("decode", 5, 4) == pytest.approx(1.1)  # past the last count: the last
    assert fitted.factor("decode", 0, -100) == 0.5  # never under half the step alone
    assert fitted.factor("prefill", 2, 0) == pytest.approx(1.5)
    assert fitted.factor("router", 1, 1) == 1.0  # no table for that role, none for any
