"""Mixture-of-experts routing and expert sums against transformers' own modules, and
the loader's stacking of per-expert checkpoint tensors."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from engine.model.model_config import MoEConfig
from engine.model.moe import SparseMoE, route
from tests.helpers import build_hf_checkpoint

HIDDEN, EXPERTS, TOP_K, INTER = 32, 8, 2, 16


def _hf_router(family: str, normalize: bool, weight: torch.Tensor):
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

        router = MixtralTopKRouter(MixtralConfig(hidden_size=HIDDEN, num_local_experts=EXPERTS,
                                                 num_experts_per_tok=TOP_K))
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                                   norm_topk_prob=normalize))
    router.weight.data.copy_(weight)
    return router


@pytest.mark.parametrize("family,normalize", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)])
def test_routing_picks_and_weighs_as_transformers_does_ties_included(family, normalize):
    torch.manual_seed(0)
    weight = torch.randn(EXPERTS, HIDDEN)
    # Ties in the router logits: experts 0-3 share one row, so every token sees four
    # equal logits; the other rows are scaled down so the tied ones are the top ones.
    weight[1:4] = weight[0]
    weight[4:] *= 0.01
    x = torch.randn(64, HIDDEN)
    x[:, :] = x * torch.sign(x @ weight[0]).unsqueeze(-1)  # the tied logits come out positive
    _, hf_weights, hf_experts = _hf_router(family, normalize, weight)(x)
    weights, experts = route(F.linear(x, weight), TOP_K, normalize)
    logits = F.linear(x, weight)
    assert (logits[:, :4] == logits[:, :1]).all(), "the test should tie four logits per token"
    assert torch.equal(experts, hf_experts), "the same experts, ties broken the same way"
    assert torch.allclose(weights, hf_weights.float(), atol=0, rtol=1e-6)
    if normalize:
        assert torch.allclose(weights.sum(-1), torch.ones(64))


def _moe(normalize: bool = True) -> SparseMoE:
    torch.manual_seed(1)
    moe = SparseMoE(HIDDEN, MoEConfig(EXPERTS, TOP_K, INTER, normalize, (0,)), F.silu)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


@pytest.mark.parametrize("packed", [False, True])
def test_grouped_experts_equal_a_per_token_loop(packed):
    from engine.model.model import PackedLinear

    moe = _moe()
    x = torch.randn(37, HIDDEN)
    with torch.inference_mode():
        plain = moe.per_token_reference(x)
        if packed:
            moe.pack(PackedLinear)
        grouped, reference = moe(x), moe.per_token_reference(x)
    assert torch.allclose(grouped, reference, atol=1e-5, rtol=1e-5)
    assert torch.allclose(grouped, plain, atol=1e-5, rtol=1e-5), "packed experts compute what plain ones do"
    assert grouped.abs().mean() > 0.1, "the experts should have produced something"


def test_a_token_routed_to_no_row_of_an_expert_leaves_it_unused():
    """Experts no token chose are skipped, and a step of one token works."""
    moe = _moe()
    x = torch.randn(1, HIDDEN)
    with torch.inference_mode():
        assert torch.allclose(moe(x), moe.per_token_reference(x), atol=1e-5)


def test_experts_equal_transformers_sparse_block():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    moe = _moe(normalize=False)
    block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(
        hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=INTER,
        norm_topk_prob=False,
    ))
    with torch.no_grad():
        block.gate.weight.copy_(moe.gate.weight)
        block.experts.gate_up_proj.copy_(moe.experts_gate_up)
        block.experts.down_proj.copy_(moe.experts_down)
    x = torch.randn(3, 11, HIDDEN)
    with torch.inference_mode():
        want = block(x)
        got = moe(x.reshape(-1, HIDDEN)).reshape(want.shape)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_the_loader_stacks_each_experts_weights_in_order(tmp_path, default_model, family):
    from safetensors.torch import load_file

    from engine.model.loader import load_model

    ckpt = build_hf_checkpoint(tmp_path, family, default_model)
    saved = load_file(ckpt / "model.safetensors")
    model = load_model(ckpt, pack=False)
    moe = model.layers[0].mlp
    assert isinstance(moe, SparseMoE)
    names = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"), "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}
    block, gate, up, down = names[family]
    prefix = f"model.layers.0.{block}"
    for e in range(moe.num_experts):
        want = torch.cat([saved[f"{prefix}.experts.{e}.{gate}.weight"], saved[f"{prefix}.experts.{e}.{up}.weight"]])
        assert torch.equal(moe.experts_gate_up[e], want), f"expert {e}: gate and up out of place"
        assert torch.equal(moe.experts_down[e], saved[f"{prefix}.experts.{e}.{down}.weight"])
    assert torch.equal(moe.gate.weight, saved[f"{prefix}.gate.weight"])
    if family == "qwen3_moe":  # mlp_only_layers=[1]: a dense MLP there
        assert not isinstance(model.layers[1].mlp, SparseMoE) and isinstance(model.layers[2].mlp, SparseMoE)
