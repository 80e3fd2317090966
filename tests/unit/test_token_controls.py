"""The token controls (``logit_bias``, ``allowed_token_ids``, bad words) on the offline
engine: they hold on every token, in any batch, through recompute and swap preemption
and across the prefill / decode hand-over, and leave other requests as they were.

Every engine ends each test idle with no KV blocks held.
"""

from __future__ import annotations

import pytest

from engine import LLM, LLMEngine, SamplingParams
from tests.helpers import ENGINE_PROMPTS, assert_engine_idle

PROMPTS = ENGINE_PROMPTS


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(model=tiny_model, num_kv_blocks=256)


def _contains(tokens: list[int], word: tuple[int, ...]) -> bool:
    n = len(word)
    return any(tuple(tokens[i:i + n]) == word for i in range(len(tokens) - n + 1))


def _greedy(**controls) -> SamplingParams:
    return SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, **controls)


def _controlled(i: int, bad_words, allowed) -> SamplingParams:
    """Request ``i``'s params: the three controls in turn, half greedy, half seeded draws."""
    kind = ("bad_words_token_ids", "allowed_token_ids", "logit_bias")[i % 3]
    value = {"bad_words_token_ids": bad_words, "allowed_token_ids": allowed,
             "logit_bias": {t: 8.0 for t in allowed}}[kind]
    return SamplingParams(max_tokens=40, temperature=0.0 if i % 2 == 0 else 1.0, seed=i, ignore_eos=True,
                          **{kind: value})


def _check(outputs, bad_words, allowed) -> None:
    for i, out in enumerate(outputs):
        if i % 3 == 0:
            hits = [w for w in bad_words if _contains(out.token_ids, w)]
            assert not hits, f"request {i} wrote the bad words {hits}: {out.token_ids}"
        elif i % 3 == 1:
            assert set(out.token_ids) <= set(allowed), f"request {i} left {allowed}: {out.token_ids}"


@pytest.fixture(scope="module")
def banned(llm):
    """Bad words the model would write (two-token runs and a token of its greedy outputs)
    and a handful of allowed ids, so that every control has to act."""
    outs = llm.generate(PROMPTS, _greedy())
    words = {tuple(o.token_ids[j:j + 2]) for o in outs for j in (3, 10)} | {(outs[0].token_ids[0],)}
    allowed = sorted({o.token_ids[5] for o in outs[:4]} | {7, 300})
    return sorted(words), allowed, outs


def test_bad_words_are_never_completed_and_the_output_changes(llm, banned):
    words, _, plain = banned
    outs = llm.generate(PROMPTS, _greedy(bad_words_token_ids=words))
    for o in outs:
        assert not [w for w in words if _contains(o.token_ids, w)], (o.token_ids, words)
    assert [o.token_ids for o in outs] != [p.token_ids for p in plain], "the ban was meant to bite"
    assert_engine_idle(llm)


def test_allowed_token_ids_hold_on_every_token_and_logit_bias_steers(llm, banned):
    _, allowed, plain = banned
    outs = llm.generate(PROMPTS[:6], [SamplingParams(max_tokens=30, temperature=1.0, seed=i, ignore_eos=True,
                                                     allowed_token_ids=allowed) for i in range(6)])
    for o in outs:
        assert len(o.token_ids) == 30 and set(o.token_ids) <= set(allowed), o.token_ids
    pushed = llm.generate(PROMPTS[:3], _greedy(logit_bias={300: 100.0}))
    assert all(set(o.token_ids) == {300} for o in pushed), [o.token_ids for o in pushed]
    first = plain[0].token_ids[0]
    [down] = llm.generate(PROMPTS[0], _greedy(logit_bias={first: -100.0}))
    assert first not in down.token_ids, down.token_ids
    assert_engine_idle(llm)


def test_unconstrained_greedy_outputs_are_unchanged_by_controlled_batch_mates(llm, banned):
    words, allowed, plain = banned
    mixed = llm.generate(PROMPTS[:4] + PROMPTS[4:10],
                         [_greedy()] * 4 + [_controlled(i, words, allowed) for i in range(6)])
    for p, m in zip(plain[:4], mixed[:4]):
        assert p.token_ids == m.token_ids, f"{p.text!r} became {m.text!r} next to controlled requests"
    _check(mixed[4:], words, allowed)
    assert_engine_idle(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_controls_survive_preemption_token_for_token(llm, tiny_model, banned, mode):
    words, allowed, _ = banned
    params = [_controlled(i, words, allowed) for i in range(len(PROMPTS))]
    # 9 usable blocks of 16 tokens for 12 requests that each grow past a block or two.
    tight = LLM(model=tiny_model, num_kv_blocks=10, preemption_mode=mode, swap_space=1 << 26)
    reference = llm.generate(PROMPTS, params)
    squeezed = tight.generate(PROMPTS, params)
    assert tight.stats().num_preemptions > 0, "the pool was meant to force preemption"
    _check(squeezed, words, allowed)
    for r, s in zip(reference, squeezed):
        assert r.token_ids == s.token_ids, f"{r.token_ids} vs {s.token_ids} after {mode} preemption"
    assert_engine_idle(tight)
    assert_engine_idle(llm)


def test_the_decode_engine_goes_on_under_the_controls_from_the_prefill_engines_first_token(llm, tiny_model, banned):
    _, _, plain = banned
    # The plain output's first two tokens as a bad word: the prefill engine samples the
    # first as before, and the decode engine must avoid the second right after it.
    word = (plain[0].token_ids[0], plain[0].token_ids[1])
    params = _greedy(bad_words_token_ids=[word])
    [whole] = llm.generate(PROMPTS[0], params)
    assert whole.token_ids[0] == word[0] and whole.token_ids[1] != word[1], whole.token_ids
    prefill = llm.engine
    rid = prefill.add_request(PROMPTS[0], SamplingParams(max_tokens=1, temperature=0.0,
                                                         bad_words_token_ids=params.bad_words_token_ids),
                              hold_kv=True)
    first = None
    while first is None:
        first = next((o for o in prefill.step() if o.finished), None)
    decode = LLMEngine(model=tiny_model, num_kv_blocks=64)
    assert decode.add_remote_request(PROMPTS[0], params, request_id=rid) is not None
    outs = [decode.remote_kv_arrived(rid, first.token_ids[0], *prefill.take_held_kv(rid, first.kv_blocks))]
    while decode.has_unfinished_requests():
        outs += decode.step()
    tokens = [t for o in outs if o is not None for t in o.new_token_ids]
    assert tokens == whole.token_ids and not _contains(tokens, word), (tokens, whole.token_ids)
    assert decode.stats().num_blocks_in_use == 0 and prefill.stats().num_blocks_in_use == 0


def test_the_engine_refuses_ids_outside_its_vocabulary(llm):
    vocab = llm.engine.model_config.vocab_size
    for controls, field in [({"allowed_token_ids": (vocab,)}, "allowed_token_ids"),
                            ({"logit_bias": {vocab + 5: 1.0}}, "logit_bias")]:
        with pytest.raises(ValueError, match=f"^{field} has token id"):
            llm.engine.add_request("hi", SamplingParams(**controls))
    assert_engine_idle(llm)
