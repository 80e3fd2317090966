"""Runs one scheduler step on the model: the only place where tensors are built.

Input: a plain-data ``SchedulerOutput``. Output: a plain-data ``RunnerOutput`` with
the sampled ids (and logprobs) of the requests whose step reached the end of their
known tokens. The runner keeps no request state between steps.

The step is one flattened batch: swaps are copied first, then decode tokens (one per
request) and prefill chunks go through a single forward, and only the rows that
sample are projected to logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention import AttentionMetadata, DecodeGroup, GatherWorkspace, PrefillChunk
from engine.kv_cache import KVCache
from engine.model import DecoderModel
from engine.sampler import SampleRow, TokenLogprobs, sample
from engine.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: DecoderModel, kv_cache: KVCache, seeds: dict[str, int]) -> None:
        self.model = model
        self.kv = kv_cache
        self.block_size = kv_cache.block_size
        self.device = kv_cache.k.device
        # Per-request sampling seeds, owned by the engine (they outlive preemption).
        self._seeds = seeds
        self._workspace = GatherWorkspace()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.kv.swap_out(sched.swap_out)
        self.kv.swap_in(sched.swap_in)
        if not sched.scheduled:
            return RunnerOutput()
        # Decodes first, shortest context first (groups of similar length pad little).
        items = sorted(
            sched.scheduled, key=lambda s: (len(s.token_ids) > 1, s.start_pos if len(s.token_ids) == 1 else 0)
        )
        input_ids, positions, meta, sample_rows = self._prepare(items)
        hidden = self.model(input_ids, positions, self.kv.k, self.kv.v, meta)
        if not sample_rows:
            return RunnerOutput()
        rows_idx, reqs = zip(*sample_rows)
        logits = self.model.logits(hidden[torch.tensor(rows_idx, device=self.device)])
        ids, logprobs = sample(
            logits,
            [
                SampleRow(
                    r.sampling_params,
                    self._seeds.get(r.request_id, 0),
                    r.prompt_token_ids,
                    r.output_token_ids,
                )
                for r in reqs
            ],
        )
        out = RunnerOutput()
        for r, tok, lp in zip(reqs, ids, logprobs):
            out.sampled[r.request_id] = tok
            if lp is not None:
                out.logprobs[r.request_id] = lp
        return out

    def _prepare(self, items: list[ScheduledRequest]):
        bs = self.block_size
        dev = self.device
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for item in items:
            n = len(item.token_ids)
            row0 = len(token_ids)
            start = item.start_pos
            table = item.block_ids
            token_ids.extend(item.token_ids)
            if n == 1:
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                decode_tables.append(table)
                decode_lens.append(start + 1)
            else:
                pos = range(start, start + n)
                positions.extend(pos)
                slots.extend(table[p // bs] * bs + p % bs for p in pos)
                prefills.append(self._chunk(row0, n, start, table))
            if item.sample:
                sample_rows.append((row0 + n - 1, item.request))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            decodes=self._decode_groups(decode_tables, decode_lens),
            prefills=prefills,
            workspace=self._workspace,
        )
        return (
            torch.tensor(token_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
            sample_rows,
        )

    def _decode_groups(self, tables: list[list[int]], lens: list[int]) -> list[DecodeGroup]:
        """Split decode rows (sorted by length) where padding would pass ~1.5x the data."""
        bs = self.block_size
        groups, start = [], 0
        for i in range(1, len(lens) + 1):
            if i < len(lens) and lens[i] <= 1.5 * lens[start] + 4 * bs:
                continue
            width = -(-lens[i - 1] // bs)
            rows = [t[:width] + [0] * (width - len(t[:width])) for t in tables[start:i]]
            lengths = torch.tensor(lens[start:i], device=self.device)
            keys = torch.arange(width * bs, device=self.device)
            groups.append(
                DecodeGroup(
                    q_start=start,
                    q_end=i,
                    block_tables=torch.tensor(rows, dtype=torch.long, device=self.device),
                    mask=(keys.unsqueeze(0) < lengths.unsqueeze(1))[:, None, None, :],
                )
            )
            start = i
        return groups

    def _chunk(self, row0: int, n: int, start: int, table: list[int]) -> PrefillChunk:
        ctx = start + n
        nb = -(-ctx // self.block_size)
        block_table = torch.tensor(table[:nb], dtype=torch.long, device=self.device)
        mask = None
        if start > 0:
            q_pos = torch.arange(start, ctx, device=self.device).unsqueeze(1)
            k_pos = torch.arange(ctx, device=self.device).unsqueeze(0)
            mask = k_pos <= q_pos
        return PrefillChunk(row0, row0 + n, start, block_table, mask)
