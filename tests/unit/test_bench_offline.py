"""``tandem bench offline``: roofline arithmetic, the decode step table and the throughput
run on small models."""

from __future__ import annotations

import json

import pytest

from bench.roofline import roofline_s, step_cost, workload_flops
from engine.model.model_config import ModelConfig

CFG = ModelConfig.from_dict({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
})  # fmt: skip


def test_a_step_reads_the_weights_once_and_each_requests_kv_and_does_two_flops_per_weight():
    one, four = step_cost(CFG, 1, 10), step_cost(CFG, 4, 10)
    kv_per_request = 10 * 2 * (2 * 16) * 2 * 4  # context x (K, V) x kv dim x layers x fp32
    matmul = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128) + 1000 * 64  # the layers', the head
    assert one["bytes"] == 4 * matmul + kv_per_request
    assert four["bytes"] == 4 * matmul + 4 * kv_per_request
    assert one["flops"] == 2 * matmul + 2 * 2 * 10 * 64 * 2
    assert four["flops"] == 4 * one["flops"]


def test_a_workloads_flops_count_every_token_through_the_layers_the_head_per_output_and_causal_attention():
    layers = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128)
    head = 1000 * 64
    attention_per_pair = 2 * 2 * 64 * 2  # QK^T and PV, q dim, layers
    one = workload_flops(CFG, [3], [2])
    assert one == 2 * layers * 5 + 2 * head * 2 + attention_per_pair * (1 + 2 + 3 + 4 + 5)
    assert workload_flops(CFG, [3, 3], [2, 2]) == 2 * one


def test_the_roofline_is_the_slower_of_memory_and_compute():
    assert roofline_s({"bytes": 100, "flops": 10}, bandwidth=10, flops=10) == (10.0, "memory")
    assert roofline_s({"bytes": 10, "flops": 100}, bandwidth=10, flops=10) == (10.0, "compute")


def test_the_decode_table_runs_against_transformers_on_a_small_model(tmp_path, default_model):
    from bench.offline import main

    out = tmp_path / "offline.json"
    argv = ["--model", str(default_model), "--skip-throughput", "--decode-batches", "1,2", "--decode-steps", "2",
            "--decode-context", "16", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    table = json.loads(out.read_text())["decode"]
    assert [r["batch"] for r in table["rows"]] == [1, 2]
    assert table["memory_bandwidth_gb_s"] > 0 and table["gemm_gflop_s"] > 0
    for row in table["rows"]:
        assert row["step_ms"] > 0 and row["hf_step_ms"] > 0 and row["roofline_ms"] > 0, row
        assert row["bound"] in ("memory", "compute")
        # The table's ms are rounded to 0.01; the ratios are of the unrounded times.
        assert row["step_over_roofline"] == pytest.approx(row["step_ms"] / row["roofline_ms"], rel=0.02), row
        assert row["speedup_vs_hf"] == pytest.approx(row["hf_step_ms"] / row["step_ms"], rel=0.02), row


def test_the_throughput_run_reports_its_share_of_the_compute_roofline(tmp_path, default_model):
    from bench.offline import main

    out = tmp_path / "offline.json"
    argv = ["--model", str(default_model), "--num-requests", "3", "--prompt-len", "4", "8", "--output-len", "2", "4",
            "--skip-hf", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    tandem = json.loads(out.read_text())["tandem"]
    assert tandem["roofline_s"] == pytest.approx(tandem["workload_flops"] / 1e9 / tandem["gemm_gflop_s"], rel=0.01)
    assert tandem["fraction_of_roofline"] == pytest.approx(tandem["roofline_s"] / tandem["seconds"])
    assert 0 < tandem["fraction_of_roofline"] < 1.5, tandem


def test_the_hf_reference_emits_the_eos_token_as_the_engine_does_under_ignore_eos(tmp_path, default_model):
    # generate(min_new_tokens=n) would mask EOS, so a reference that picks EOS mid-output
    # would differ from the engine's ignore_eos output from there on.
    from bench.offline import run_hf_static, run_tandem
    from tests.helpers import build_hf_checkpoint

    ckpt = build_hf_checkpoint(tmp_path, "llama", default_model, seed=4, initializer_range=0.2)
    prompts, outputs = [[5, 6, 7, 8, 9]], [10]
    engine_ids = run_tandem(str(ckpt), prompts, outputs, num_kv_blocks=64)["token_ids"]
    eos = engine_ids[0][3]
    for name in ("config.json", "generation_config.json"):
        path = ckpt / name
        cfg = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**cfg, "eos_token_id": eos}))
    assert run_tandem(str(ckpt), prompts, outputs, num_kv_blocks=64)["token_ids"] == engine_ids
    assert run_hf_static(str(ckpt), prompts, outputs, batch_size=1)["token_ids"] == engine_ids


def test_a_differing_output_is_located_and_its_logit_gap_read_from_the_reference(default_model):
    import torch

    from bench.offline import explain_differences, hf_model

    model = hf_model(str(default_model))
    prompt = [5, 6, 7, 8, 9]
    with torch.inference_mode():
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        logits = model(torch.tensor([prompt + greedy[:3]])).logits[0, -1]
    runner_up = int(logits.topk(2).indices[1])
    ours = greedy[:3] + [runner_up, 1, 2]  # the reference's second choice at position 3
    (found,) = explain_differences(model, [prompt, prompt], [greedy, ours], [greedy, greedy])
    assert found["request"] == 1 and found["position"] == 3
    assert found["ours"] == runner_up and found["reference"] == greedy[3]
    want = float(logits[greedy[3]] - logits[runner_up])
    assert found["logit_gap"] == pytest.approx(want, abs=1e-5) and found["logit_gap"] > 0
