"""The offline engine at tensor_parallel_size 2: rank 0 in this process, rank 1 a process
it spawned, each with half the weights and its KV heads (``engine.ranks``).

Greedy outputs equal transformers' token for token (as TP 1's do in
``tests/unit/test_hf_parity.py``) for Llama (GQA: one KV head a rank), Llama with one KV
head (held by both ranks), Qwen2 (q/k/v bias, tied embeddings), Qwen3-MoE and Gemma 3,
under a 16-token step budget and both preemption modes (a 12-block pool), and TP 1's with
prefix-cache hits; every block is back at the end. One engine per family serves every
schedule (``LLMEngine.reset`` changes the scheduler's settings; the ranks stay). Seeded
sampling, logprobs, prompt logprobs and grammar-constrained outputs equal TP 1's. The
ranks' lifecycle: ``close`` ends them, a rank that dies or hangs fails the step with a
``RankFailure`` naming it, and a start that fails leaves no rank behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import random
import re
import signal
import time

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.model.model_config import ModelConfig
from engine.ranks import RankFailure
from engine.wire.sampling_params import StructuredOutput
from tests.helpers import ENGINE_PROMPTS, build_hf_checkpoint
from tests.unit.test_hf_parity import _hf_greedy, _hf_model

NUM_REQUESTS = 10
POOL = dict(num_kv_blocks=12, swap_space=1 << 20)  # small enough to preempt; 1 MiB of swap a rank
# name: (HF_FAMILIES' family, config overrides). Large inits (test_hf_parity.py: the outputs
# must depend on attention); Gemma's outputs stay varied at a smaller one.
FAMILIES = {
    "llama": ("llama", dict(initializer_range=0.2)),
    "llama-one-kv-head": ("llama", dict(initializer_range=0.2, num_key_value_heads=1)),
    "qwen2": ("qwen2", dict(initializer_range=0.2)),
    "qwen3_moe": ("qwen3_moe", dict(initializer_range=0.2)),
    "gemma3": ("gemma3", dict(initializer_range=0.05)),
}
SCHEDULES = {
    "16-token-budget": dict(max_num_batched_tokens=16, preemption_mode="recompute"),
    "preempt-recompute": dict(preemption_mode="recompute"),
    "preempt-swap": dict(preemption_mode="swap"),
}


def _workload(vocab: int, seed: int, shared_prefix: int = 0) -> tuple[list[list[int]], list[int]]:
    """Prompts of 1 to 100 tokens (or four shared prefixes and a short tail) and output lengths."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(shared_prefix)] for _ in range(4)]
    prompts, lengths = [], []
    for i in range(NUM_REQUESTS):
        if shared_prefix:
            prompts.append(prefixes[i % 4] + [rng.randrange(vocab) for _ in range(rng.randint(1, 24))])
        else:
            prompts.append([rng.randrange(vocab) for _ in range(rng.randint(1, 100))])
        lengths.append(rng.randint(1, 32))
    return prompts, lengths


def _assert_same(got: list[list[int]], want: list[list[int]], reference: str) -> None:
    assert len(got) == len(want), f"{len(got)} outputs for {len(want)} requests"
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            pos = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            pytest.fail(f"request {i}: first difference at output token {pos}: TP 2 {g[pos:pos + 5]} "
                        f"vs {reference} {w[pos:pos + 5]}")


def _generate(llm: LLM, prompts, lengths):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    return [o.token_ids for o in llm.generate(prompts, params)], llm.stats()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, default_model):
    """A checkpoint, the reference outputs on it (HF's greedy ones for the mixed workload, TP
    1's for the shared prefixes) and a TP 2 ``LLM`` over it."""
    arch, overrides = FAMILIES[request.param]
    model_dir = str(build_hf_checkpoint(tmp_path_factory.mktemp(request.param), arch, default_model, **overrides))
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    prompts, lengths = _workload(vocab, 1)
    ref = {"mixed": (prompts, lengths, _hf_greedy(_hf_model(model_dir), prompts, lengths))}
    prompts, lengths = _workload(vocab, 2, shared_prefix=48)
    ref["shared"] = (prompts, lengths, _generate(LLM(model=model_dir, **POOL), prompts, lengths)[0])
    with LLM(model=model_dir, tensor_parallel_size=2, **POOL) as llm:
        ref["base"] = llm.engine.config
        yield ref, llm
    assert _rank_exit_codes(llm) == [0], "a closed engine's ranks should have exited cleanly"


def _rank_exit_codes(llm: LLM) -> list[int | None]:
    return [p.exitcode for p in llm.engine.tensor_parallel.processes.processes]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_tp2_greedy_matches_hf_under_each_schedule(family, schedule):
    ref, llm = family
    llm.engine.reset(dataclasses.replace(ref["base"], enable_prefix_caching=False, **SCHEDULES[schedule]))
    prompts, lengths, want = ref["mixed"]
    got, stats = _generate(llm, prompts, lengths)
    _assert_same(got, want, "HF")
    mode = SCHEDULES[schedule]["preemption_mode"]
    done = {"recompute": stats.num_preemptions_recompute, "swap": stats.num_preemptions_swap}
    assert done[mode] > 0, f"a {POOL['num_kv_blocks']}-block pool should force {mode} preemptions; got {done}"
    if ModelConfig.from_pretrained(llm.engine.model_dir).kv_window:
        assert stats.num_window_released_blocks > 0, "the blocks behind the window should have been given back"
    assert stats.num_blocks_in_use == 0, f"{stats.num_blocks_in_use} KV blocks leaked"


def test_tp2_greedy_matches_tp1_with_prefix_cache_hits(family):
    ref, llm = family
    llm.engine.reset(ref["base"])
    prompts, lengths, want = ref["shared"]
    got, stats = _generate(llm, prompts, lengths)
    _assert_same(got, want, "TP 1")
    assert stats.prefix_cache_hits > 0, "prompts sharing 48-token prefixes should hit the cache"
    assert stats.num_blocks_in_use == 0, f"{stats.num_blocks_in_use} KV blocks leaked"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, default_model) -> str:
    return str(build_hf_checkpoint(tmp_path_factory.mktemp("tp-llama"), "llama", default_model, initializer_range=0.2))


def _sampled(llm: LLM, prompts, params, constrained) -> list:
    """Token ids, logprobs and prompt logprobs of ``params``' outputs, then the texts of a
    regex-constrained greedy batch (rank 0's grammar masks)."""
    outs = llm.generate(prompts, params)
    rows = [(o.token_ids, [lp.logprob for lp in o.logprobs],
             [lp.logprob for lp in o.prompt_logprobs or () if lp is not None]) for o in outs]
    return rows + [o.text for o in llm.generate(ENGINE_PROMPTS, constrained)]


def test_seeded_sampling_logprobs_and_grammars_at_tp2_give_what_tp1_gives_and_close_ends_the_ranks(llama_dir):
    prompts, lengths = _workload(ModelConfig.from_pretrained(llama_dir).vocab_size, 3)
    params = [SamplingParams(max_tokens=n, temperature=0.9, top_p=0.9, seed=i, logprobs=2, ignore_eos=True,
                             prompt_logprobs=1 if i % 2 else None) for i, n in enumerate(lengths)]
    regex = r"[a-z]{3,6}-[0-9]{2}"
    constrained = SamplingParams(max_tokens=20, temperature=0.0, structured_output=StructuredOutput("regex", regex))
    want = _sampled(LLM(model=llama_dir, **POOL), prompts, params, constrained)
    llm = LLM(model=llama_dir, tensor_parallel_size=2, **POOL)
    got = _sampled(llm, prompts, params, constrained)
    assert [g[0] for g in got[:NUM_REQUESTS]] == [w[0] for w in want[:NUM_REQUESTS]], "the seeded draws"
    assert any(g[2] for g in got[:NUM_REQUESTS]), "some requests asked for their prompt's logprobs"
    for g, w in zip(got[:NUM_REQUESTS], want):
        assert g[1] == pytest.approx(w[1], abs=1e-4) and g[2] == pytest.approx(w[2], abs=1e-4)
    assert got[NUM_REQUESTS:] == want[NUM_REQUESTS:] and all(re.fullmatch(regex, t) for t in got[NUM_REQUESTS:])
    assert llm.stats().num_blocks_in_use == 0
    llm.close()
    llm.close()  # idempotent
    assert _rank_exit_codes(llm) == [0], "a closed engine's rank should exit cleanly"
    with pytest.raises(RankFailure, match="closed"):
        llm.generate(prompts[:1], params[:1])


def test_a_rank_that_dies_fails_the_next_step_naming_it(llama_dir):
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(model=llama_dir, tensor_parallel_size=2, **POOL) as llm:
        llm.generate([[5, 6, 7]], params)
        rank1 = llm.engine.tensor_parallel.processes.processes[0]
        os.kill(rank1.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match=r"rank 1 \(killed by SIGKILL\)"):
            llm.generate([[5, 6, 7]], params)
        assert time.monotonic() - t0 < 30, "a dead rank's closed socket should fail the step at once"
        with pytest.raises(RankFailure, match="rank 1"):  # and every step after it
            llm.generate([[8, 9]], params)


def test_a_rank_that_hangs_fails_the_step_at_the_collective_timeout(llama_dir, monkeypatch):
    monkeypatch.setattr("engine.ranks.COLLECTIVE_TIMEOUT_S", 3.0)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(model=llama_dir, tensor_parallel_size=2, **POOL) as llm:
        rank1 = llm.engine.tensor_parallel.processes.processes[0]
        os.kill(rank1.pid, signal.SIGSTOP)
        try:
            with pytest.raises(RankFailure, match="no other rank exited"):
                llm.generate([[5, 6, 7]], params)
        finally:
            with contextlib.suppress(ProcessLookupError):  # (it was killed)
                os.kill(rank1.pid, signal.SIGCONT)
    assert not rank1.is_alive(), "the hung rank should have been stopped"


def test_an_interrupt_mid_step_stops_the_ranks_rather_than_leaving_them_out_of_step(llama_dir):
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(model=llama_dir, tensor_parallel_size=2, **POOL) as llm:
        rank1 = llm.engine.tensor_parallel.processes.processes[0]

        def interrupted(step):  # rank 1 has the step and waits in its forward's first collective
            raise KeyboardInterrupt

        llm.engine.runner.execute = interrupted
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[5, 6, 7]], params)
        assert not rank1.is_alive(), "a rank left mid-step would pair its next collective with the wrong one"
        with pytest.raises(RankFailure, match="KeyboardInterrupt"):
            llm.generate([[5, 6, 7]], params)


def test_a_size_the_heads_do_not_divide_fails_naming_the_rule_and_leaves_no_rank(llama_dir):
    before = set(multiprocessing.active_children())  # (another test's engine may still be up)
    with pytest.raises(ValueError, match=r"heads \(4\) must divide by tensor_parallel_size \(3\)"):
        LLM(model=llama_dir, tensor_parallel_size=3, **POOL)
    left = set(multiprocessing.active_children()) - before
    assert not left, f"the ranks started for it should be stopped: {left}"


def test_tensor_parallel_size_below_one_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        EngineConfig(tensor_parallel_size=0)


def test_tandem_generate_at_tp2_prints_what_tp1_prints(llama_dir, capsys):
    from tandem.cli import main

    outputs = []
    for size in (1, 2):
        assert main(["generate", "The cat sat", "--model", llama_dir, "--max-tokens", "12",
                     "--tensor-parallel-size", str(size)]) == 0
        captured = capsys.readouterr()
        assert "blocks in use after: 0" in captured.err
        outputs.append(captured.out)
    assert outputs[0] == outputs[1] and outputs[0].strip()


def test_the_tp_benchmark_finds_half_the_weights_on_each_rank(llama_dir, tmp_path):
    from bench.tp import main

    out = tmp_path / "tp.json"
    assert main(["--model", llama_dir, "--batch", "4", "--context", "16", "--steps", "3", "--rounds", "1",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tp1_step_ms"] > 0 and result["tp2_step_ms"] > 0
    # Two all-reduces a layer and the embedding's one, every decode step.
    assert result["all_reduces_per_step"] == 2 * ModelConfig.from_pretrained(llama_dir).num_layers + 1
    # Each rank holds half of every weight but the norms (replicated).
    assert [round(share, 1) for share in result["weights_per_rank_tp2_over_tp1"]] == [0.5, 0.5]
    assert set(result["transport_us_per_all_reduce"]) >= {"gloo"}
