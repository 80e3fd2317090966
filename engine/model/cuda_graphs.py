"""CUDA graphs of the forward: a step that only decodes replays a graph captured once per
batch-size bucket, and a step with prefill chunks a graph per stretch between two
attentions, instead of launching every layer's kernels from Python.

Measured on an H200 (docs/BENCHMARKS.md, "GPU"): an eager step of a 24-layer 0.35B model
takes 14-23 ms whatever its work, about 0.6 ms of kernel launches a layer (some 35 of
them: norms, rotary, projections, attention), where its kernels need well under a
millisecond. A graph replays the same launches from the device. vLLM and SGLang capture
decode steps the same way.

What a decode graph holds fixed, and how a step is made to fit it:

- the batch: a step's decodes run as the next bucket up (1, 2, 4, 8, ... up to
  ``max_num_seqs``); each pad row writes its K/V into the null block's first slot,
  attends over that one key, and its output is dropped;
- the block tables: ``context // block_size`` columns, ``context`` the model's length
  capped at ``GRAPH_CONTEXT``; a step whose longest context is longer runs eagerly;
- the split-K grid: every partition of ``context`` (the decode kernel skips a row's
  partitions past its own context, and the reduce reads only the row's).

A model with mixture-of-experts layers runs eagerly: its routing sizes the expert GEMMs
on the host. Sampling runs after the replay, as after an eager forward. The engine
captures every bucket at start-up (a warm-up forward first, so that Triton compiles
outside the capture), each decode graph on its own memory pool: a decode step's
activations are a few MiB.

A capture that fails (out of memory, say, beside a KV cache sized to fill the device)
is logged once, and from then on the steps of its kind run eagerly (decode steps then
replay the piecewise graphs, if those were captured).

Steps with prefill chunks replay **piecewise** graphs (``PiecewiseGraphs``), as vLLM's
do: per token-count bucket, the forward is captured as one graph from the embedding to
the first layer's q/k/v, one from each layer's attention output to the next layer's
q/k/v, and one from the last attention output to the final norm; between two graphs the
step's attention (KV write, decode and prefill kernels) runs eagerly on its real rows
with its own metadata, whatever the mix of decodes and chunks. Some 35 launches a layer
become a replay and three. Pad rows (up to the bucket) compute alongside and are never
written to the cache nor attended.

``capture=False`` runs the same padded, static-buffer forward without a graph (the
tests check the padding and the buffers on a CPU with Triton's interpreter that way; a
GPU test checks the graphs themselves).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.core.block_pool import NULL_BLOCK_ID
from engine.model.attention import StepAttention
from engine.model.kv_cache import KVCache
from engine.model.model import DecoderModel
from engine.model.step_layout import AttentionBackend, StepLayout

logger = logging.getLogger(__name__)

GRAPH_CONTEXT = 8192  # the longest context a graph's block tables and split-K grid cover
PIECEWISE_TOKENS = 8192  # the most tokens a step replaying piecewise graphs may have


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes graphs are captured for: powers of two below ``max_batch``, then it."""
    buckets = [1]
    while buckets[-1] * 2 < max_batch:
        buckets.append(buckets[-1] * 2)
    if buckets[-1] < max_batch:
        buckets.append(max_batch)
    return buckets


class _BucketGraphs(ABC):
    """What both kinds of graphs keep: a capture per bucket, made on first need or by
    ``capture_all``, and why a capture failed (after which the steps run eagerly)."""

    buckets: list[int]
    what: str  # "the decode graph of {bucket} rows", say
    steps: str  # the steps that run eagerly once a capture has failed

    def __init__(self) -> None:
        self._captured: dict[int, object] = {}
        self.failed: str | None = None

    @property
    def captured(self) -> list[int]:
        """The buckets captured so far."""
        return sorted(self._captured)

    def capture_all(self) -> bool:
        """Capture every bucket now (the engine does, at start-up, so that no step waits on
        a capture); False if one failed."""
        return all(self._get(bucket) is not None for bucket in self.buckets)

    def _get(self, bucket: int):
        """The bucket's capture, made now if need be; None once a capture has failed."""
        if self.failed is not None:
            return None
        captured = self._captured.get(bucket)
        if captured is None:
            try:
                captured = self._captured[bucket] = self._capture(bucket)
            except (torch.OutOfMemoryError, RuntimeError) as e:  # e.g. the KV cache left too little memory
                self.failed = f"capturing {self.what.format(bucket=bucket)} failed: {e}"
                logger.warning("%s; %s run eagerly from now on", self.failed, self.steps)
        return captured

    @abstractmethod
    def _capture(self, bucket: int):
        """Capture ``bucket``'s graphs (on a CUDA device; without capture, what a replay reads)."""


@dataclass
class _Captured:
    """One bucket's graph (None without capture), its output rows and the metadata it reads."""

    graph: torch.cuda.CUDAGraph | None
    hidden: torch.Tensor
    meta: object


class DecodeGraphs(_BucketGraphs):
    """The decode forward of ``model`` on static input buffers, replayed as one CUDA graph
    per batch bucket (module docstring). ``ModelRunner`` asks ``fits`` for each pure-decode
    step, then ``run``s it."""

    what = "the decode graph of {bucket} rows"
    steps = "decode steps"

    def __init__(
        self,
        model: DecoderModel,
        kv_cache: KVCache,
        attention: AttentionBackend,
        max_batch: int,
        max_context: int,
        capture: bool = True,
    ) -> None:
        super().__init__()
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
        self._filled = 0  # rows holding a step's values (the rest hold the pad values)

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
        captured = self._get(bucket)
        if captured is None:
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
        from engine.model.triton_attention import TritonMetadata

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
            return _Captured(None, torch.empty(0), self._metadata(bucket))
        _warm_up(lambda: self._forward(bucket, self._metadata(bucket)))
        meta = self._metadata(bucket)  # its split-K buffers come from the graph's pool
        graph = torch.cuda.CUDAGraph()
        # thread_local: a worker's transfer threads may copy KV into the cache meanwhile.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            hidden = self._forward(bucket, meta)
        return _Captured(graph, hidden, meta)


def _warm_up(forward: Callable[[], object]) -> None:
    """Run ``forward`` once on a side stream before a capture: Triton compiles and cuBLAS
    picks its kernels for these shapes outside it (a compile inside would fail), as
    torch's graph docs advise."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)


def token_buckets(max_tokens: int) -> list[int]:
    """The step sizes piecewise graphs are captured for: powers of two from 16 to 512,
    then multiples of 512 (a prefill's padding stays under a quarter past 512 tokens),
    up to ``max_tokens``, which is always the last."""
    buckets = [16]
    while buckets[-1] < min(512, max_tokens):
        buckets.append(buckets[-1] * 2)
    while buckets[-1] < max_tokens:
        buckets.append(buckets[-1] + 512)
    return [b for b in buckets if b < max_tokens] + [max_tokens]


@dataclass
class _Piece:
    """One graph of a piecewise forward and the attention that follows its replay: the
    layer's index (-1 after the last graph), its scale and window."""

    graph: torch.cuda.CUDAGraph | None
    layer: int = -1
    scale: float = 0.0
    window: int = 0


class _Split:
    """The ``attn`` a piecewise forward is given: at each layer's attention it copies the
    layer's q/k/v into the static buffers and hands back the static output. Capturing, it
    ends the graph there and begins the next; without capture it attends on the spot,
    over the step's real rows (``PiecewiseGraphs.attend``)."""

    def __init__(self, owner: PiecewiseGraphs, rows: int, capture: bool, meta=None, num_tokens: int = 0) -> None:
        self.owner, self.rows, self.capture = owner, rows, capture
        self.meta, self.num_tokens = meta, num_tokens  # the step attended on the spot (no capture)
        self.pieces: list[_Piece] = []
        self.graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        if self.capture:
            self.graph = torch.cuda.CUDAGraph()
            self.graph.capture_begin(pool=self.owner.pool, capture_error_mode="thread_local")

    def end(self, layer: int = -1, scale: float = 0.0, window: int = 0) -> None:
        if self.graph is not None:
            self.graph.capture_end()
        self.pieces.append(_Piece(self.graph, layer, scale, window))

    def __call__(self, q, k, v, k_cache, v_cache, scale: float, window: int = 0) -> torch.Tensor:
        owner, rows = self.owner, self.rows
        owner.q[:rows].copy_(q)
        owner.k[:rows].copy_(k)
        owner.v[:rows].copy_(v)
        layer = len(self.pieces)
        if self.meta is not None:
            owner.attend(layer, self.num_tokens, self.meta, scale, window)
        self.end(layer, scale, window)
        self.begin()
        return owner.out[:rows]


class PiecewiseGraphs(_BucketGraphs):
    """The forward of steps with prefill chunks on static buffers, replayed per token
    bucket as one CUDA graph per stretch between two attentions, the attention run
    eagerly between them (module docstring). ``ModelRunner`` asks ``fits`` for each step
    that ``DecodeGraphs`` does not take, then ``run``s it."""

    what = "the piecewise graphs of {bucket} tokens"
    steps = "steps with prefill chunks"

    def __init__(
        self, model: DecoderModel, kv_cache: KVCache, attention: AttentionBackend, max_tokens: int,
        capture: bool = True,
    ) -> None:  # fmt: skip
        super().__init__()
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.capture = capture
        self.buckets = token_buckets(max_tokens)
        config, rows, dev = model.config, self.buckets[-1], kv_cache.k.device
        dtype = kv_cache.k.dtype
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.long, device=dev)
        # One layer's attention inputs and output at a time: every layer's pass through them.
        self.q = torch.zeros(rows, config.num_heads, config.head_dim, dtype=dtype, device=dev)
        self.k = torch.zeros(rows, config.num_kv_heads, config.head_dim, dtype=dtype, device=dev)
        self.v = torch.zeros_like(self.k)
        self.out = torch.zeros_like(self.q)
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # one pool for every bucket
        self._filled = 0

    def fits(self, layout: StepLayout) -> bool:
        """Whether a step of ``layout`` can replay: at most the largest bucket's tokens, and
        no capture has failed."""
        return 0 < len(layout.slots) <= self.buckets[-1] and self.failed is None

    def run(self, token_ids: Sequence[int], positions: Sequence[int], layout: StepLayout) -> torch.Tensor | None:
        """The hidden states ([tokens, hidden]) of a step that ``fits``; None when its
        bucket's graphs could not be captured (then every later step runs eagerly)."""
        n = len(token_ids)
        bucket = next(b for b in self.buckets if b >= n)
        self.input_ids[:n].copy_(torch.tensor(token_ids, dtype=torch.long))
        self.positions[:n].copy_(torch.tensor(positions, dtype=torch.long))
        if self._filled > n:  # rows a larger step left: pad rows again (token 0 at position 0)
            self.input_ids[n : self._filled] = 0
            self.positions[n : self._filled] = 0
        self._filled = n
        meta = self.attention.build_metadata(layout)
        if not self.capture:
            return self._forward(_Split(self, bucket, False, meta, n), bucket)[:n]
        captured = self._get(bucket)
        if captured is None:
            return None
        pieces, hidden = captured
        for piece in pieces:
            piece.graph.replay()
            if piece.layer >= 0:
                self.attend(piece.layer, n, meta, piece.scale, piece.window)
        return hidden[:n]

    def attend(self, layer: int, n: int, meta, scale: float, window: int) -> None:
        """Layer ``layer``'s attention over the step's ``n`` real rows of the static buffers."""
        k_cache, v_cache = self.kv_cache.k[layer], self.kv_cache.v[layer]
        q, k, v = self.q[:n], self.k[:n], self.v[:n]
        self.attention.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        self.attention.attend(q, k, v, k_cache, v_cache, meta, scale, self.out[:n], window)

    def _forward(self, split: _Split, bucket: int) -> torch.Tensor:
        kv = self.kv_cache
        return self.model(self.input_ids[:bucket], self.positions[:bucket], kv.k, kv.v, split)

    def _capture(self, bucket: int) -> tuple[list[_Piece], torch.Tensor]:
        # The warm-up's attention outputs are whatever the buffer holds: nothing of it is kept.
        _warm_up(lambda: self._forward(_Split(self, bucket, False), bucket))
        torch.cuda.synchronize()
        split = _Split(self, bucket, True)
        with torch.cuda.stream(torch.cuda.Stream()):
            split.begin()
            hidden = self._forward(split, bucket)
            split.end()
        torch.cuda.synchronize()
        return split.pieces, hidden


def step_graphs_for(
    model: DecoderModel, kv_cache: KVCache, attention: AttentionBackend, max_batch: int, max_context: int,
    max_tokens: int, enabled: bool,
) -> list[DecodeGraphs | PiecewiseGraphs]:  # fmt: skip
    """The engine's graphs, in the order a step tries them (``DecodeGraphs`` for decodes,
    ``PiecewiseGraphs`` for the rest, up to ``max_tokens`` a step) when they apply:
    ``enabled``, a CUDA device, the triton backend and no mixture-of-experts layers
    (module docstring); else none."""
    if not enabled or kv_cache.k.device.type != "cuda" or getattr(attention, "name", "") != "triton":
        return []
    if model.config.moe is not None:
        return []
    return [DecodeGraphs(model, kv_cache, attention, max_batch, max_context),
            PiecewiseGraphs(model, kv_cache, attention, min(max_tokens, PIECEWISE_TOKENS))]  # fmt: skip

