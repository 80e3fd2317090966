"""Engine settings: one frozen, validated dataclass, built once per engine."""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_hash import DEFAULT_HASH_ALGO, check_hash_algo, check_hash_seed
from engine.scheduler import check_modes

GiB = 1 << 30
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")


def check_at_least(config: object, **minimums: int) -> None:
    """Raise ValueError naming the first of ``config``'s fields below its minimum."""
    for name, lo in minimums.items():
        value = getattr(config, name)
        if value < lo:
            raise ValueError(f"{name} must be >= {lo}, got {value}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs. ``model=None`` means the built-in default model.

    KV memory comes from ``num_kv_blocks`` when given, else from ``kv_cache_memory``
    bytes; ``swap_space`` bytes of CPU memory hold swapped-out blocks.
    ``attention_backend``: ``torch`` (reference, any device), ``cpu`` (float32 decode
    straight out of the paged cache, a C kernel built on first use), ``triton`` (paged
    kernels, CUDA), or ``auto`` (triton on a CUDA device when triton imports; cpu for
    float32 on a CPU when the kernel builds; torch otherwise).
    ``pack_weights``: a float32 model on the CPU runs its layer projections on
    oneDNN-packed weights (``engine.model.PackedLinear``); off, on plain ``nn.Linear``.
    ``prefix_hash_algo`` (``blake2b`` | ``sha256``) and ``prefix_hash_seed`` (None: a
    random seed per process) name prefix-cache blocks; see ``engine.block_hash``. The
    router's placement index takes the decode engine's.
    """

    model: str | None = None
    dtype: str = "auto"  # bfloat16 on CUDA, float32 elsewhere (engine.loader.resolve_dtype)
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int = 1 * GiB
    swap_space: int = GiB // 2
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's own limit
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: str = "auto"
    policy: str = "fcfs"
    batching: str = "continuous"  # or "static": a baseline that batches like HF generate
    attention_backend: str = "auto"
    pack_weights: bool = True
    seed: int = 0
    prefix_hash_algo: str = DEFAULT_HASH_ALGO
    prefix_hash_seed: str | int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 bytes, got {self.swap_space}")
        check_at_least(self, max_num_batched_tokens=1, max_num_seqs=1)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        check_modes(self.preemption_mode, self.policy, self.batching)
        check_hash_algo(self.prefix_hash_algo)
        check_hash_seed(self.prefix_hash_seed)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
