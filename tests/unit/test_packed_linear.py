"""Float32 models on the CPU run their layers' projections on oneDNN-packed weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from engine.model.loader import load_model
from engine.model.model import MAX_PACKED_ROWS, PackedLinear, packed_rows

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_projection_gives_the_linear_product(bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias)
    packed = PackedLinear(linear)
    for rows in (1, 7, 17, 64, 300, MAX_PACKED_ROWS + 77):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert packed(torch.randn(4, 192)[:, ::2]).shape == (4, 160), "non-contiguous input rows are taken too"


def test_row_counts_run_as_a_few_shapes_so_onednn_keeps_a_bounded_set_of_primitives():
    # oneDNN keeps memory per row count it has seen: prefill token counts take any value.
    shapes = {packed_rows(n) for n in range(1, MAX_PACKED_ROWS + 1)}
    assert len(shapes) <= 40 and max(shapes) == MAX_PACKED_ROWS
    assert all(n <= packed_rows(n) < 1.25 * n for n in range(1, MAX_PACKED_ROWS + 1))
    assert [packed_rows(n) for n in (1, 16, 17, 33, 257)] == [1, 16, 20, 40, 320]


def test_a_float32_cpu_model_packs_every_layer_projection_and_keeps_its_weight_bytes(default_model):
    model = load_model(default_model)
    for layer in model.layers:
        projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        assert all(isinstance(p, PackedLinear) for p in projections)
    assert isinstance(model.lm_head, PackedLinear)
    saved = load_file(default_model / "model.safetensors")
    assert model.weight_bytes() == 4 * sum(t.numel() for t in saved.values()), "packing holds no second copy"


def test_a_head_tied_to_the_embedding_is_packed_as_a_copy_and_the_lookup_keeps_its_rows(tmp_path, default_model):
    from tests.helpers import build_hf_checkpoint

    path = build_hf_checkpoint(tmp_path, "qwen2", default_model)  # tied embeddings
    model = load_model(path)
    assert isinstance(model.lm_head, PackedLinear) and model.embed_tokens.weight.shape[0] == model.config.vocab_size
    hidden = torch.randn(3, model.config.hidden_size)
    torch.testing.assert_close(model.logits(hidden), hidden @ model.embed_tokens.weight.T, rtol=1e-4, atol=1e-4)


def test_half_precision_models_stay_unpacked(default_model):
    model = load_model(default_model, dtype="bfloat16")
    assert isinstance(model.layers[0].mlp.down_proj, nn.Linear)


def test_an_engine_can_keep_plain_projections_and_bench_steps_compares_the_two(default_model, capsys):
    import json

    from bench.steps import main
    from engine import LLMEngine

    plain = LLMEngine(model=str(default_model), num_kv_blocks=16, pack_weights=False)
    assert isinstance(plain.model.layers[0].mlp.down_proj, nn.Linear)
    assert main(["--model", str(default_model), "--batches", "1,2", "--steps", "2", "--context", "16",
                 "--unpacked"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["batch"] for r in rows] == [1, 2]
    assert all(r["step_ms"] > 0 and r["unpacked_step_ms"] > 0 and r["unpacked_over_default"] > 0 for r in rows)
