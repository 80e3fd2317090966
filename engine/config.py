"""Engine settings: one frozen, validated dataclass, built once per engine."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from engine.core.block_hash import DEFAULT_HASH_ALGO, check_hash_algo, check_hash_seed
from engine.core.scheduler import SchedulerConfig, check_modes
from engine.grammar import GrammarLimits
from engine.model.step_layout import ATTENTION_BACKENDS

GiB = 1 << 30


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
    ``host_kv_cache_memory`` bytes of CPU memory more (0, the default: none) hold the host
    tier behind the prefix cache (``engine.core.host_tier``): evicted prefix blocks go
    there and a prefix lookup that runs past the device's hits is restored from it
    rather than recomputed. Swap and the tier share one host pool of both sizes: the
    tier holds at most its own size, and its entries give way to swap. Without
    ``enable_prefix_caching`` its bytes serve swap only.
    ``attention_backend``: ``torch`` (reference, any device), ``cpu`` (float32 decode
    straight out of the paged cache, a C kernel built on first use), ``triton`` (paged
    kernels, CUDA), or ``auto`` (triton on a CUDA device when triton imports; cpu for
    float32 on a CPU when the kernel builds; torch otherwise).
    ``pack_weights``: a float32 model on the CPU runs its layer projections on
    oneDNN-packed weights (``engine.model.model.PackedLinear``); off, on plain ``nn.Linear``.
    ``cuda_graphs``: on a CUDA device with the triton backend, steps replay CUDA graphs
    of the forward captured at start-up (``engine.model.cuda_graphs``: whole per batch bucket
    for decode steps, piecewise around the attention per token bucket for steps with
    prefill chunks); off, every step launches its kernels one by one.
    ``prefix_hash_algo`` (``blake2b`` | ``sha256``) and ``prefix_hash_seed`` (None: a
    random seed per process) name prefix-cache blocks; see ``engine.core.block_hash``. The
    router's placement index takes the decode engine's.
    ``grammar``: the bounds on a structured-output spec and the wall-clock limit on its
    compile (``engine.grammar.GrammarLimits``; a dict of its fields in a topology file).
    ``tensor_parallel_size``: the ranks one engine's model is split over (``engine.ranks``):
    each holds 1/N of the weights and of the KV heads, so ``kv_cache_memory``,
    ``swap_space`` and ``host_kv_cache_memory`` are per rank. Above 1, steps run eagerly
    (no CUDA graphs).
    ``max_loras``: LoRA adapters (PEFT's format, ``engine.model.lora``) resident at once, of
    rank up to ``max_lora_rank``; 0, the default, serves none. ``lora_adapters`` names the
    adapters loaded at start (``LLMEngine.load_adapter`` loads more); a request picks one by
    name, and one step may mix up to ``max_loras`` of them with the base model.
    """

    model: str | None = None
    dtype: str = "auto"  # bfloat16 on CUDA, float32 elsewhere (engine.model.loader.resolve_dtype)
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int = 1 * GiB
    swap_space: int = GiB // 2
    host_kv_cache_memory: int = 0
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
    cuda_graphs: bool = True
    seed: int = 0
    prefix_hash_algo: str = DEFAULT_HASH_ALGO
    prefix_hash_seed: str | int | None = None
    grammar: GrammarLimits = GrammarLimits()
    tensor_parallel_size: int = 1
    max_loras: int = 0  # LoRA adapters resident at once (engine.model.lora); 0: no adapters
    max_lora_rank: int = 16
    lora_adapters: dict[str, str] = field(default_factory=dict)  # name -> PEFT adapter directory, loaded at start

    # What an engine can change without reloading its model or reallocating its KV cache
    # (``LLMEngine.reset``, a worker's role switch): the scheduler's and prefix cache's settings.
    RESETTABLE = frozenset({
        "max_num_batched_tokens", "max_num_seqs", "max_model_len", "enable_chunked_prefill",
        "enable_prefix_caching", "preemption_mode", "policy", "batching", "seed", "prefix_hash_algo",
        "prefix_hash_seed",
    })

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's settings for an engine whose context is ``max_model_len``
        (without chunked prefill, one step's budget takes a whole prompt)."""
        budget = self.max_num_batched_tokens
        if not self.enable_chunked_prefill:
            budget = max(budget, max_model_len)
        return SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=self.max_num_seqs, max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill, preemption_mode=self.preemption_mode,
            policy=self.policy, batching=self.batching, max_loras=self.max_loras,
        )

    def fixed_differences(self, other: EngineConfig) -> list[str]:
        """The settings outside ``RESETTABLE`` on which ``other`` differs from this config:
        what a reset to ``other`` cannot change."""
        return [f.name for f in fields(self) if f.name not in self.RESETTABLE
                and getattr(self, f.name) != getattr(other, f.name)]

    def __post_init__(self) -> None:
        if isinstance(self.grammar, dict):  # from a topology file's ``engine`` section
            object.__setattr__(self, "grammar", GrammarLimits(**self.grammar))
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 bytes, got {self.swap_space}")
        if self.host_kv_cache_memory < 0:
            raise ValueError(f"host_kv_cache_memory must be >= 0 bytes (0 turns the host tier off), "
                             f"got {self.host_kv_cache_memory}")
        check_at_least(self, max_num_batched_tokens=1, max_num_seqs=1, tensor_parallel_size=1, max_loras=0,
                       max_lora_rank=1)
        if self.lora_adapters and not self.max_loras:
            raise ValueError(f"lora_adapters {sorted(self.lora_adapters)} need max_loras >= 1 (the adapters "
                             "resident at once)")
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
