"""CUDA graphs of the decode forward: a step that only decodes replays a graph captured
once per batch-size bucket, instead of launching every layer's kernels from Python.

Measured on an H200 (docs/BENCHMARKS.md, "GPU"): an eager step of a 24-layer 0.35B model
takes 14-23 ms whatever its work, about 0.6 ms of kernel launches a layer (some 35 of
them: norms, rotary, projections, attention), where its kernels need well under a
millisecond. A graph replays the same launches from the device. vLLM and SGLang capture
decode steps the same way.

What a graph holds fixed, and how a step is made to fit it:

- the batch: a step's decodes run as the next bucket up (1, 2, 4, 8, ... up to
  ``max_num_seqs``); each pad row writes its K/V into the null block's first slot,
  attends over that one key, and its output is dropped;
- the block tables: ``context // block_size`` columns, ``context`` the model's length
  capped at ``GRAPH_CONTEXT``; a step whose longest context is longer runs eagerly;
- the split-K grid: every partition of ``context`` (the decode kernel skips a row's
  partitions past its own context, and the reduce reads only the row's).

Steps with prefill chunks run eagerly, and so does a model with mixture-of-experts
layers: its routing sizes the expert GEMMs on the host. Sampling runs after the replay,
as after an eager forward. A graph is captured the first time its bucket is needed (a
warm-up forward first, so that Triton compiles outside the capture), on its own memory
pool: a decode step's activations are a few MiB.

A capture that fails (out of memory, say, beside a KV cache sized to fill the device)
is logged once, and from then on every step runs eagerly.

``capture=False`` runs the same padded, static-buffer forward without a graph (the
tests check the padding and the buffers on a CPU with Triton's interpreter that way; a
GPU test checks the graphs themselves).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention import StepAttention
from engine.block_pool import NULL_BLOCK_ID
from engine.kv_cache import KVCache
from engine.model import DecoderModel
from engine.step_layout import AttentionBackend, StepLayout

logger = logging.getLogger(__name__)

GRAPH_CONTEXT = 8192  # the longest context a graph's block tables and split-K grid cover


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes graphs are captured for: powers of two below ``max_batch``, then it."""
    buckets = [1]
    while buckets[-1] * 2 < max_batch:
        buckets.append(buckets[-1] * 2)
    if buckets[-1] < max_batch:
        buckets.append(max_batch)
    return buckets


@dataclass
class _Captured:
    """One bucket's graph (None without capture), its output rows and the metadata it reads."""

    graph: torch.cuda.CUDAGraph | None
    hidden: torch.Tensor
    meta: object


class DecodeGraphs:
    """The decode forward of ``model`` on static input buffers, replayed as one CUDA graph
    per batch bucket (module docstring). ``ModelRunner`` asks ``fits`` for each pure-decode
    step, then ``run``s it."""

    def __init__(
        self,
        model: DecoderModel,
        kv_cache: KVCache,
        attention: AttentionBackend,
        max_batch: int,
        max_context: int,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.capture = capture
        self.context = min(max_context, GRAPH_CONTEXT)
        self.buckets = batch_buckets(max_batch)
        rows, dev = self.buckets[-1], kv_cache.k.device
        width = -(-self.context // kv_cache.block_size)
        # What every graph reads: a step's inputs are copied in before its replay; rows past
        # its decodes hold the pad values (slot 0 of the null block, a context of one key).
        self.input_ids = torch.empty(rows, dtype=torch.long, device=dev)
        self.positions = torch.empty(rows, dtype=torch.long, device=dev)
        self.slots = torch.empty(rows, dtype=torch.long, device=dev)
        self.context_lens = torch.empty(rows, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((rows, width), dtype=torch.int32, device=dev)
        self._pad(0, rows)
        self._captured: dict[int, _Captured] = {}
        self._filled = 0  # rows holding a step's values (the rest hold the pad values)
        self.failed: str | None = None  # why a capture failed, after which nothing replays

    @property
    def captured(self) -> list[int]:
        """The buckets captured so far."""
        return sorted(self._captured)

    def fits(self, layout: StepLayout) -> bool:
        """Whether a step of ``layout`` can replay a graph: decodes only, within the buckets
        and the graphs' context, and no capture has failed."""
        lens = layout.decode_context_lens
        return (bool(lens) and not layout.chunks and len(lens) <= self.buckets[-1] and max(lens) <= self.context
                and self.failed is None)  # fmt: skip

    def run(self, token_ids: Sequence[int], positions: Sequence[int], layout: StepLayout) -> torch.Tensor | None:
        """The hidden states ([decodes, hidden]) of a step that ``fits``; None when its
        bucket's graph could not be captured (then every later step runs eagerly too)."""
        n = len(token_ids)
        bucket = next(b for b in self.buckets if b >= n)
        self._fill(token_ids, positions, layout)
        captured = self._captured.get(bucket)
        if captured is None:
            try:
                captured = self._capture(bucket)
            except (torch.OutOfMemoryError, RuntimeError) as e:  # e.g. the KV cache left too little memory
                self.failed = f"capturing the decode graph of {bucket} rows failed: {e}"
                logger.warning("%s; decode steps run eagerly from now on", self.failed)
                return None
        if captured.graph is not None:
            captured.graph.replay()
            return captured.hidden[:n]
        return self._forward(bucket, captured.meta)[:n]

    def _fill(self, token_ids: Sequence[int], positions: Sequence[int], layout: StepLayout) -> None:
        n = len(token_ids)
        table = torch.from_numpy(layout.decode_block_table)
        for buffer, values in ((self.input_ids, token_ids), (self.positions, positions), (self.slots, layout.slots)):
            buffer[:n].copy_(torch.tensor(values, dtype=torch.long))
        self.context_lens[:n].copy_(torch.tensor(layout.decode_context_lens, dtype=torch.int32))
        self.block_tables[:n, : table.shape[1]].copy_(table)
        if self._filled > n:  # rows a larger step left: pad rows again
            self._pad(n, self._filled)
        self._filled = n

    def _pad(self, start: int, stop: int) -> None:
        """Rows ``start:stop`` as pad rows: token 0 at position 0, written to the null block's
        first slot, attending over that one key (the only table entry a pad row reads)."""
        self.input_ids[start:stop] = 0
        self.positions[start:stop] = 0
        self.slots[start:stop] = NULL_BLOCK_ID * self.kv_cache.block_size
        self.context_lens[start:stop] = 1
        self.block_tables[start:stop, 0] = NULL_BLOCK_ID

    def _metadata(self, bucket: int):
        """The attention metadata of a ``bucket``-row decode step over the static buffers."""
        from engine.triton_attention import TritonMetadata

        dev = self.input_ids.device
        return TritonMetadata(
            slot_mapping=self.slots[:bucket],
            num_decodes=bucket,
            decode_block_tables=self.block_tables[:bucket],
            decode_context_lens=self.context_lens[:bucket],
            max_decode_len=self.context,
            num_prefills=0,
            prefill_block_tables=torch.zeros(0, 0, dtype=torch.int32, device=dev),
            prefill_query_start=torch.zeros(1, dtype=torch.int32, device=dev),
            prefill_context_start=torch.zeros(0, dtype=torch.int32, device=dev),
            max_chunk_len=0,
        )

    def _forward(self, bucket: int, meta) -> torch.Tensor:
        attn = StepAttention(self.attention, meta)
        k, v = self.kv_cache.k, self.kv_cache.v
        return self.model(self.input_ids[:bucket], self.positions[:bucket], k, v, attn)

    def _capture(self, bucket: int) -> _Captured:
        if not self.capture:
            captured = _Captured(None, torch.empty(0), self._metadata(bucket))
        else:
            # A warm-up forward on a side stream compiles the kernels for these shapes (a
            # compile inside the capture would fail), as torch's graph docs advise.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(bucket, self._metadata(bucket))
            torch.cuda.current_stream().wait_stream(side)
            meta = self._metadata(bucket)  # its split-K buffers come from the graph's pool
            graph = torch.cuda.CUDAGraph()
            # thread_local: a worker's transfer threads may copy KV into the cache meanwhile.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                hidden = self._forward(bucket, meta)
            captured = _Captured(graph, hidden, meta)
        self._captured[bucket] = captured
        return captured


def decode_graphs_for(
    model: DecoderModel, kv_cache: KVCache, attention: AttentionBackend, max_batch: int, max_context: int,
    enabled: bool,
) -> DecodeGraphs | None:  # fmt: skip
    """The engine's ``DecodeGraphs`` when they apply: ``enabled``, a CUDA device, the triton
    backend and no mixture-of-experts layers (module docstring); else None."""
    if not enabled or kv_cache.k.device.type != "cuda" or getattr(attention, "name", "") != "triton":
        return None
    if model.config.moe is not None:
        return None
    return DecodeGraphs(model, kv_cache, attention, max_batch, max_context)

