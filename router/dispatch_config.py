"""The dispatcher's settings (``DispatchConfig``), apart from the dispatcher, so the pure
placement state (``router.worker_loads``) and the simulator read them without Ray."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.block_hash import DEFAULT_HASH_ALGO, check_hash_algo, check_hash_seed
from engine.wire.token_channel import ChannelConfig

PLACEMENTS = ("load", "round_robin")


@dataclass(frozen=True)
class DispatchConfig:
    """The dispatcher's settings: placement and its limits, re-runs and migrations, local prefill
    rules, the prefix hash and the token channel; checked on creation. Block size and the running
    cap come from the cluster (``dispatch_settings``), to match the engines."""

    block_size: int = 16
    max_running_per_decode: int = 256
    max_retries: int = 2  # re-runs of a request whose decode worker died before any token
    max_migrations: int = 3  # moves of a stream whose decode worker died after tokens were sent
    capacity_wait_s: float = 30.0  # how long a request may wait for KV room
    load_poll_s: float = 0.05  # placement uses load reports at most this old
    placement: str = "load"  # "load": the load-aware policies; "round_robin": the baseline
    prefix_affinity: bool = True
    max_imbalance_tokens: int = 4096  # how much busier an affine prefill worker may be
    max_imbalance_requests: int = 8  # how many more requests an affine decode worker may run
    # Per-request disaggregation (placement.prefill_here; 0 turns a rule off): a prompt with
    # at most this many tokens missing from its decode worker's prefix cache is computed there...
    local_prefill_tokens: int = 0
    # ...and so is any prompt while every prefill worker has this many tokens queued.
    local_prefill_backlog_tokens: int = 0
    # The prompt hashes of the prefix indexes (engine.core.block_hash). They need not match
    # the engines' (each side compares only its own), but one setting names both.
    prefix_hash_algo: str = DEFAULT_HASH_ALGO
    prefix_hash_seed: str | int | None = None  # None: a random one per dispatcher
    # The token channel's heartbeats and reconnect grace (the workers get the same settings).
    channel: ChannelConfig = field(default_factory=ChannelConfig)

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        for name in ("local_prefill_tokens", "local_prefill_backlog_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: off), got {getattr(self, name)}")
        check_hash_algo(self.prefix_hash_algo)
        check_hash_seed(self.prefix_hash_seed)
