"""Mixture-of-experts MLP: top-k routing, experts computed grouped.

Each token goes to ``top_k`` of ``num_experts`` SwiGLU experts, chosen by a softmax
over a linear router's logits; their outputs are summed, weighted by those
probabilities (renormalised over the chosen experts when the model says so: Mixtral
always, Qwen3-MoE by ``norm_topk_prob``). The numerics follow Hugging Face
transformers (softmax in float32, ``torch.topk`` so ties pick the same experts).

Grouped: the step's (token, expert) pairs are sorted by expert once, and each expert
that any token chose runs one matmul over all of its tokens, rather than a loop over
tokens (``per_token_reference``, kept as the baseline that ``bench.moe`` measures); on
a GPU the same grouping runs as two Triton grouped GEMMs (``engine.model.triton_moe``).
The experts' weights sit stacked, ``[experts, 2 * intermediate, hidden]`` for gate and
up and ``[experts, hidden, intermediate]`` for down, as the loader builds them from
per-expert checkpoint tensors.

Tensor parallelism shards every expert, not the set of experts: each rank holds every
expert's 1/size of the intermediate rows (gate/up rows, down columns) and the whole
router, so each rank routes every token as the others do and its experts' sum is a
partial one, all-reduced once per layer after the experts are combined.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.model_config import MoEConfig
from engine.model.parallel import SINGLE, TPGroup, shard_of


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts each row goes to and their weights, both [T, top_k] (weights float32)."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class SparseMoE(nn.Module):
    """The sparse MLP of one layer: ``gate`` (the router) and the stacked experts (under
    tensor parallelism, ``tp``'s rank's slice of each)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, act, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.normalize = moe.num_experts, moe.top_k, moe.normalize
        first, last = shard_of(tp).split(moe.intermediate_size, "moe_intermediate_size")
        self.inter = last - first
        self.tp = tp
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(moe.num_experts, 2 * self.inter, hidden_size))
        self.experts_down = nn.Parameter(torch.empty(moe.num_experts, hidden_size, self.inter))
        self.act = act
        self.packed: nn.ModuleList | None = None  # per expert (gate_up, down), once ``pack`` ran

    def pack(self, packed_linear) -> None:
        """Each expert's two products as ``packed_linear`` modules (``engine.model.model.
        PackedLinear``: oneDNN's layout, far faster than ``F.linear`` at the few rows an
        expert gets per step); the stacked weights go."""
        pairs = []
        for e in range(self.num_experts):
            gate_up, down = (nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
                             for w in (self.experts_gate_up[e], self.experts_down[e]))
            gate_up.weight, down.weight = nn.Parameter(self.experts_gate_up[e]), nn.Parameter(self.experts_down[e])
            pairs.append(nn.ModuleList([packed_linear(gate_up), packed_linear(down)]))
        self.packed = nn.ModuleList(pairs)
        del self.experts_gate_up, self.experts_down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.normalize)
        if x.is_cuda:  # two grouped GEMM launches, no host loop over experts
            from engine.model.triton_moe import fused_experts

            out = fused_experts(x, self.experts_gate_up, self.experts_down, weights, experts, self.act)
        else:
            out = self._grouped(x, weights, experts)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        # (token, slot) pairs sorted by expert: each expert's rows are one stretch.
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        pair_weights = weights.reshape(-1)[order].to(x.dtype).unsqueeze(-1)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start : start + count]
            y = self._expert(expert, x[rows]) * pair_weights[start : start + count]
            out.index_add_(0, rows, y)
            start += count
        return out

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            gate_up, down = self.packed[expert]
            gate, up = gate_up(x).split(self.inter, dim=-1)
            return down(self.act(gate) * up)
        gate, up = F.linear(x, self.experts_gate_up[expert]).split(self.inter, dim=-1)
        return F.linear(self.act(gate) * up, self.experts_down[expert])

    def per_token_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same sum, one token and one expert at a time: the baseline the grouped
        path is measured against, and a check on it."""
        weights, experts = route(self.gate(x), self.top_k, self.normalize)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for slot in range(self.top_k):
                e = int(experts[t, slot])
                out[t] += self._expert(e, x[t : t + 1])[0] * weights[t, slot].to(x.dtype)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)
