"""One step's flattened batch as plain integers, and the interface of the attention
backends that turn it into their kernels' metadata (``engine/model/attention.py``,
``engine/model/cpu_attention.py``, ``engine/model/triton_attention.py``). Every backend imports
this module and none imports another's."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")


@dataclass
class ChunkLayout:
    """A prefill chunk: ``num_tokens`` rows from ``row0``, its request's tokens from ``start``."""

    row0: int
    num_tokens: int
    start: int
    block_ids: list[int]


@dataclass
class StepLayout:
    """One step's flattened batch as plain integers, whatever the backend.

    Decode rows come first, one per request, sorted by context length; the prefill
    chunks follow. ``decode_context_lens`` count the new token. ``decode_block_table`` is
    the decode rows' block tables as one rectangle ([decodes, blocks of the longest
    context] int64): each row cut to that width or padded with block 0, which a kernel
    masks by context length. The model runner gathers it from the rows it keeps
    (``engine.model.runner_input.BlockTables``); a layout made by hand takes ``decode_table``'s.
    """

    slots: list[int]
    decode_context_lens: list[int]
    chunks: list[ChunkLayout]
    decode_block_table: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))

    @classmethod
    def on_blocks(cls, decode_lens: list[int], chunks: list[tuple[int, int]], block_size: int,
                  free: list[int]) -> StepLayout:
        """A step laid out by hand (tests, kernel benchmarks): decode rows of ``decode_lens``
        tokens in the order given, then prefill chunks of ``(start, num_tokens)``, each
        request on blocks taken from the end of ``free``."""
        layout = cls(slots=[], decode_context_lens=[], chunks=[])
        tables = []
        for ctx in decode_lens:
            table = [free.pop() for _ in range(-(-ctx // block_size))]
            tables.append(table)
            layout.decode_context_lens.append(ctx)
            layout.slots.append(table[(ctx - 1) // block_size] * block_size + (ctx - 1) % block_size)
        layout.decode_block_table = decode_table(tables, layout.decode_context_lens, block_size)
        row = len(decode_lens)
        for start, n in chunks:
            table = [free.pop() for _ in range(-(-(start + n) // block_size))]
            layout.chunks.append(ChunkLayout(row, n, start, table))
            layout.slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
            row += n
        return layout


def padded_rows(tables: list[list[int]], context_lens: list[int], block_size: int) -> list[list[int]]:
    """The rows of a rectangular block-table tensor: each table cut to the blocks of the
    longest context and padded with block 0 (which a kernel masks by context length)."""
    width = max((-(-n // block_size) for n in context_lens), default=0)
    return [t[:width] + [0] * (width - len(t[:width])) for t in tables]


def decode_table(tables: list[list[int]], context_lens: list[int], block_size: int) -> np.ndarray:
    """``padded_rows`` as the int64 array a ``StepLayout``'s ``decode_block_table`` is."""
    rows = padded_rows(tables, context_lens, block_size)
    return np.array(rows, dtype=np.int64).reshape(len(rows), len(rows[0]) if rows else 0)


class AttentionBackend(ABC):
    """Builds a step's metadata once, then runs attention on it for every layer.

    ``forward`` is the one call a layer makes; a backend supplies how new K/V enter the
    cache (``write_kv``) and the attention itself (``attend``).
    """

    name: str

    @abstractmethod
    def build_metadata(self, layout: StepLayout) -> Any: ...

    def forward(self, q, k, v, k_cache, v_cache, meta, scale: float, window: int = 0):
        """q: [T, Hq, D], k/v: [T, Hkv, D] (this step's), caches: one layer. Writes k/v into
        the caches at the step's slots, then returns the attention output [T, Hq, D].
        ``window``: each query attends to its ``window`` latest keys, itself included
        (0: to every earlier key), as transformers' sliding-window layers do."""
        self.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = q.new_empty(q.shape)
        self.attend(q, k, v, k_cache, v_cache, meta, scale, out, window)
        return out

    @abstractmethod
    def write_kv(self, k_cache, v_cache, k, v, slots) -> None:
        """Scatter the step's new K/V rows ([T, Hkv, D]) into one layer's cache by slot."""

    @abstractmethod
    def attend(self, q, k, v, k_cache, v_cache, meta, scale: float, out, window: int = 0) -> None:
        """Attention of every row of ``q`` into ``out``; the cache already holds this step's K/V."""
