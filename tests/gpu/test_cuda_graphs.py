"""Decode steps replayed as CUDA graphs (``engine.cuda_graphs``) generate what eager steps do.

On a GPU the engine captures its own graphs; on CPU the same padded, static-buffer
forward runs without a graph (``capture=False``) with the kernels in Triton's
interpreter, which checks the padding, the pad rows and the buffers a graph reads.
"""

from __future__ import annotations

import pytest

from engine import LLMEngine, SamplingParams
from engine.cuda_graphs import DecodeGraphs, batch_buckets
from engine.step_layout import ChunkLayout, StepLayout
from tests.gpu.device import DEVICE, ON_GPU

pytest.importorskip("triton", reason="triton is not installed (it comes with the gpu extra)")


def test_buckets_double_up_to_the_batch_cap():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(256)[-3:] == [64, 128, 256]


def _engine(model: str, graphs: bool) -> LLMEngine:
    return LLMEngine(model=model, device=DEVICE, dtype="float32", attention_backend="triton", num_kv_blocks=64,
                     max_num_seqs=6, enable_prefix_caching=False, cuda_graphs=graphs)  # fmt: skip


def _generate(engine: LLMEngine, prompts: list[list[int]], lengths: list[int]) -> dict[str, list[int]]:
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), request_id=f"r{i}")
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    return done


def test_graph_replayed_decodes_generate_the_eager_tokens(tiny_model):
    # Five requests finishing at different steps: the batch shrinks through buckets 8, 4, 2
    # and 1, so rows a larger step filled are padded again.
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(9 + 5 * i)] for i in range(5)]
    lengths = [2, 3, 5, 6, 8] if not ON_GPU else [4, 9, 17, 30, 41]
    eager = _engine(tiny_model, graphs=False)
    assert eager.runner.graphs is None
    want = _generate(eager, prompts, lengths)
    engine = _engine(tiny_model, graphs=True)
    if ON_GPU:
        assert engine.runner.graphs is not None, "a CUDA device with the triton backend captures graphs"
    else:  # no CUDA: the same static-buffer forward, without a graph
        assert engine.runner.graphs is None
        engine.runner.graphs = DecodeGraphs(engine.model, engine.kv_cache, engine.attention, 6,
                                            engine.max_model_len, capture=False)  # fmt: skip
    got = _generate(engine, prompts, lengths)
    assert got == want
    assert engine.runner.graphs.captured == [1, 2, 4, 6], "each bucket the shrinking batch passed through"
    assert engine.stats().num_blocks_in_use == 0 and eager.stats().num_blocks_in_use == 0


def test_a_capture_that_fails_leaves_every_later_step_eager(tiny_model, caplog):
    import torch

    prompts = [[(5 * i + j) % 500 + 3 for j in range(11 + 4 * i)] for i in range(3)]
    lengths = [3, 4, 5]
    want = _generate(_engine(tiny_model, graphs=False), prompts, lengths)
    engine = _engine(tiny_model, graphs=False)
    graphs = engine.runner.graphs = DecodeGraphs(engine.model, engine.kv_cache, engine.attention, 6,
                                                 engine.max_model_len, capture=False)  # fmt: skip
    calls = []

    def out_of_memory(bucket):
        calls.append(bucket)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    graphs._capture = out_of_memory
    with caplog.at_level("WARNING", logger="engine.cuda_graphs"):
        assert _generate(engine, prompts, lengths) == want
    assert calls == [4], "one failed capture, then no more tries"
    assert "out of memory" in graphs.failed and graphs.captured == []
    assert "decode steps run eagerly from now on" in caplog.text
    assert engine.stats().num_blocks_in_use == 0


def test_steps_with_prefill_chunks_or_long_contexts_run_eagerly(tiny_model):
    engine = _engine(tiny_model, graphs=False)
    graphs = DecodeGraphs(engine.model, engine.kv_cache, engine.attention, 4, 64, capture=False)
    decode = StepLayout(slots=[17, 40], decode_context_lens=[2, 9], chunks=[])
    assert graphs.fits(decode)
    with_chunk = StepLayout(slots=[17, 40, 41], decode_context_lens=[2], chunks=[ChunkLayout(1, 2, 0, [2])])
    assert not graphs.fits(with_chunk)
    assert not graphs.fits(StepLayout(slots=[17], decode_context_lens=[65], chunks=[]))
    assert not graphs.fits(StepLayout(slots=list(range(5)), decode_context_lens=[3] * 5, chunks=[]))
