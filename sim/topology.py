"""What the simulator deploys: a Tandem topology file's pools and engine settings, the router's
placement and admission settings, and the hardware it runs on.

The topology part reads the keys of ``cluster.config.ClusterConfig`` (``prefill_workers``,
``decode_workers``, ``engine``, ``prefill_engine``, ``decode_engine``, ``autoscaling``)
and builds each role's ``engine.config.EngineConfig`` from them as the cluster does, so
bad settings fail with the engine's own message. Keys that change nothing in a
simulation (resources, transfer backend, channels) are read and ignored; the CLI also
checks the whole file with ``ClusterConfig`` itself. ``to_topology`` writes one back.

KV blocks per worker are the engine's: ``num_kv_blocks``, else ``kv_cache_memory`` over
the bytes of a block. On a GPU kind, a topology that sets neither gets what fits beside
the weights in 90% of the device's memory (what the planner writes out explicitly).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from cluster.autoscaler import AutoscalingConfig
from engine.config import EngineConfig
from router.admission import AdmissionConfig
from router.dispatch_config import DispatchConfig
from sim.cost import CostModel

ROLES = ("prefill", "decode")
IGNORED_KEYS = {
    "model", "prefill_resources", "decode_resources", "transfer", "torch_threads", "stream_interval_s",
    "token_channel", "token_channel_host", "channel", "placement_strategy", "health_check_s", "restart_workers",
    "max_retries", "max_migrations", "name", "start_timeout_s",
}
USED_KEYS = {"prefill_workers", "decode_workers", "engine", "prefill_engine", "decode_engine", "autoscaling"}


@dataclass(frozen=True)
class RouterSettings:
    """The router's settings that shape placement (``router.dispatch.DispatchConfig``'s and the
    admission bounds), with the service's defaults."""

    placement: str = "load"  # "load" or "round_robin"
    prefix_affinity: bool = True
    max_imbalance_tokens: int = 4096
    max_imbalance_requests: int = 8
    local_prefill_tokens: int = 0
    local_prefill_backlog_tokens: int = 0
    capacity_wait_s: float = 30.0
    load_poll_s: float = 0.05
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)

    def __post_init__(self) -> None:
        if self.placement not in ("load", "round_robin"):
            raise ValueError(f"placement must be 'load' or 'round_robin', got {self.placement!r}")

    def dispatch_config(self, decode_engine: EngineConfig) -> DispatchConfig:
        """The dispatcher's settings these stand for, with the decode engines' block size and cap."""
        return DispatchConfig(
            block_size=decode_engine.block_size, max_running_per_decode=decode_engine.max_num_seqs,
            capacity_wait_s=self.capacity_wait_s, load_poll_s=self.load_poll_s, placement=self.placement,
            prefix_affinity=self.prefix_affinity, max_imbalance_tokens=self.max_imbalance_tokens,
            max_imbalance_requests=self.max_imbalance_requests, local_prefill_tokens=self.local_prefill_tokens,
            local_prefill_backlog_tokens=self.local_prefill_backlog_tokens,
        )


@dataclass(frozen=True)
class SimTopology:
    """Pool sizes, each role's engine settings, autoscaling (None: fixed pools) and the router's
    settings. ``prefill_workers`` 0 is colocated: decode workers run requests whole."""

    prefill_workers: int = 1
    decode_workers: int = 1
    engine: dict = field(default_factory=dict)
    prefill_engine: dict = field(default_factory=dict)
    decode_engine: dict = field(default_factory=dict)
    autoscaling: AutoscalingConfig | None = None
    router: RouterSettings = field(default_factory=RouterSettings)
    worker_start_s: float = 60.0  # an added worker's time to start and load its model

    def __post_init__(self) -> None:
        if self.prefill_workers < 0 or self.decode_workers < 1:
            raise ValueError(f"need prefill_workers >= 0 and decode_workers >= 1, got "
                             f"{self.prefill_workers} and {self.decode_workers}")
        for role in ROLES:
            self.engine_config(role)

    @property
    def colocated(self) -> bool:
        return self.prefill_workers == 0

    @property
    def num_devices(self) -> int:
        """Devices the pools hold: each worker one a rank."""
        return (self.prefill_workers * self.tensor_parallel_size("prefill")
                + self.decode_workers * self.tensor_parallel_size("decode"))

    def tensor_parallel_size(self, role: str) -> int:
        """The ranks, so devices, of one worker of ``role`` (its engine's ``tensor_parallel_size``)."""
        return self.engine_config(role).tensor_parallel_size

    def engine_config(self, role: str) -> EngineConfig:
        """The role's engine settings, as ``ClusterConfig.engine_config`` builds them."""
        extra = self.prefill_engine if role == "prefill" else self.decode_engine
        try:
            return EngineConfig(**{**self.engine, **extra})
        except TypeError as e:
            raise ValueError(f"unknown engine setting in {role} config: {e}") from e

    def kv_blocks(self, role: str, cost: CostModel) -> tuple[int, int]:
        """(device blocks, swap blocks) of one worker of ``role``, as its engine would size them
        (``kv_cache_memory`` and ``swap_space`` are per rank, as the engine's are)."""
        config = self.engine_config(role)
        cost = cost.at_tp(config.tensor_parallel_size)
        per_block = cost.rank_block_bytes(config.block_size)
        settings = {**self.engine, **(self.prefill_engine if role == "prefill" else self.decode_engine)}
        if config.num_kv_blocks:
            blocks = config.num_kv_blocks
        elif "kv_cache_memory" in settings or not cost.device.is_gpu:
            blocks = max(2, int(config.kv_cache_memory // per_block))
        else:
            blocks = cost.kv_blocks_fitting(config.block_size)
        return blocks, int(config.swap_space // per_block)

    @classmethod
    def from_dict(cls, d: dict, router: RouterSettings | None = None, **extra) -> SimTopology:
        unknown = set(d) - USED_KEYS - IGNORED_KEYS
        if unknown:
            raise ValueError(f"unknown topology settings: {sorted(unknown)}")
        kwargs = {k: d[k] for k in USED_KEYS if k in d}
        if isinstance(kwargs.get("autoscaling"), dict):
            kwargs["autoscaling"] = AutoscalingConfig.from_dict(kwargs["autoscaling"])
        return cls(**kwargs, router=router or RouterSettings(), **extra)

    @classmethod
    def from_yaml(cls, path: str | Path, router: RouterSettings | None = None, **extra) -> SimTopology:
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a topology file must be a mapping")
        return cls.from_dict(data, router, **extra)

    def to_topology(self, model: str | None = None) -> dict:
        """The topology file's keys for ``ClusterConfig.from_dict`` (router settings are flags)."""
        out: dict = {}
        if model:
            out["model"] = model
        out |= {"prefill_workers": self.prefill_workers, "decode_workers": self.decode_workers}
        for key in ("engine", "prefill_engine", "decode_engine"):
            if getattr(self, key):
                out[key] = dict(getattr(self, key))
        if self.autoscaling is not None:
            out["autoscaling"] = dataclasses.asdict(self.autoscaling)
        return out

    def replace(self, **changes) -> SimTopology:
        return dataclasses.replace(self, **changes)
