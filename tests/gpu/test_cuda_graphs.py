"""Steps replayed as CUDA graphs (``engine.model.cuda_graphs``: whole decode steps, and steps
with prefill chunks piecewise) generate what eager steps do.

On a GPU the engine captures its own graphs; on CPU the same padded, static-buffer
forward runs without a graph (``capture=False``) with the kernels in Triton's
interpreter, which checks the padding, the pad rows and the buffers a graph reads.
"""

from __future__ import annotations

import pytest

from engine import LLMEngine, SamplingParams
from engine.model.cuda_graphs import DecodeGraphs, PiecewiseGraphs, batch_buckets, token_buckets
from engine.model.step_layout import ChunkLayout, StepLayout
from tests.gpu.device import DEVICE, ON_GPU

pytest.importorskip("triton", reason="triton is not installed (it comes with the gpu extra)")


def test_buckets_double_up_to_the_batch_cap():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(256)[-3:] == [64, 128, 256]


def test_token_buckets_double_to_512_then_step_by_512():
    assert token_buckets(2048) == [16, 32, 64, 128, 256, 512, 1024, 1536, 2048]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(8) == [8]
    assert token_buckets(1000) == [16, 32, 64, 128, 256, 512, 1000]


def _engine(model: str, graphs: bool, **settings) -> LLMEngine:
    return LLMEngine(**{**dict(model=model, device=DEVICE, dtype="float32", attention_backend="triton",
                               num_kv_blocks=64, max_num_seqs=6, enable_prefix_caching=False, cuda_graphs=graphs),
                        **settings})  # fmt: skip


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
    assert eager.runner.graphs == []
    want = _generate(eager, prompts, lengths)
    engine = _engine(tiny_model, graphs=True)
    if ON_GPU:
        assert [type(g) for g in engine.runner.graphs] == [DecodeGraphs, PiecewiseGraphs]
        assert [g.captured for g in engine.runner.graphs] == [[1, 2, 4, 6], token_buckets(2048)], "at start-up"
    else:  # no CUDA: the same static-buffer forward, without a graph
        assert engine.runner.graphs == []
        engine.runner.graphs = [DecodeGraphs(engine.model, engine.kv_cache, engine.attention, 6,
                                             engine.max_model_len, capture=False)]  # fmt: skip
    got = _generate(engine, prompts, lengths)
    assert got == want
    assert engine.runner.graphs[0].captured == [1, 2, 4, 6]
    assert engine.stats().num_blocks_in_use == 0 and eager.stats().num_blocks_in_use == 0


def test_a_capture_that_fails_leaves_every_later_step_eager(tiny_model, caplog):
    import torch

    prompts = [[(5 * i + j) % 500 + 3 for j in range(11 + 4 * i)] for i in range(3)]
    lengths = [3, 4, 5]
    want = _generate(_engine(tiny_model, graphs=False), prompts, lengths)
    engine = _engine(tiny_model, graphs=False)
    graphs = DecodeGraphs(engine.model, engine.kv_cache, engine.attention, 6, engine.max_model_len, capture=False)
    engine.runner.graphs = [graphs]
    calls = []

    def out_of_memory(bucket):
        calls.append(bucket)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    graphs._capture = out_of_memory
    with caplog.at_level("WARNING", logger="engine.model.cuda_graphs"):
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


def test_piecewise_graphs_generate_the_eager_tokens_through_mixed_steps(tiny_model):
    # Three waves of prompts, each arriving while the earlier ones decode, chunked by a
    # 24-token budget: steps of decodes and chunks together, of chunks alone and of decodes
    # alone, token counts landing in buckets 16 (with pad rows) and 24.
    sizes = [7, 16, 25, 34, 5]
    prompts = [[(11 * i + 5 * j) % 500 + 3 for j in range(n)] for i, n in enumerate(sizes)]
    lengths = [12, 9, 4, 7, 5] if not ON_GPU else [40, 21, 9, 14, 30]
    # Logprobs too: a random tiny model's argmax can survive a wrong attention.
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1) for n in lengths]
    eager = _engine(tiny_model, graphs=False, max_num_batched_tokens=24)
    engine = _engine(tiny_model, graphs=True, max_num_batched_tokens=24)
    if not ON_GPU:
        engine.runner.graphs = [DecodeGraphs(engine.model, engine.kv_cache, engine.attention, 6,
                                             engine.max_model_len, capture=False),
                                PiecewiseGraphs(engine.model, engine.kv_cache, engine.attention, 24, capture=False)]
    piecewise = engine.runner.graphs[1]
    runs = []  # (tokens, chunks) of each step the piecewise graphs ran
    real_run = piecewise.run
    piecewise.run = lambda ids, pos, layout: runs.append((len(ids), len(layout.chunks))) or real_run(ids, pos, layout)
    want, got = {}, {}
    for e, done in ((eager, want), (engine, got)):
        for wave in ([0, 1], [2, 3], [4]):
            for i in wave:
                e.add_request(prompts[i], params[i], request_id=f"r{i}")
            for _ in range(3):
                done.update((o.request_id, o) for o in e.step() if o.finished)
        while e.has_unfinished_requests():
            done.update((o.request_id, o) for o in e.step() if o.finished)
    assert sorted(got) == sorted(want) and len(got) == 5
    for rid, out in want.items():
        assert got[rid].token_ids == out.token_ids, rid
        assert [lp.logprob for lp in got[rid].logprobs] == pytest.approx([lp.logprob for lp in out.logprobs], abs=1e-4)
    assert any(chunks and n > chunks for n, chunks in runs), "a step of decodes and chunks together"
    assert any(n < 16 for n, _ in runs) and any(n > 16 for n, _ in runs), f"both buckets, pad rows in one: {runs}"
    if ON_GPU:
        assert piecewise.captured == [16, 24]
    assert engine.stats().num_blocks_in_use == 0 and eager.stats().num_blocks_in_use == 0


def test_piecewise_graphs_take_steps_up_to_their_largest_bucket(tiny_model):
    engine = _engine(tiny_model, graphs=False)
    graphs = PiecewiseGraphs(engine.model, engine.kv_cache, engine.attention, 32, capture=False)
    chunk = StepLayout(slots=list(range(32)), decode_context_lens=[], chunks=[ChunkLayout(0, 32, 0, [1, 2])])
    assert graphs.fits(chunk)
    assert not graphs.fits(StepLayout(slots=list(range(33)), decode_context_lens=[], chunks=[ChunkLayout(0, 33, 0, [1, 2, 3])]))
    graphs.failed = "capturing failed"
    assert not graphs.fits(chunk)
