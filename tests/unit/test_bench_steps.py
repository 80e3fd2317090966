"""``bench.steps`` times decode steps only: a batch whose prompts take several steps to
prefill is warmed up until every request decodes, so no timed step computes a prompt."""

from __future__ import annotations

from bench.steps import step_times
from engine import LLMEngine


def test_timed_steps_decode_every_request_even_when_the_prefill_takes_many_steps(tiny_model):
    # 8 prompts of 64 tokens at 64 tokens a step: 8 steps of prefill before all decode.
    engine = LLMEngine(model=tiny_model, num_kv_blocks=128, max_num_batched_tokens=64, enable_prefix_caching=False)
    calls: list[list] = []
    step = engine.step

    def recording_step():
        outs = step()
        calls.append([len(o.new_token_ids) for o in outs])
        return outs

    engine.step = recording_step
    (row,) = step_times(engine, [8], context=64, steps=6)
    assert row["batch"] == 8 and row["step_ms"] > 0
    assert calls[-6:] == [[1] * 8] * 6, f"a timed step was not a decode of the whole batch: {calls[-6:]}"
    assert engine.stats().num_blocks_in_use == 0
