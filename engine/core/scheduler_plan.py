"""The scheduler's plain data: its config (``SchedulerConfig``) and one step's plan
(``SchedulerOutput``, one ``ScheduledRequest`` per request in the step).

``LLMEngine`` builds the config once from its ``EngineConfig`` (``check_modes`` checks the
modes there too); ``engine.core.scheduler.Scheduler`` makes a plan each step, the model
runner executes it (``engine.model.runner_input``), and ``Scheduler.update`` takes it back
with the sampled ids. The simulator reads a plan as a ``StepShape``
(``engine.core.step_shape``). Pure Python, no torch; ``engine.core.scheduler`` re-exports
every name here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.batching import BATCHING_MODES
from engine.core.request import Request
from engine.core.request_queues import POLICIES

PREEMPTION_MODES = ("recompute", "swap", "auto")


def check_modes(preemption_mode: str, policy: str, batching: str) -> None:
    """A ValueError naming the first of the scheduler's modes that is not one it has."""
    for name, value, allowed in (("preemption_mode", preemption_mode, PREEMPTION_MODES),
                                 ("policy", policy, POLICIES), ("batching", batching, BATCHING_MODES)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits and modes: the step's token budget, requests at once, context length,
    chunking, preemption, queue policy and batching. ``LLMEngine`` builds it once from its
    ``EngineConfig``; checked on creation."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "auto"
    policy: str = "fcfs"
    batching: str = "continuous"
    # LoRA adapters the running requests may use at once (the model's resident slots); 0: no cap.
    max_loras: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_modes(self.preemption_mode, self.policy, self.batching)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute ``token_ids`` at positions from ``start_pos``."""

    request: Request  # read-only for the runner: sampling params and seed, token history
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool  # the step reaches the end of the known tokens: sample the next one


@dataclass
class SchedulerOutput:
    """One step's plan, as plain data: each request's tokens and blocks, the blocks to swap out and
    in, and the requests preempted or finished while planning. The model runner executes it;
    ``update`` takes it back with the sampled ids."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    # Copied before the forward: every swap_out pair, then every swap_in pair.
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu): swap-outs, then spills
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device): swap-ins, then restores
    preempted: list[str] = field(default_factory=list)
    # Finished while planning (grew past what the whole pool holds): not in ``scheduled``.
    finished: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.swap_out and not self.swap_in
