"""The sampler on hand-made logits: masks, penalties, seeded draws and logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from engine.model.sampler import (
    SampleRow,
    apply_penalties,
    apply_token_controls,
    apply_top_k_top_p_min_p,
    draw,
    sample,
    uniform,
)
from engine.wire.sampling_params import MAX_LOGPROBS, SamplingParams

PROBS = [0.5, 0.3, 0.15, 0.05]
# The same distribution out of order, so a mask must map back through the sort.
ORDER = [2, 0, 3, 1]  # position j holds PROBS[ORDER[j]]
SHUFFLED = torch.tensor([[math.log(PROBS[k]) for k in ORDER]])


def _kept(top_k=0, top_p=1.0, min_p=0.0, logits=SHUFFLED) -> list[float]:
    """The probabilities (from PROBS) of the tokens the mask keeps, most likely first."""
    out = apply_top_k_top_p_min_p(
        logits, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p])
    )
    finite = torch.isfinite(out[0]).tolist()
    assert torch.equal(out[0][torch.tensor(finite)], logits[0][torch.tensor(finite)]), (
        "kept logits must be unchanged"
    )
    return sorted((PROBS[ORDER[j]] for j, keep in enumerate(finite) if keep), reverse=True)


def _row(seed=0, index=0, prompt=(), **params) -> SampleRow:
    return SampleRow(SamplingParams(**params), seed, tuple(prompt), range(index))


# ------------------------------------------------------------------ masks


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.8, [0.5, 0.3]),  # 0.5 + 0.3 reaches 0.8 exactly: the 0.15 is not needed
        (0.81, [0.5, 0.3, 0.15]),
        (0.5, [0.5]),
        (0.51, [0.5, 0.3]),
        (0.01, [0.5]),  # the most likely token always survives
        (1.0, PROBS),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    assert _kept(top_p=top_p) == kept, f"top_p={top_p} should keep {kept}"


@pytest.mark.parametrize("top_k, kept", [(1, [0.5]), (2, [0.5, 0.3]), (3, [0.5, 0.3, 0.15]), (0, PROBS), (9, PROBS)])
def test_top_k_keeps_the_k_most_likely(top_k, kept):
    assert _kept(top_k=top_k) == kept, f"top_k={top_k} should keep {kept}"


@pytest.mark.parametrize(
    "min_p, kept",
    [(0.5, [0.5, 0.3]), (0.3, [0.5, 0.3, 0.15]), (0.61, [0.5]), (0.0, PROBS), (1.0, [0.5])],
)
def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability(min_p, kept):
    assert _kept(min_p=min_p) == kept, f"min_p={min_p} keeps p >= {min_p * 0.5}: {kept}"


def test_top_p_applies_after_top_k():
    # top_k=2 renormalises to [0.625, 0.375]; top_p=0.6 then needs only the first.
    assert _kept(top_k=2, top_p=0.6) == [0.5]
    assert _kept(top_k=2, top_p=0.7) == [0.5, 0.3]


def test_each_row_gets_its_own_mask():
    logits = SHUFFLED.repeat(3, 1)
    out = apply_top_k_top_p_min_p(
        logits, torch.tensor([1, 0, 0]), torch.tensor([1.0, 0.81, 1.0]), torch.tensor([0.0, 0.0, 0.5])
    )
    kept = torch.isfinite(out).sum(dim=1).tolist()
    assert kept == [1, 3, 2], f"rows with top_k=1 / top_p=0.81 / min_p=0.5 keep 1/3/2 tokens, got {kept}"


# ------------------------------------------------------------------ greedy and penalties


def test_greedy_picks_the_argmax_of_every_row():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    ids, _ = sample(logits, [_row(seed=i, temperature=0.0, top_k=3) for i in range(6)])
    assert ids == logits.argmax(dim=1).tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, -1.0]])
    row = SampleRow(SamplingParams(repetition_penalty=2.0), 0, (0, 1), (2,))
    apply_penalties(logits, [row])
    assert logits[0].tolist() == [1.0, -4.0, 0.5, 0.5, -1.0], (
        "seen tokens 0,1 (prompt) and 2 (output): positive / 2, negative * 2; unseen unchanged"
    )


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 5)
    row = SampleRow(SamplingParams(presence_penalty=1.0, frequency_penalty=0.5), 0, (4, 4), (2, 2, 3))
    apply_penalties(logits, [row])
    assert logits[0].tolist() == [0.0, 0.0, -2.0, -1.5, 0.0], (
        "token 2 (twice): -(1 + 2*0.5); token 3 (once): -(1 + 0.5); prompt token 4: untouched"
    )


class _OneDevicePerOp(TorchFunctionMode):
    """Fails an op that mixes tensors of two devices, as CUDA does (0-dim CPU scalars aside).

    Mixing a ``meta`` tensor with a CPU one is allowed by torch, so without this a CPU
    machine cannot see the mismatch a GPU raises on.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        devices = {t.device for t in tensors if t.dim() > 0 or t.device.type != "cpu"}
        if len(devices) > 1:
            raise RuntimeError(f"{func.__name__} mixes devices {sorted(map(str, devices))}")
        return func(*args, **kwargs)


def test_penalties_are_built_on_the_logits_device():
    logits = torch.zeros(2, 8, device="meta")
    rows = [
        SampleRow(SamplingParams(presence_penalty=1.0, frequency_penalty=0.5), 0, (4,), (2, 2, 3)),
        SampleRow(SamplingParams(repetition_penalty=1.5), 0, (1, 5), (6,)),
    ]
    with _OneDevicePerOp():
        apply_penalties(logits, rows)  # raises if a count or index stays on the CPU


def test_penalties_only_touch_rows_that_ask_for_them():
    logits = torch.ones(2, 4)
    rows = [
        SampleRow(SamplingParams(), 0, (0,), (1,)),
        SampleRow(SamplingParams(frequency_penalty=1.0), 0, (0,), (1,)),
    ]
    apply_penalties(logits, rows)
    assert logits.tolist() == [[1, 1, 1, 1], [1, 0, 1, 1]]


def test_greedy_choice_follows_the_penalised_logits():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    before = logits.clone()
    plain, _ = sample(logits, [SampleRow(SamplingParams(temperature=0.0), 0, (0,), ())])
    penalised, _ = sample(
        logits, [SampleRow(SamplingParams(temperature=0.0, repetition_penalty=1.5), 0, (0,), ())]
    )
    assert plain == [0] and penalised == [1], "3.0 / 1.5 = 2.0 < 2.9 turns the choice to token 1"
    assert torch.equal(logits, before), "sample must not modify the caller's logits"


# ------------------------------------------------------------------ seeded draws


def test_seeded_sampling_is_reproducible():
    torch.manual_seed(1)
    logits = torch.randn(1, 64)
    draws = [sample(logits, [_row(seed=1234, index=5)])[0][0] for _ in range(5)]
    assert len(set(draws)) == 1, f"the same (seed, index) must give the same token, got {draws}"
    by_seed = {sample(logits, [_row(seed=s, index=5)])[0][0] for s in range(40)}
    by_index = {sample(logits, [_row(seed=1234, index=i)])[0][0] for i in range(40)}
    assert len(by_seed) > 5 and len(by_index) > 5, (
        "different seeds / output indices should give different draws"
    )


def test_a_seeded_row_draws_the_same_token_alone_and_in_any_batch():
    torch.manual_seed(2)
    vocab = 100
    mismatches = []
    for trial in range(30):
        target = torch.randn(1, vocab)
        row = _row(seed=1000 + trial, index=trial, temperature=0.9)
        alone = sample(target, [row])[0][0]
        mates = torch.randn(5, vocab)
        rows = [
            _row(seed=trial, index=3, temperature=1.3, top_k=10),
            _row(seed=7, index=0, temperature=0.0),
            row,
            _row(seed=99, index=trial, top_p=0.5, min_p=0.1, presence_penalty=1.0),
            _row(seed=5, index=1, logprobs=3),
        ]
        batch = torch.cat([mates[:2], target, mates[2:4]])
        together = sample(batch, rows)[0][2]
        if alone != together:
            mismatches.append((trial, alone, together))
    assert not mismatches, f"(trial, alone, in batch) draws differ: {mismatches}"


def test_random_draws_take_as_many_tensor_ops_for_any_batch():
    def ops(batch: int) -> int:
        rows = [_row(seed=s, index=3, temperature=0.8) for s in range(batch)]
        with _CountOps() as count:
            sample(torch.randn(batch, 4096), rows)
        return count.calls

    assert ops(2) == ops(64), "one batched draw, not a generator and a kernel per row"


def test_an_inverse_cdf_draw_never_lands_on_a_token_of_probability_zero():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0, 0.0, 0.0]])
    assert draw(probs, [0.0, 0.0]).tolist() == [1, 0]
    assert draw(probs, [0.3, 0.6]).tolist() == [3, 1]
    assert draw(probs, [1 - 2**-53, 1 - 2**-53]).tolist() == [3, 1], "the top of the range: the last likely token"
    assert draw(probs * 3, [0.9, 0.9]).tolist() == [3, 1], "rows need not sum to 1"


def test_uniform_draws_spread_over_the_unit_interval_by_seed_and_index():
    by_index = [uniform(42, i) for i in range(4000)]
    by_seed = [uniform(s, 0) for s in range(4000)]
    for draws in (by_index, by_seed):
        assert all(0.0 <= u < 1.0 for u in draws)
        counts = [0] * 10
        for u in draws:
            counts[int(u * 10)] += 1
        chi2 = sum((c - 400) ** 2 / 400 for c in counts)
        assert chi2 < 27.9, f"deciles {counts} (27.9: the 99.9% point with 9 degrees of freedom)"


def _draw_counts(logits: torch.Tensor, n: int, **params) -> list[int]:
    rows = [_row(seed=77, index=i, **params) for i in range(n)]
    ids, _ = sample(logits.expand(n, -1).contiguous(), rows)
    return [ids.count(t) for t in range(logits.shape[-1])]


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


@pytest.mark.parametrize(
    "params, expected",
    [
        (dict(), PROBS),
        # Temperature 0.5 squares the probabilities before renormalising.
        (dict(temperature=0.5), [p * p / sum(q * q for q in PROBS) for p in PROBS]),
        (dict(top_k=2), [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
    ],
    ids=["plain", "temperature-0.5", "top_k-2"],
)
def test_sampled_frequencies_match_the_distribution(params, expected):
    logits = torch.tensor([[math.log(p) for p in PROBS]])
    counts = _draw_counts(logits, 2000, **params)
    for t, (c, p) in enumerate(zip(counts, expected)):
        if p == 0:
            assert c == 0, f"token {t} is masked out but was drawn {c} times"
    chi2 = _chi_square(counts, expected)
    # 16.3 is the 99.9% point of chi-square with 3 degrees of freedom.
    assert chi2 < 16.3, f"counts {counts} over 2000 draws are far from {expected} (chi2={chi2:.1f})"


# ------------------------------------------------------------------ logprobs


def test_logprobs_report_the_chosen_token_and_a_sorted_top_n():
    torch.manual_seed(3)
    logits = torch.randn(3, 200)
    rows = [
        _row(seed=1, logprobs=5, temperature=0.7, top_k=20),
        _row(seed=2, temperature=0.0),
        _row(seed=3, logprobs=MAX_LOGPROBS, temperature=0.0, repetition_penalty=1.3, prompt=(1, 2)),
    ]
    ids, lps = sample(logits, rows)
    ref = logits.log_softmax(dim=-1)
    assert lps[1] is None, "a row that did not ask for logprobs gets None"
    for i, n in ((0, 5), (2, MAX_LOGPROBS)):
        lp = lps[i]
        assert lp.token_id == ids[i]
        assert lp.logprob == pytest.approx(ref[i, ids[i]].item(), abs=1e-6), (
            "the chosen token's logprob is the log_softmax of the raw logits"
        )
        values = [v for _, v in lp.top]
        assert len(lp.top) == n, f"asked for {n} top logprobs, got {len(lp.top)}"
        assert values == sorted(values, reverse=True), "top logprobs are most likely first"
        want_ids = ref[i].topk(n).indices.tolist()
        assert [t for t, _ in lp.top] == want_ids
        assert values == pytest.approx(ref[i, want_ids].tolist(), abs=1e-6)


def test_logprobs_zero_gives_the_chosen_token_only():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    ids, lps = sample(logits, [_row(logprobs=0, temperature=0.0)])
    assert ids == [2] and lps[0].top == ()
    assert lps[0].logprob == pytest.approx(logits.log_softmax(-1)[0, 2].item())


def test_more_than_twenty_logprobs_is_rejected():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=MAX_LOGPROBS + 1)


# ------------------------------------------------------------------ token controls


def _greedy(output=(), **params) -> SampleRow:
    return SampleRow(SamplingParams(temperature=0.0, **params), 0, (), tuple(output))


def test_logit_bias_steers_the_greedy_choice_of_its_row_only():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(3, 1)
    rows = [_greedy(logit_bias={3: 3.5}), _greedy(logit_bias={0: -100, 2: 0.5}), _greedy()]
    ids, _ = sample(logits, rows)
    assert ids == [3, 1, 0], "-1 + 3.5 beats 2.0; token 0 pushed down leaves token 1 (1.0 > 0.5); no bias: argmax"


def test_allowed_token_ids_restrict_every_draw_greedy_or_sampled():
    torch.manual_seed(0)
    logits = torch.randn(1, 50) * 3
    allowed = (3, 17, 41)
    best = max(allowed, key=lambda t: logits[0, t].item())
    assert sample(logits, [_greedy(allowed_token_ids=allowed)])[0] == [best]
    drawn = set()
    for seed in range(100):
        row = SampleRow(SamplingParams(temperature=2.0, allowed_token_ids=allowed), seed, (), ())
        drawn.update(sample(logits, [row])[0])
    assert drawn == set(allowed), f"draws at temperature 2 reach each allowed token and no other: {drawn}"


def test_a_bad_word_is_banned_only_where_the_output_ends_with_its_prefix():
    logits = torch.tensor([[0.0, 0.0, 1.0, 5.0]]).repeat(4, 1)
    word = [(1, 2, 3)]
    rows = [
        _greedy((0, 1, 2), bad_words_token_ids=word),  # "1 2" done: 3 would complete the word
        _greedy((2, 1), bad_words_token_ids=word),  # the tail is not the prefix
        _greedy((1,), bad_words_token_ids=word),  # the prefix is only begun
        _greedy((1, 2), bad_words_token_ids=[(3,), (0, 2)]),  # a one-token word is banned anywhere
    ]
    ids, _ = sample(logits, rows)
    assert ids == [2, 3, 3, 2], ids


def test_logprobs_stay_the_models_under_token_controls():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    raw = logits.log_softmax(dim=-1)[0]
    ids, lps = sample(logits, [_greedy(logit_bias={3: 10}, logprobs=1)])
    assert ids == [3] and lps[0].logprob == pytest.approx(raw[3].item()), lps
    assert lps[0].top == ((0, pytest.approx(raw[0].item())),), "the top list is the model's too"


def test_unconstrained_rows_draw_the_same_next_to_rows_with_token_controls():
    torch.manual_seed(1)
    logits = torch.randn(4, 64)
    plain = [SampleRow(SamplingParams(temperature=t), 7, (), range(3)) for t in (0.0, 1.0)]
    alone, _ = sample(logits[:2], plain)
    controlled = [_greedy((5,), logit_bias={9: 50}), _greedy((5,), allowed_token_ids=(1, 2), bad_words_token_ids=[(5, 1)])]
    mixed, _ = sample(logits, plain + controlled)
    assert mixed[:2] == alone and mixed[2:] == [9, 2], mixed


class _CountOps(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_token_controls_take_as_many_tensor_ops_for_any_batch_or_vocabulary():
    def ops(batch: int, vocab: int) -> int:
        logits = torch.zeros(batch, vocab)
        rows = [_greedy((1, 2), logit_bias={i: 1.0, vocab - 1: -2.0}, allowed_token_ids=(0, 1, i + 2),
                        bad_words_token_ids=[(2, vocab - 3), (vocab - 2,)]) for i in range(batch)]
        with _CountOps() as count:
            apply_token_controls(logits, rows)
        assert torch.isinf(logits).sum().item() == batch * (vocab - 3), "all but the three allowed ids masked"
        return count.calls

    assert ops(2, 16) == ops(64, 32_000), "one batched write per control, not one per row or token"


def test_token_controls_are_built_on_the_logits_device():
    logits = torch.zeros(2, 8, device="meta")
    rows = [_greedy((1, 2), logit_bias={3: 1.0}, bad_words_token_ids=[(2, 5)]), _greedy(allowed_token_ids=(1, 4))]
    with _OneDevicePerOp():
        apply_token_controls(logits, rows)  # raises if an index or value stays on the CPU


@pytest.mark.parametrize(
    "params, field",
    [
        ({"logit_bias": {1: 100.5}}, "logit_bias"),
        ({"logit_bias": {1: math.inf}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {1.5: 1.0}}, "logit_bias"),
        ({"logit_bias": [(1, 2, 3)]}, "logit_bias"),
        ({"allowed_token_ids": ()}, "allowed_token_ids"),
        ({"allowed_token_ids": (1, -2)}, "allowed_token_ids"),
        ({"bad_words_token_ids": [()]}, "bad_words_token_ids"),
        ({"bad_words_token_ids": [(1, "x")]}, "bad_words_token_ids"),
    ],
)
def test_bad_token_controls_are_rejected_naming_the_field(params, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**params)


def test_token_ids_past_the_vocabulary_are_named_by_check_vocab():
    SamplingParams(logit_bias={9: 1.0}, allowed_token_ids=(9,), bad_words_token_ids=[(9,)]).check_vocab(10)
    for params, field in [({"logit_bias": {10: 1.0}}, "logit_bias"), ({"allowed_token_ids": (10,)}, "allowed_token_ids"),
                          ({"bad_words_token_ids": [(1, 10)]}, "bad_words_token_ids")]:
        with pytest.raises(ValueError, match=f"^{field} has token id 10, outside the vocabulary"):
            SamplingParams(**params).check_vocab(10)
