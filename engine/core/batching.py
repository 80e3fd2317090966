"""The scheduler's admission policies: when waiting requests may join the running batch.

``SchedulerConfig.batching`` (``engine.core.scheduler_plan``) names one of
``BATCHING_MODES``; ``engine.core.scheduler.Scheduler`` takes its policy from
``ADMISSION_POLICIES`` and asks it once a step, before its waiting pass:

- ``ContinuousBatching``: whenever a step has budget left and the pool has blocks;
- ``StaticBatching`` (``batching="static"``, a baseline for benchmarks): only when
  nothing runs; then as many as fit (``max_num_seqs``, KV blocks for their whole
  prompts) form a batch, whose prompts are computed over as many steps as the budget
  needs, and the batch runs to its end before the next one forms.

Pure Python, no state: a policy is a rule, shared by every scheduler that names it.
"""

from __future__ import annotations

BATCHING_MODES = ("continuous", "static")


class ContinuousBatching:
    """Waiting requests join whenever the step has budget left and the pool has blocks,
    each with blocks for the tokens it computes now."""

    forms_whole_batch = False

    def admits(self, num_running: int, num_swapped: int) -> bool:
        return True


class StaticBatching:
    """Waiting requests join only when nothing runs or is swapped out; then every one
    that fits joins at once, with blocks for its whole prompt, whatever this step's
    budget (their prompts are computed over the next steps)."""

    forms_whole_batch = True

    def admits(self, num_running: int, num_swapped: int) -> bool:
        return num_running == 0 and num_swapped == 0


ADMISSION_POLICIES: dict[str, ContinuousBatching | StaticBatching] = {
    "continuous": ContinuousBatching(), "static": StaticBatching(),
}
