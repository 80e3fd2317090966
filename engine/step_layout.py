"""One step's flattened batch as plain integers: what the model runner hands an
attention backend, whichever it is (``engine/attention.py``,
``engine/triton_attention.py``)."""

from __future__ import annotations

from dataclasses import dataclass


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
    chunks follow. ``decode_context_lens`` count the new token.
    """

    slots: list[int]
    decode_block_ids: list[list[int]]
    decode_context_lens: list[int]
    chunks: list[ChunkLayout]
