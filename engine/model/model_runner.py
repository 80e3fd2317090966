"""Runs one scheduler step on the model: with its attention backend, the only place where
tensors are built.

Input: a plain-data ``RunnerInput`` (``engine.model.runner_input``): requests new to the runner
whole, the others as deltas. Output: a plain-data ``RunnerOutput`` with the sampled ids
(and logprobs) of the requests whose step reached the end of their known tokens. The
runner keeps its own copy of each request it runs (``RunnerRequests``: tokens, sampling
params, block table), which every input's deltas bring up to date; it never sees the
scheduler's objects.

The step is one flattened batch: swaps are copied first, then decode tokens (one per
request) and prefill chunks go through a single forward, and only the rows that
sample are projected to logits. The runner lays the batch out as plain integers; the
attention backend it was given turns that layout into its own metadata tensors.
Rows of requests with a structured-output constraint get their grammar's token
bitmask, which the sampler applies before anything else.

A step that samples nothing (a prefill chunk short of its prompt's end) returns before
the device has run it. ``step_done`` is an event recorded after its forward: whoever
hands the KV it writes to another process waits on it first (on a CPU, where torch
has finished when it returns, it is a no-op).

A request that asks for its prompt's logprobs (``prompt_logprobs``) also has its
prefill rows that predict a prompt token projected, chunk by chunk, until it has
sampled its first token; no other request pays for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.model.attention import StepAttention
from engine.model.cuda_graphs import DecodeGraphs, PiecewiseGraphs
from engine.model.kv_cache import KVCache
from engine.model.lora import LoRASlots
from engine.model.model import DecoderModel
from engine.model.runner_input import RunnerInput, RunnerRequest, RunnerRequests, StepItem
from engine.model.sampler import SampleRow, TokenLogprobs, prompt_logprobs, sample
from engine.model.step_layout import AttentionBackend, ChunkLayout, StepLayout


class TokenMasks(Protocol):
    """Where a step's grammar masks come from (``engine.structured_output.StructuredOutputs``)."""

    def bitmask(
        self, request_ids: Sequence[str], outputs: Sequence[Sequence[int]],
    ) -> tuple[torch.Tensor, list[int]] | None: ...


@dataclass
class RunnerOutput:
    """One step's results by request id: the token each sampling request drew (and its logprobs,
    when asked) and the prompt logprobs scored this step. The engine hands ``sampled`` to the
    scheduler and turns the rest into outputs."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # request id -> (prompt index of the first entry, the logprobs of that prompt token on)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


@dataclass(frozen=True)
class PromptRows:
    """A chunk's rows that predict prompt tokens: rows ``row0..row0+count`` predict the
    prompt tokens from index ``first`` on."""

    request: RunnerRequest
    row0: int
    first: int
    count: int

class _Finished:
    """A device event that has already happened: the CPU's (torch runs synchronously there)."""

    def synchronize(self) -> None:
        pass


FINISHED = _Finished()


def _device_event(device: torch.device):
    """A maker of events recorded on ``device``'s current stream (CUDA), or FINISHED."""
    if device.type != "cuda":
        return lambda: FINISHED

    def record():
        event = torch.cuda.Event()
        event.record()
        return event

    return record


# Prompt rows projected to logits at a time: bounds the [rows, vocab] tensors of a long chunk.
PROMPT_LOGPROBS_ROWS = 512


class ModelRunner:
    """Executes each ``RunnerInput`` on the model over the engine's ``KVCache``: brings its copies
    of the requests up to date, builds the step's tensors, runs one forward and samples.
    ``LLMEngine`` builds one with the model, cache and attention backend."""

    def __init__(
        self,
        model: DecoderModel,
        kv_cache: KVCache,
        attention: AttentionBackend,
        structured: TokenMasks | None = None,
        graphs: Sequence[DecodeGraphs | PiecewiseGraphs] = (),
        lora: LoRASlots | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = kv_cache.k.device
        self.attention = attention
        self.structured = structured  # the engine's grammar matchers
        self.make_event = _device_event(self.device)
        self.step_done = FINISHED  # the last step's forward, on the device
        self.requests = RunnerRequests()
        self.graphs = list(graphs)  # steps replayed as CUDA graphs (engine.model.cuda_graphs): the first that fits
        self.lora = lora  # the resident LoRA adapters, when the engine serves any

    @torch.inference_mode()
    def execute(self, step: RunnerInput) -> RunnerOutput:
        items = self.requests.apply(step)
        self.kv_cache.swap_out(step.swap_out)
        self.kv_cache.swap_in(step.swap_in)
        if not items:
            return RunnerOutput()
        # Decodes first, shortest context first (groups of similar length pad little).
        items.sort(key=lambda s: (s[2] > 1, s[1] if s[2] == 1 else 0))
        token_ids, positions, layout, sample_rows, prompt_rows = self._prepare(items)
        # The sampled rows' index is copied before the forward is queued: a pageable copy
        # made after it would hold the host until the whole forward had run.
        rows_idx = self._to_device([row for row, _ in sample_rows])
        hidden = None
        if self.lora is not None:  # each row's adapter; a step with any runs eagerly (no graph holds them)
            self.lora.begin_step([r.adapter for r, _, n in items for _ in range(n)])
        with_adapters = self.lora is not None and self.lora.step.active
        graphs = None if with_adapters else next((g for g in self.graphs if g.fits(layout)), None)
        if graphs is not None:
            hidden = graphs.run(token_ids, positions, layout)  # None if its capture failed
        if hidden is None:
            attn = StepAttention(self.attention, self.attention.build_metadata(layout))
            hidden = self.model(
                self._to_device(token_ids), self._to_device(positions), self.kv_cache.k, self.kv_cache.v, attn
            )
        self.step_done = self.make_event()
        out = RunnerOutput()
        if prompt_rows:
            out.prompt_logprobs = self._prompt_logprobs(hidden, prompt_rows)
        if not sample_rows:
            return out
        reqs = [req for _, req in sample_rows]
        logits = self.model.logits(hidden[rows_idx])
        mask = None
        if self.structured is not None:
            mask = self.structured.bitmask([r.request_id for r in reqs], [r.output_token_ids for r in reqs])
        ids, logprobs = sample(logits, [r.sample_row or _sample_row(r) for r in reqs], mask)
        for r, tok, lp in zip(reqs, ids, logprobs):
            out.sampled[r.request_id] = tok
            if lp is not None:
                out.logprobs[r.request_id] = lp
        return out

    def _prepare(self, items: list[StepItem]):
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        layout = StepLayout(slots=[], decode_context_lens=[], chunks=[])
        decode_rows: list[int] = []
        sample_rows = []
        prompt_rows: list[PromptRows] = []
        for request, start, n in items:
            row0 = len(token_ids)
            table = request.block_ids
            prompt, output = request.prompt_token_ids, request.output_token_ids
            if n == 1:
                token_ids.append(prompt[start] if start < len(prompt) else output[start - len(prompt)])
                positions.append(start)
                layout.slots.append(table[start // bs] * bs + start % bs)
                decode_rows.append(request.row)
                layout.decode_context_lens.append(start + 1)
            else:
                token_ids.extend(request.token_slice(start, start + n))
                pos = range(start, start + n)
                positions.extend(pos)
                layout.slots.extend(table[p // bs] * bs + p % bs for p in pos)
                layout.chunks.append(ChunkLayout(row0, n, start, table))
            if start + n == len(prompt) + len(output):  # the step reaches the end of its tokens
                sample_rows.append((row0 + n - 1, request))
            if request.sampling_params.prompt_logprobs is not None:
                rows = _prompt_rows(request, row0, start, n)
                if rows is not None:
                    prompt_rows.append(rows)
        if decode_rows:  # sorted by context: the last is the longest
            width = -(-layout.decode_context_lens[-1] // bs)
            layout.decode_block_table = self.requests.tables.gather(decode_rows, width)
        return token_ids, positions, layout, sample_rows, prompt_rows

    def _prompt_logprobs(
        self, hidden: torch.Tensor, prompt_rows: list[PromptRows]
    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """Each chunk's prompt rows projected and scored against the prompt tokens they
        predict, a bounded number of rows at a time."""
        rows: list[int] = []
        targets: list[int] = []
        num_top: list[int] = []
        for pr in prompt_rows:
            prompt = pr.request.prompt_token_ids
            rows.extend(range(pr.row0, pr.row0 + pr.count))
            targets.extend(prompt[pr.first : pr.first + pr.count])
            num_top.extend([pr.request.sampling_params.prompt_logprobs] * pr.count)
        scored: list[TokenLogprobs] = []
        for i in range(0, len(rows), PROMPT_LOGPROBS_ROWS):
            part = slice(i, i + PROMPT_LOGPROBS_ROWS)
            logits = self.model.logits(hidden[self._to_device(rows[part])])
            scored += prompt_logprobs(logits, targets[part], num_top[part])
        out, i = {}, 0
        for pr in prompt_rows:
            out[pr.request.request_id] = (pr.first, scored[i : i + pr.count])
            i += pr.count
        return out

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """int64 on the runner's device; on CUDA through pinned memory, without blocking."""
        host = torch.tensor(values, dtype=torch.long)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)


def _sample_row(request: RunnerRequest) -> SampleRow:
    """The sampler's view of a request, made once: it reads the request's own token lists."""
    request.sample_row = SampleRow(
        request.sampling_params, request.sampling_seed, request.prompt_token_ids, request.output_token_ids
    )
    return request.sample_row


def _prompt_rows(request: RunnerRequest, row0: int, start: int, n: int) -> PromptRows | None:
    """The rows of a chunk (positions ``start..start+n`` at rows from ``row0``) that predict
    a prompt token, while the request has sampled nothing yet (after that its prompt's
    logprobs were delivered; a recompute preemption before it computes the same again)."""
    if request.output_token_ids:
        return None
    count = min(start + n, request.num_prompt_tokens - 1) - start
    return PromptRows(request, row0, start + 1, count) if count > 0 else None
