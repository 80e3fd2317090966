"""Stop strings: the limits on them (``engine.wire.sampling_params``, which the router's
validation and the engine's own API share) and the automaton that finds them in a
growing text (``engine.stop_strings``), which must find exactly what a ``str.find`` per
stop string over the new text did."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.stop_strings import StopMatcher
from engine.wire.sampling_params import MAX_STOP_STRING_LEN, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams


def _find_each(text: str, new_start: int, stops: list[str]) -> tuple[int, str] | None:
    """The search the automaton replaced: each stop string's first match that may end in
    ``text[new_start:]``; the earliest start wins, then the first listed."""
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, new_start - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def _steps(chunks: list[str], stops: list[str]) -> list[tuple[int, str] | None]:
    """What the automaton finds after each chunk, up to the first match."""
    matcher, text, found = StopMatcher(stops), "", []
    for chunk in chunks:
        text += chunk
        found.append(matcher.find(text))
        if found[-1] is not None:
            break
    return found


@settings(max_examples=300, deadline=None)
@given(
    chunks=st.lists(st.text(alphabet="ab\u00e9\U0001f600", max_size=6), max_size=12),
    stops=st.lists(st.text(alphabet="ab\u00e9\U0001f600", min_size=1, max_size=5), min_size=1, max_size=6),
)
def test_the_automaton_finds_what_a_find_per_stop_string_found(chunks: list[str], stops: list[str]) -> None:
    text, expected = "", []
    for chunk in chunks:
        new_start, text = len(text), text + chunk
        expected.append(_find_each(text, new_start, stops))
        if expected[-1] is not None:
            break
    assert _steps(chunks, stops) == expected, f"chunks {chunks!r}, stops {stops!r}"


def test_a_stop_string_split_across_steps_is_found_where_it_starts() -> None:
    assert _steps(["The END", "ING"], ["ENDING"]) == [None, (4, "ENDING")]


def test_a_match_starting_earlier_wins_over_one_ending_earlier() -> None:
    # Both end in the new text: "cd" ends first, "abcdef" starts first.
    assert _steps(["xab", "cdef"], ["cd", "abcdef"]) == [None, (1, "abcdef")]
    # Fed a step earlier, "cd" ends the text before "abcdef" can complete.
    assert _steps(["xabcd", "ef"], ["cd", "abcdef"]) == [(3, "cd")]


def test_of_two_stop_strings_starting_at_the_same_place_the_first_listed_wins() -> None:
    assert _steps(["--abc"], ["ab", "abc"]) == [(2, "ab")]
    assert _steps(["--abc"], ["abc", "ab"]) == [(2, "abc")]


def test_no_stop_strings_never_match() -> None:
    assert _steps(["anything at all"], []) == [None]


# -- limits --------------------------------------------------------------------------


def test_sampling_params_take_stop_conditions_up_to_their_limits() -> None:
    params = SamplingParams(stop=["x" * MAX_STOP_STRING_LEN] * MAX_STOP_STRINGS,
                            stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    assert len(params.stop) == MAX_STOP_STRINGS and len(params.stop_token_ids) == MAX_STOP_TOKEN_IDS


@pytest.mark.parametrize("fields, words", [
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)},
     f"stop has {MAX_STOP_STRINGS + 1} strings, over the limit of {MAX_STOP_STRINGS}"),
    ({"stop": ["ok", "y" * (MAX_STOP_STRING_LEN + 1)]},
     f"stop strings must be at most {MAX_STOP_STRING_LEN} characters, got {MAX_STOP_STRING_LEN + 1} (stop[1])"),
    ({"stop": "z" * (MAX_STOP_STRING_LEN + 1)}, f"got {MAX_STOP_STRING_LEN + 1} (stop[0])"),
    ({"stop_token_ids": [7] * (MAX_STOP_TOKEN_IDS + 1)},
     f"stop_token_ids has {MAX_STOP_TOKEN_IDS + 1} ids, over the limit of {MAX_STOP_TOKEN_IDS}"),
])
def test_sampling_params_refuse_stop_conditions_past_their_limits(fields: dict, words: str) -> None:
    """The engine's own API (``LLM``, ``LLMEngine``) refuses them too, not only the router."""
    with pytest.raises(ValueError) as e:
        SamplingParams(**fields)
    assert words in str(e.value), str(e.value)
