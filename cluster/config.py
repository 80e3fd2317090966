"""The topology of a Tandem deployment: one frozen config, from YAML and/or CLI flags.

Example YAML::

    model: /models/llama-3-8b        # or a .gguf file, or a name (engine/model/model_registry.py);
                                     # omitted: tandem-tiny-llama (`tandem up`: smollm2-135m-instruct)
    prefill_workers: 2
    decode_workers: 2                # prefill_workers: 0 runs colocated workers
    prefill_resources: {num_cpus: 1, num_gpus: 1}
    decode_resources: {num_cpus: 1, num_gpus: 1}
    transfer: {backend: nixl, timeout_s: 30, failure_policy: recompute}   # default: nixl where installed
    engine: {dtype: bfloat16, max_num_batched_tokens: 4096}   # both roles
    decode_engine: {kv_cache_memory: 40000000000}            # one role only
                              # tensor_parallel_size: N splits each worker over N ranks, one
                              # bundle (one GPU) each on one node; colocated only for now
    stream_interval_s: 0.05   # a stream sends at most one message per 50 ms (0: one per step)
    token_channel: tcp        # step messages to routers over TCP (ray: Ray streaming)
    token_channel_host: 0.0.0.0   # where it listens (default 127.0.0.1: routers on the same node)
    channel: {heartbeat_s: 1, heartbeat_timeout_s: 10, reconnect_grace_s: 10}   # engine/wire/token_channel.py
    start_timeout_s: 600      # placing the pools and loading the model, at most; then it fails
    autoscaling:              # omitted: the pools keep the sizes above (cluster/autoscaler.py)
      prefill: {min_workers: 1, max_workers: 4}
      decode: {min_workers: 1, max_workers: 4}
      slo: {ttft_ms: 1000, itl_ms: 50}
      interval_s: 5
      scale_down_delay_s: 30
      scale_up_share: 0.5     # a pool over its SLO starts this share of its workers at once (0: one)
      allow_role_switch: false  # true: a warm worker may move between roles (needs both roles alike:
                                # resources and engine settings, so not with decode_engine above)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from cluster.autoscaler import AutoscalingConfig
from engine.config import EngineConfig, check_at_least
from engine.wire.token_channel import ChannelConfig
from kv_transfer.config import TransferConfig


@dataclass(frozen=True)
class Resources:
    """What each worker of a pool asks Ray for: CPUs, GPUs and custom resources (``bundle``,
    its placement-group bundle)."""

    num_cpus: float = 0.25
    num_gpus: float = 0.0
    # Custom Ray resources, e.g. {"tandem_decode": 1} to pin a pool to its node group.
    custom: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError(f"worker resources must be >= 0, got {self}")
        if self.num_cpus == 0 and self.num_gpus == 0:
            raise ValueError("a worker needs some CPU or GPU (num_cpus or num_gpus > 0)")

    def bundle(self) -> dict[str, float]:
        b = {"CPU": self.num_cpus, **self.custom}
        if self.num_gpus:
            b["GPU"] = self.num_gpus
        return b

    def rank_bundle(self) -> dict[str, float]:
        """The bundle of a tensor-parallel rank past rank 0: the worker's CPUs and GPUs, not
        its custom resources (those count workers on a node, and the ranks share rank 0's)."""
        return {k: v for k, v in self.bundle().items() if k in ("CPU", "GPU")}


@dataclass(frozen=True)
class ClusterConfig:
    """A deployment's topology (the module docstring has it as YAML): model, pool sizes and
    resources, engine and transfer settings, streaming, restarts and autoscaling. Checked whole on
    creation, both roles' engine settings included."""

    model: str | None = None
    prefill_workers: int = 1
    decode_workers: int = 1
    prefill_resources: Resources = field(default_factory=Resources)
    decode_resources: Resources = field(default_factory=Resources)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    engine: dict = field(default_factory=dict)
    prefill_engine: dict = field(default_factory=dict)
    decode_engine: dict = field(default_factory=dict)
    torch_threads: int = 1
    # The least time between two messages of one request's stream; tokens produced
    # meanwhile go out together. Each message costs the worker CPU (serialising, and
    # over Ray about a millisecond), which on a few cores competes with the engine.
    stream_interval_s: float = 0.0
    # How decode workers stream step messages to routers: "tcp", each worker's token
    # channel (engine/wire/token_channel.py), about 1 ms of CPU less per message; "ray", Ray
    # streaming generators. The channel listens on token_channel_host (any free port):
    # 127.0.0.1 serves routers on the worker's own node only; 0.0.0.0 (the Helm chart's
    # setting) serves any, advertising the node's IP. A router that cannot connect
    # streams over Ray instead.
    token_channel: str = "tcp"
    token_channel_host: str = "127.0.0.1"
    # The channel's heartbeats, reconnect grace and per-subscriber bounds (ChannelConfig),
    # for the workers and the routers alike.
    channel: ChannelConfig = field(default_factory=ChannelConfig)
    placement_strategy: str = "PACK"
    health_check_s: float = 1.0
    restart_workers: bool = True
    max_retries: int = 2  # re-runs of a request whose decode worker died before any token
    max_migrations: int = 3  # moves of a stream whose decode worker died mid-stream
    name: str = "tandem"
    # How long a start may take: placing the pools (their resources may still be coming,
    # e.g. GPU pods being scheduled) and loading the model. Past it the start removes
    # what it placed and fails; the next start tries again from nothing.
    start_timeout_s: float = 600.0
    # The pools' control loop (cluster/elastic.py): None keeps the sizes above. The
    # sizes above are where each pool starts, within the bounds.
    autoscaling: AutoscalingConfig | None = None

    def __post_init__(self) -> None:
        check_at_least(self, prefill_workers=0, decode_workers=1, max_retries=0, max_migrations=0)
        if not 0 <= self.stream_interval_s <= 10:
            raise ValueError(f"stream_interval_s must be in [0, 10] seconds, got {self.stream_interval_s}")
        if self.token_channel not in ("tcp", "ray"):
            raise ValueError(f"token_channel must be 'tcp' or 'ray', got {self.token_channel!r}")
        if not self.start_timeout_s > 0:
            raise ValueError(f"start_timeout_s must be > 0 seconds, got {self.start_timeout_s}")
        if self.placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(f"placement_strategy must be a Ray strategy, got {self.placement_strategy!r}")
        if self.autoscaling is not None:
            self._check_autoscaling(self.autoscaling)
        # Build both engine configs now so that bad settings fail here, not in an actor.
        self.engine_config("prefill")
        self.engine_config("decode")
        self._check_tensor_parallel()

    def _check_tensor_parallel(self) -> None:
        """Above one rank: KV moves between the pools over nixl only (each rank reads its share
        of a block in place, ``kv_transfer.sharded``), and on GPUs one GPU a rank."""
        roles = ["decode"] if self.colocated else ["prefill", "decode"]
        sharded = [r for r in roles if self.tensor_parallel_size(r) > 1]
        if sharded and not self.colocated and self.transfer.backend != "nixl":
            sizes = ", ".join(f"{r} {self.tensor_parallel_size(r)}" for r in roles)
            raise ValueError(
                f"tensor_parallel_size {sizes} with a prefill pool needs transfer.backend nixl, got "
                f"{self.transfer.backend!r}: only nixl reads each rank's share of a block's KV heads in place")
        for role in sharded:
            gpus = self.resources(role).num_gpus
            if gpus not in (0, 1):
                raise ValueError(f"{role}_resources.num_gpus is {gpus}: at tensor_parallel_size "
                                 f"{self.tensor_parallel_size(role)} each rank takes one bundle of the "
                                 f"worker's resources, so 0 or 1 GPU a rank")

    def resources(self, role: str) -> Resources:
        """What each worker of ``role`` (``prefill``, ``decode`` or ``colocated``) asks for."""
        return self.prefill_resources if role == "prefill" else self.decode_resources

    def tensor_parallel_size(self, role: str) -> int:
        """The ranks each worker of ``role`` is split over (its engine's ``tensor_parallel_size``)."""
        return self.engine_config(role).tensor_parallel_size

    def worker_bundles(self, role: str) -> list[dict[str, float]]:
        """The placement-group bundles of one worker of ``role``: its own, then one per other
        rank (all on one node: ``STRICT_PACK`` above one rank)."""
        resources = self.resources(role)
        return [resources.bundle()] + [resources.rank_bundle()] * (self.tensor_parallel_size(role) - 1)

    def _check_autoscaling(self, a: AutoscalingConfig) -> None:
        pools = [("decode", self.decode_workers)] + ([] if self.colocated else [("prefill", self.prefill_workers)])
        for role, n in pools:
            bounds = a.bounds(role)
            if not bounds.min_workers <= n <= bounds.max_workers:
                raise ValueError(f"{role}_workers ({n}) must be within autoscaling.{role} "
                                 f"[{bounds.min_workers}, {bounds.max_workers}]: it is where the pool starts")
        if a.allow_role_switch and (why := self.role_switch_problem()) is not None:
            raise ValueError(f"autoscaling.allow_role_switch: {why}")

    def role_switch_problem(self) -> str | None:
        """Why a worker cannot switch between prefill and decode in place, or None: it
        keeps its bundle, model and KV cache, so both roles must ask the same resources and
        differ in engine settings only where an engine reset can (``EngineConfig.RESETTABLE``)."""
        if self.colocated:
            return "a colocated deployment has one role"
        if self.prefill_resources != self.decode_resources:
            return (f"prefill_resources {self.prefill_resources} and decode_resources {self.decode_resources} "
                    f"differ: a switched worker keeps its bundle")
        if fixed := self.engine_config("prefill").fixed_differences(self.engine_config("decode")):
            return (f"the prefill and decode engines differ in {', '.join(fixed)}, which a worker cannot change "
                    f"without reloading its model or KV cache; set them in `engine`, for both roles")
        return None

    @property
    def colocated(self) -> bool:
        return self.prefill_workers == 0

    def engine_config(self, role: str) -> EngineConfig:
        extra = self.prefill_engine if role == "prefill" else self.decode_engine
        try:
            return EngineConfig(model=self.model, **{**self.engine, **extra})
        except TypeError as e:
            raise ValueError(f"unknown engine setting in {role} config: {e}") from e

    def dispatch_settings(self) -> dict:
        """The ``router.dispatch.DispatchConfig`` fields the deployment sets: the decode
        engine's block size, running cap and prefix-hash settings, the re-run bounds and the
        token channel's settings."""
        engine = self.engine_config("decode")
        return {
            "block_size": engine.block_size,
            "max_running_per_decode": engine.max_num_seqs,
            "max_retries": self.max_retries,
            "max_migrations": self.max_migrations,
            "prefix_hash_algo": engine.prefix_hash_algo,
            "prefix_hash_seed": engine.prefix_hash_seed,
            "channel": self.channel,
        }

    @classmethod
    def from_dict(cls, d: dict) -> ClusterConfig:
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown topology settings: {sorted(unknown)}")
        for key in ("prefill_resources", "decode_resources"):
            if isinstance(d.get(key), dict):
                d[key] = Resources(**d[key])
        if isinstance(d.get("channel"), dict):
            d["channel"] = ChannelConfig.from_dict(d["channel"])
        if isinstance(d.get("transfer"), dict):
            d["transfer"] = TransferConfig.from_dict(d["transfer"])
        if isinstance(d.get("autoscaling"), dict):
            d["autoscaling"] = AutoscalingConfig.from_dict(d["autoscaling"])
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> ClusterConfig:
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a topology file must be a mapping")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_dict(data)

    def replace(self, **changes) -> ClusterConfig:
        return dataclasses.replace(self, **changes)
