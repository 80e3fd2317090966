"""The Triton grouped-GEMM experts agree with the torch ones (``engine.model.moe``).

Without CUDA the kernels run in Triton's interpreter on CPU tensors (float32): this
module sets TRITON_INTERPRET before triton is first imported, as test_triton_attention
does. With CUDA the compiled kernels run.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (it comes with the test and gpu extras)")

from torch.nn import functional as F  # noqa: E402

from engine.model.model_config import MoEConfig  # noqa: E402
from engine.model.moe import SparseMoE, route  # noqa: E402
from engine.model.triton_moe import align, fused_experts  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def test_align_puts_each_experts_pairs_in_whole_tiles_padded_with_the_sentinel():
    experts = torch.tensor([[2, 0], [2, 3], [0, 2]])  # pairs 0..5; expert 1 chosen by none
    rows, tile_expert = align(experts, 4, block_m=4)
    assert tile_expert.tolist() == [0, 2, 3]
    sentinel = experts.numel()
    assert rows.view(-1, 4).tolist() == [[1, 4, sentinel, sentinel], [0, 2, 5, sentinel], [3] + [sentinel] * 3]


@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_fused_experts_equal_the_grouped_torch_experts(tokens):
    torch.manual_seed(tokens)
    hidden, inter, num_experts, top_k = 64, 32, 8, 2
    moe = SparseMoE(hidden, MoEConfig(num_experts, top_k, inter, True, (0,)), F.silu)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(tokens, hidden)
    with torch.inference_mode():
        want = moe(x)  # on the CPU: the grouped torch path
        weights, experts = route(moe.gate(x), top_k, True)
        got = fused_experts(x.to(DEVICE), moe.experts_gate_up.to(DEVICE), moe.experts_down.to(DEVICE),
                            weights.to(DEVICE), experts.to(DEVICE), F.silu)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
