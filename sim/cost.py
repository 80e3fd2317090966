"""The cost model: how long a model step and a KV transfer take on a device kind.

Pure (no torch, no clock). A step's work is read off the engine's own plan
(``engine.core.scheduler.SchedulerOutput``) as a ``StepShape``: tokens computed, batch size,
attention pairs (a prompt of L tokens computed whole has L(L+1)/2: the "sum of squared
prompt lengths" term), KV tokens read, and tokens sampled. Its time is

    overhead_s + per_layer_s * layers + per_request_s * batch
        + max(compute, memory)                           # the roofline
        + per_token_s * tokens + per_pair_s * pairs + per_kv_token_s * kv_read

where ``compute`` is the step's FLOPs (2 per weight per token, 4 per head dimension per
attention pair per layer, the LM head only for sampled tokens) over the device's bf16
FLOP/s times ``mfu``, and ``memory`` the bytes it moves (every weight once, the KV it
reads and writes) over the HBM bandwidth times ``mbu``. The datasheet figures are in
``DEVICES``; the corrections (the ``Corrections`` fields) are fitted per device kind from
a profile table (``fit``), or, where none was measured, set to the assumed defaults
``GPU_DEFAULTS``. A GPU's shares of peak can come from the table ``bench.gpu --profile``
writes (``tandem-gpu-profile/1``: its measured decode-attention bandwidth and
prefill-attention FLOP/s; ``gpu_corrections``).

A KV transfer takes ``link latency + bytes / link bandwidth``; the simulator queues
transfers that share a worker's link (``sim.simulator``), which is the contention.

A worker at ``tensor_parallel_size`` t (``CostModel.at_tp``) is t devices, each holding
1/t of the weights and of the KV heads (or one head, shared, when the model has fewer KV
heads than ranks), as the engine shards them (``engine.model.parallel``): its step's
FLOPs and bytes are a rank's, plus the collectives the sharded forward makes, each over
the devices' NVLink (on the CPU, shared memory) as a ring would move them:

    (2 * layers + 1) all-reduces of the step's hidden states
        * (collective_latency_s + 2 (t - 1) / t * tokens * hidden * dtype_bytes / link)
    + one all-gather of the sampled tokens' logits
        * (collective_latency_s + (t - 1) / t * sampled * vocab * dtype_bytes / link)

Its KV blocks are those a rank's memory holds beside its weights (``kv_blocks_fitting``),
and a hand-off between a prefill worker at a and a decode worker at b moves every block's
KV once (per decode rank, when the heads are replicated), each rank over its own link at
once: it takes as long as the rank with the largest share (``handoff_busy_s``).

The corrections come from measured steps where there are some (``sim.fitting``: profile
tables, the fit, and ``cost_model``, a device kind's model as the commands build it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from engine.core.step_shape import StepShape
from sim.contention import NO_CONTENTION, Contention
from sim.service_path import NO_DELAY, ServicePath

GB = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    """Datasheet figures of one device kind (dense bf16 FLOP/s; bandwidths in bytes/s, one
    direction): what the roofline and the transfer times are made of."""

    name: str
    flops: float  # dense bf16 (fp32 for the CPU, which serves in float32)
    hbm_bw: float
    memory_bytes: float
    nvlink_bw: float
    ib_bw: float
    pcie_bw: float
    dtype_bytes: int = 2
    is_gpu: bool = True
    # One small collective between a worker's ranks (NCCL over NVLink, a few us; on the CPU
    # the shared-memory group's all-reduce of a decode step's hidden states, bench.tp).
    collective_latency_s: float = 10e-6


# SXM parts; NVLink is per GPU per direction, InfiniBand one NDR/HDR port per GPU.
DEVICES = {
    "A100": DeviceSpec("A100", 312e12, 2.039e12, 80 * GB, 300 * GB, 25 * GB, 32 * GB),
    "H100": DeviceSpec("H100", 989e12, 3.35e12, 80 * GB, 450 * GB, 50 * GB, 64 * GB),
    "H200": DeviceSpec("H200", 989e12, 4.8e12, 141 * GB, 450 * GB, 50 * GB, 64 * GB),
    "B200": DeviceSpec("B200", 2250e12, 8.0e12, 180 * GB, 900 * GB, 50 * GB, 64 * GB),
    # This machine: 2 vCPUs of a Xeon with AVX-512 (2 FMA units x 16 fp32 lanes at about
    # 2.5 GHz), its memory bandwidth a guess; the fitted corrections carry the rest.
    "cpu": DeviceSpec("cpu", 2 * 160e9, 20 * GB, 8 * GB, 10 * GB, 10 * GB, 10 * GB, dtype_bytes=4, is_gpu=False,
                      collective_latency_s=74e-6),
}
LINKS = ("nvlink", "ib", "pcie")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder's sizes, as far as the cost model needs them."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    max_model_len: int = 4096

    @property
    def layer_params(self) -> int:
        """Weights of every layer's projections (attention and MLP), norms left out."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        return self.num_layers * (attn + 3 * self.hidden_size * self.intermediate_size)

    @property
    def num_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        return self.layer_params + embed * (1 if self.tie_word_embeddings else 2)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def check_tensor_parallel(self, size: int) -> None:
        """ValueError naming what does not split over ``size`` ranks (the engine's rules:
        attention heads and the MLP's width divide; KV heads divide or are divided)."""
        kv = self.num_kv_heads
        for what, n in (("attention heads", self.num_heads), ("intermediate size", self.intermediate_size)):
            if n % size:
                raise ValueError(f"{self.name}: {what} ({n}) do not divide by tensor_parallel_size {size}")
        if kv % size and size % kv:
            raise ValueError(f"{self.name}: {kv} KV heads neither divide by nor divide tensor_parallel_size {size}")

    def kv_share(self, size: int) -> float:
        """The share of a token's KV one rank of ``size`` holds (its KV heads over all)."""
        return max(1, self.num_kv_heads // size) / self.num_kv_heads

    def bytes_per_block(self, block_size: int, dtype_bytes: int) -> int:
        """K and V of one block across all layers (``engine.model.kv_cache.bytes_per_block``)."""
        return block_size * self.kv_bytes_per_token(dtype_bytes)

    @classmethod
    def from_model_config(cls, name: str, config) -> ModelSpec:
        """From an ``engine.model.model_config.ModelConfig`` (read, not imported: no torch)."""
        return cls(name, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
                   config.head_dim, config.intermediate_size, config.vocab_size, config.tie_word_embeddings,
                   config.max_position_embeddings)


MODELS = {
    "llama-3.1-8b": ModelSpec("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, False, 8192),
    "llama-3.1-70b": ModelSpec("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256, False, 8192),
    "qwen2.5-14b": ModelSpec("qwen2.5-14b", 48, 5120, 40, 8, 128, 13824, 152064, False, 8192),
    "smollm2-135m": ModelSpec("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, True, 2048),
    # The built-in test model (engine/model/default_model.py), as its config.json says.
    "tandem-tiny-llama": ModelSpec("tandem-tiny-llama", 6, 384, 6, 2, 64, 1024, 4096, False, 2048),
}


def model_spec(name: str) -> ModelSpec:
    """A named model's sizes; ValueError naming the known ones."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r} for the simulator: one of {sorted(MODELS)}")
    return MODELS[name]


def merge(*shapes: StepShape) -> StepShape:
    """One step doing the work of all of ``shapes`` (a decoding batch and a prefill beside it)."""
    return StepShape(*(sum(getattr(s, f.name) for s in shapes) for f in fields(StepShape)))


def decode_shape(batch: int, context: int) -> StepShape:
    """``batch`` requests decoding one token each after ``context`` tokens."""
    return StepShape(batch, batch, 0, batch * (context + 1), batch * (context + 1), batch)


def prefill_shape(lengths: list[int]) -> StepShape:
    """Whole prompts of ``lengths`` computed in one step, each sampling its first token."""
    return StepShape(len(lengths), sum(lengths), sum(n for n in lengths if n > 1),
                     sum(n * (n + 1) // 2 for n in lengths), sum(lengths), len(lengths))


@dataclass(frozen=True)
class Corrections:
    """What the datasheet roofline leaves out: per-step, per-layer and per-request overheads,
    the achieved shares of peak (``mfu``, ``mbu``), and linear terms over tokens, attention
    pairs and KV tokens read. Fitted from a profile table, or assumed (``GPU_DEFAULTS``)."""

    overhead_s: float = 0.0
    per_layer_s: float = 0.0
    per_request_s: float = 0.0
    mfu: float = 0.5
    mbu: float = 0.75
    per_token_s: float = 0.0
    per_pair_s: float = 0.0
    per_kv_token_s: float = 0.0
    source: str = "assumed"  # "assumed", or the profile table it was fitted from


# Not measured: a GPU engine's step with a Python scheduler, launches and sampling; the
# shares of peak that serving kernels reach on Hopper (MFU 0.5, MBU 0.75).
GPU_DEFAULTS = Corrections(overhead_s=1.5e-3, per_layer_s=20e-6, per_request_s=15e-6, mfu=0.5, mbu=0.75)


class CostModel:
    """Step and transfer times of one device kind serving one model."""

    def __init__(self, device: DeviceSpec, model: ModelSpec, corrections: Corrections | None = None,
                 link: str = "ib", link_latency_s: float | None = None, block_size: int = 16,
                 service_path: ServicePath = NO_DELAY, contention: Contention = NO_CONTENTION,
                 tensor_parallel_size: int = 1) -> None:
        """``service_path``: a request's way through the service that no step or transfer
        accounts for (the HTTP ingress, the router's calls to the workers, the first token's
        way back), a delay before the router places it. ``contention``: for workers that
        share one host's cores (a local cluster on a CPU), what a step's time is multiplied
        by, by its role, the other workers mid-step and the requests in flight as it begins.
        Both only from a profile timed on a live service (``live_corrections``).
        ``tensor_parallel_size``: the ranks of one worker (the module docstring; ``at_tp``)."""
        if link not in LINKS:
            raise ValueError(f"link must be one of {LINKS}, got {link!r}")
        model.check_tensor_parallel(tensor_parallel_size)
        self.device, self.model = device, model
        self.corrections = corrections or (GPU_DEFAULTS if device.is_gpu else Corrections())
        self.link = link
        self.block_size = block_size
        self.link_bw = getattr(device, f"{link}_bw")
        self.link_latency_s = link_latency_s if link_latency_s is not None else (20e-6 if device.is_gpu else 1e-3)
        self.service_path = service_path
        self.contention = contention
        self.tensor_parallel_size = t = tensor_parallel_size
        self._by_tp: dict[int, CostModel] = {t: self}
        db = device.dtype_bytes
        self._kv_bytes_per_token = model.kv_bytes_per_token(db) * model.kv_share(t)  # one rank's
        self._weight_bytes = (model.layer_params + model.vocab_size * model.hidden_size) * db / t
        self._attn_flops_per_pair = 4 * model.num_layers * model.num_heads * model.head_dim / t
        self._head_flops = 2 * model.vocab_size * model.hidden_size / t
        self._token_flops = 2 * model.layer_params / t
        c = self.corrections
        self._fixed_s = c.overhead_s + c.per_layer_s * model.num_layers
        self._flops_per_s = device.flops * c.mfu
        self._bytes_per_s = device.hbm_bw * c.mbu
        # The ranks' collectives: a fixed cost a step, and bytes a token or sampled token.
        ring = (t - 1) / t
        reduces = 2 * model.num_layers + 1
        self._collective_fixed_s = (reduces + 1) * device.collective_latency_s if t > 1 else 0.0
        self._collective_token_s = reduces * 2 * ring * model.hidden_size * db / device.nvlink_bw
        self._collective_sampled_s = ring * model.vocab_size * db / device.nvlink_bw

    def at_tp(self, size: int) -> CostModel:
        """This model for a worker of ``size`` ranks (the same device, corrections, link, service
        path and contention); made once per size."""
        if size not in self._by_tp:
            self._by_tp[size] = CostModel(
                self.device, self.model, self.corrections, self.link, self.link_latency_s, self.block_size,
                self.service_path, self.contention, tensor_parallel_size=size)
            self._by_tp[size]._by_tp = self._by_tp
        return self._by_tp[size]

    def collective_s(self, tokens: int, sampled: int) -> float:
        """The step's collectives between the worker's ranks (0 at one rank)."""
        if self.tensor_parallel_size == 1:
            return 0.0
        return self._collective_fixed_s + self._collective_token_s * tokens + self._collective_sampled_s * sampled

    def roofline_s(self, s: StepShape) -> float:
        """The larger of the step's compute time and memory time at the fitted shares of peak."""
        return self._roofline_s(s.num_tokens, s.num_sampled, s.attn_pairs, s.kv_read_tokens)

    def _roofline_s(self, tokens: int, sampled: int, pairs: int, kv_read: int) -> float:
        flops = self._token_flops * tokens + self._head_flops * sampled + self._attn_flops_per_pair * pairs
        moved = self._weight_bytes + self._kv_bytes_per_token * (kv_read + tokens)
        return max(flops / self._flops_per_s, moved / self._bytes_per_s)

    def _compute_s(self, batch: int, tokens: int, sampled: int, pairs: int, kv_read: int) -> float:
        c = self.corrections
        t = self._fixed_s + c.per_request_s * batch + self._roofline_s(tokens, sampled, pairs, kv_read)
        t += self.collective_s(tokens, sampled)
        return t + (c.per_token_s * tokens + c.per_pair_s * pairs + c.per_kv_token_s * kv_read)

    def step_s(self, s: StepShape) -> float:
        """Seconds one step of this shape takes (0 for an empty one)."""
        if not s.batch and not s.swap_blocks:
            return 0.0
        t = self._compute_s(s.batch, s.num_tokens, s.num_sampled, s.attn_pairs, s.kv_read_tokens)
        if s.swap_blocks:  # each rank its share, over its own link at once
            t += s.swap_blocks * self.rank_block_bytes(self.block_size) / self.device.pcie_bw
        return t

    def decode_steps_s(self, batch: int, context: int, num_steps: int) -> np.ndarray:
        """``step_s`` of each of ``num_steps`` steps of ``batch`` requests decoding a token each
        after ``context`` tokens in all: the j-th reads ``context + batch * j`` (``shape_of``).
        One array, each element what ``_compute_s`` gives for that step to the bit (the same
        operations on the same integers, in the same order)."""
        c = self.corrections
        kv = context + batch * np.arange(1, num_steps + 1, dtype=np.int64)
        flops = self._token_flops * batch + self._head_flops * batch + self._attn_flops_per_pair * kv
        moved = self._weight_bytes + self._kv_bytes_per_token * (kv + batch)
        t = self._fixed_s + c.per_request_s * batch + np.maximum(flops / self._flops_per_s, moved / self._bytes_per_s)
        t += self.collective_s(batch, batch)
        return t + (c.per_token_s * batch + c.per_pair_s * kv + c.per_kv_token_s * kv)

    def block_bytes(self, block_size: int) -> int:
        """K and V of one block, every KV head (what a hand-off moves at one rank a side)."""
        return self.model.bytes_per_block(block_size, self.device.dtype_bytes)

    def rank_block_bytes(self, block_size: int) -> float:
        """One rank's share of a block: its KV heads (what its memory holds of each block)."""
        return self.block_bytes(block_size) * self.model.kv_share(self.tensor_parallel_size)

    def transfer_s(self, num_bytes: int) -> float:
        """A KV hand-off of ``num_bytes`` over the link, alone on it."""
        return self.link_latency_s + num_bytes / self.link_bw

    def handoff_busy_s(self, num_blocks: int, block_size: int, sender_tp: int, receiver_tp: int) -> float:
        """How long a hand-off of ``num_blocks`` keeps the two workers' links busy: each rank
        moves its share over its own link at once (``kv_transfer.sharded``), so the side whose
        ranks hold the most of a block sets it; at one rank a side, the whole block."""
        share = max(self.model.kv_share(sender_tp), self.model.kv_share(receiver_tp))
        return num_blocks * self.block_bytes(block_size) * share / self.link_bw

    @property
    def num_params_per_rank(self) -> float:
        return self.model.num_params / self.tensor_parallel_size

    def kv_blocks_fitting(self, block_size: int, memory_share: float = 0.9) -> int:
        """KV blocks that fit in each rank's device memory beside its weights (``memory_share``
        of it used): a worker's blocks, every rank holding its heads of each."""
        free = self.device.memory_bytes * memory_share - self.num_params_per_rank * self.device.dtype_bytes
        if free <= 0:
            t = self.tensor_parallel_size
            where = f"one {self.device.name}" if t == 1 else f"{t} {self.device.name}s (tensor_parallel_size {t})"
            raise ValueError(f"{self.model.name} ({self.model.num_params / 1e9:.1f}B parameters) does not fit "
                             f"{where} ({self.device.memory_bytes / GB:.0f} GB each)")
        return int(free // self.rank_block_bytes(block_size))
