"""The model runner's input as plain data: each step's plan, sent as deltas.

Pure (no torch; numpy for the runner's block tables): integers, lists and sampling
params only, no live object of the scheduler's, so the runner could live in another
process. As in vLLM V1's ``SchedulerOutput``, a request goes to the runner whole once
(``NewRequestData``: its tokens so far, sampling params and seed, block table) the first
step it is scheduled, and again only after a preemption; every later step that schedules
it sends what changed (``CachedRequests``: the tokens appended since, the blocks
appended, how many leading blocks a sliding window has given back, where the step starts
and how many tokens it computes). ``finished_ids`` tell the runner to drop its copy.

Two sides keep this: ``RunnerInputBuilder`` (beside the scheduler, in ``LLMEngine``)
remembers what the runner has been sent and turns each of the scheduler's plans into a
``RunnerInput``; ``RunnerRequests`` (in the ``ModelRunner``) is the runner's own copy of
each request, which the deltas keep equal to the scheduler's, with every block table also
a row of one array (``BlockTables``), so a step's decode block table is one gather of rows
rather than a conversion of every table.

A request's lifecycle between the two::

    first scheduled ─▶ new (sent whole) ─▶ cached (a delta each step it is scheduled)
        ├─ preempted (recompute or swap) ─▶ dropped ─▶ scheduled again ─▶ new ...
        └─ finished or aborted ─▶ dropped (its id in the next step's finished_ids)

A preempted request is sent whole again because its table changes whole (a recompute
frees every block, a swap in takes new ones); a sliding window's release is the one
change to a table that is not an append, and it only ever turns leading entries into
``NULL_BLOCK_ID``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from engine.core.block_pool import NULL_BLOCK_ID
from engine.core.scheduler import SchedulerOutput
from engine.wire.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.model.sampler import SampleRow  # a type only: this module loads no torch


@dataclass(slots=True)
class NewRequestData:
    """A request the runner does not hold: everything it needs, sent once."""

    request_id: str
    prompt_token_ids: list[int]  # never changes, so never copied
    output_token_ids: list[int]  # so far: a resumed, migrated or remotely prefilled request has some
    sampling_params: SamplingParams
    sampling_seed: int
    block_ids: list[int]
    num_computed_tokens: int  # where this step starts
    num_scheduled_tokens: int  # tokens this step computes
    adapter: str | None = None  # its LoRA adapter's key (engine.model.lora), None: the base model


@dataclass
class CachedRequests:
    """The requests the runner holds that this step schedules: what changed for each since the
    last step that scheduled it, as parallel lists (entry i of each list is one request's)."""

    request_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)  # appended (the one sampled last step)
    new_block_ids: list[list[int]] = field(default_factory=list)  # appended to its block table
    num_released_blocks: list[int] = field(default_factory=list)  # leading entries given back, in all
    num_computed_tokens: list[int] = field(default_factory=list)  # where this step starts
    num_scheduled_tokens: list[int] = field(default_factory=list)  # tokens this step computes

    def __len__(self) -> int:
        return len(self.request_ids)


@dataclass
class RunnerInput:
    """One step for the model runner: the requests it computes (new ones whole, the others as
    deltas), the requests to forget first, and the blocks to swap out, then in."""

    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: CachedRequests = field(default_factory=CachedRequests)
    finished_ids: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    num_batched_tokens: int = 0


def _num_released(table: list[int], start: int) -> int:
    """Leading entries of ``table`` given back, counting on from ``start`` known ones."""
    n = len(table)
    while start < n and table[start] == NULL_BLOCK_ID:
        start += 1
    return start


@dataclass(slots=True)
class _Sent:
    """What the runner holds of one request."""

    num_output: int
    num_blocks: int
    num_released: int


class RunnerInputBuilder:
    """Turns the scheduler's plans into ``RunnerInput`` deltas (the lifecycle is in the module
    docstring). ``LLMEngine`` makes one for its runner, builds every step's input with it and tells
    it of every request that ends (``forget``)."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}
        self._dropped: list[str] = []  # ended since the last step: the runner drops them next

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._sent

    def forget(self, request_id: str) -> None:
        """The request ended (finished, aborted): the next input tells the runner to drop it."""
        if self._sent.pop(request_id, None) is not None:
            self._dropped.append(request_id)

    def build(self, plan: SchedulerOutput) -> RunnerInput:
        """The runner's input for ``plan`` (taken right after ``Scheduler.schedule``)."""
        sent = self._sent
        finished, self._dropped = self._dropped, []
        for rid in plan.preempted:
            if sent.pop(rid, None) is not None:
                finished.append(rid)
        new: list[NewRequestData] = []
        cached = CachedRequests()
        # The loop runs for every request in every step: bound methods fetched once.
        ids, tokens, blocks = cached.request_ids.append, cached.new_token_ids.append, cached.new_block_ids.append
        released, starts = cached.num_released_blocks.append, cached.num_computed_tokens.append
        counts = cached.num_scheduled_tokens.append
        for item in plan.scheduled:
            request, table = item.request, item.block_ids
            rid, output = request.request_id, request.output_token_ids
            known = sent.get(rid)
            if known is None:
                sent[rid] = _Sent(len(output), len(table), _num_released(table, 0))
                new.append(NewRequestData(
                    rid, request.prompt_token_ids, output[:], request.sampling_params,
                    request.sampling_seed, table[:], item.start_pos, len(item.token_ids), request.adapter,
                ))
                continue
            ids(rid)
            tokens(output[known.num_output:])  # the prompt went whole: what comes later is output
            known.num_output = len(output)
            blocks(table[known.num_blocks:])
            known.num_blocks = len(table)
            if table[0] == NULL_BLOCK_ID:
                known.num_released = _num_released(table, known.num_released)
            released(known.num_released)
            starts(item.start_pos)
            counts(len(item.token_ids))
        return RunnerInput(new, cached, finished, plan.swap_out, plan.swap_in, plan.num_batched_tokens)


@dataclass(slots=True)
class RunnerRequest:
    """The runner's copy of one request: its tokens so far, sampling params and block table."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    sampling_seed: int
    block_ids: list[int]
    num_released: int = 0
    row: int = 0  # its block table's row in the runner's ``BlockTables``
    adapter: str | None = None  # its LoRA adapter, None: the base model
    # The sampler's view of it, made by the runner the first time it samples; it reads the
    # lists above, which the deltas extend in place.
    sample_row: SampleRow | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids in positions [start, end) of prompt + output (a prefill chunk's: seldom
        past the prompt, after a preemption)."""
        prompt = self.prompt_token_ids
        return prompt[start:end] if end <= len(prompt) else (prompt + self.output_token_ids)[start:end]


class BlockTables:
    """The runner's block tables as rows of one int64 array, as vLLM's ``BlockTable``: a request's
    row is written when the runner learns of it and as its deltas add or give back blocks, and
    zeroed when it leaves; past a table's end a row holds 0 (``NULL_BLOCK_ID``), the padding
    the attention backends mask. The array grows (doubling) in rows and columns as needed."""

    def __init__(self, rows: int = 16, columns: int = 64) -> None:
        self.array = np.zeros((rows, columns), dtype=np.int64)
        self._free = list(range(rows - 1, -1, -1))

    def add(self, block_ids: list[int]) -> int:
        """A row for a new table; returns its index."""
        if not self._free:
            rows = len(self.array)
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        row = self._free.pop()
        self.extend(row, 0, block_ids)
        return row

    def extend(self, row: int, start: int, block_ids: list[int]) -> None:
        """Write ``block_ids`` into ``row`` from column ``start``."""
        end = start + len(block_ids)
        if end > self.array.shape[1]:
            width = self.array.shape[1]
            while width < end:
                width *= 2
            grown = np.zeros((len(self.array), width), dtype=np.int64)
            grown[:, : self.array.shape[1]] = self.array
            self.array = grown
        self.array[row, start:end] = block_ids

    def release(self, row: int, start: int, end: int) -> None:
        """Columns ``start..end`` of ``row`` were given back (``NULL_BLOCK_ID``)."""
        self.array[row, start:end] = NULL_BLOCK_ID

    def drop(self, row: int, length: int) -> None:
        """The row's table (``length`` entries) is gone: zero it and free the row."""
        self.array[row, :length] = NULL_BLOCK_ID
        self._free.append(row)

    def gather(self, rows: list[int], width: int) -> np.ndarray:
        """The listed rows' first ``width`` columns, as a new [len(rows), width] array."""
        if width > self.array.shape[1]:  # columns no table reached: all padding
            out = np.zeros((len(rows), width), dtype=np.int64)
            out[:, : self.array.shape[1]] = self.array[rows]
            return out
        return self.array[rows, :width]


# One request's share of a step on the runner's side: (its copy, first position, tokens computed).
StepItem = tuple[RunnerRequest, int, int]


class RunnerRequests:
    """The model runner's copies of the requests it runs and their block tables, kept by each
    ``RunnerInput``'s deltas (the lifecycle is in the module docstring)."""

    def __init__(self) -> None:
        self.requests: dict[str, RunnerRequest] = {}
        self.tables = BlockTables()

    def __len__(self) -> int:
        return len(self.requests)

    def _drop(self, request_id: str) -> None:
        r = self.requests.pop(request_id, None)
        if r is not None:
            self.tables.drop(r.row, len(r.block_ids))

    def apply(self, step: RunnerInput) -> list[StepItem]:
        """Take in one step's deltas; returns what the step computes, new requests first."""
        requests, tables = self.requests, self.tables
        for rid in step.finished_ids:
            self._drop(rid)
        items: list[StepItem] = []
        for new in step.new_requests:
            self._drop(new.request_id)  # (never held: a preempted request was dropped first)
            r = requests[new.request_id] = RunnerRequest(
                new.request_id, new.prompt_token_ids, new.output_token_ids, new.sampling_params,
                new.sampling_seed, new.block_ids, _num_released(new.block_ids, 0), tables.add(new.block_ids),
                adapter=new.adapter,
            )
            items.append((r, new.num_computed_tokens, new.num_scheduled_tokens))
        c = step.cached_requests
        for rid, tokens, blocks, released, start, n in zip(
            c.request_ids, c.new_token_ids, c.new_block_ids, c.num_released_blocks, c.num_computed_tokens,
            c.num_scheduled_tokens,
        ):
            r = requests[rid]
            if tokens:
                r.output_token_ids += tokens
            if blocks:
                tables.extend(r.row, len(r.block_ids), blocks)
                r.block_ids += blocks
            if released > r.num_released:
                r.block_ids[r.num_released : released] = [NULL_BLOCK_ID] * (released - r.num_released)
                tables.release(r.row, r.num_released, released)
                r.num_released = released
            items.append((r, start, n))
        return items
