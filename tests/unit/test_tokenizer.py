"""Tests for engine.tokenizer: Tokenizer and IncrementalDetokenizer.

All tests run against the real default model tokenizer (a byte-level BPE),
built once per session with make_model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model.default_model import make_model
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

ASCII_TEXTS = [
    "Hello world",
    " leading space and trailing space ",
    "def f(x):\n    return x * 2\n",
    "Numbers: 3.14159, 42, -7, 1e-5; punctuation!?",
    "",
]

UNICODE_TEXTS = [
    "café déjà vu naïve façade",
    "你好，世界。今天天气很好。",
    "Emoji: 😀👍🌍 and a family 👨‍👩‍👧 and flags 🇯🇵",
    "mixed: résumé 東京 🍞 ∞ ≈ → ok",
    "combining: e\u0301 a\u0308",
]

PROMPT = "<|user|>\nTell me something.<|end|>\n<|assistant|>\n"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tandem-tiny-llama"))


@pytest.fixture(scope="session")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def hf_tok(model_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def _stream(
    tok: Tokenizer,
    output_ids: list[int],
    *,
    prompt: str = PROMPT,
    chunk_sizes: list[int] | None = None,
    **kwargs,
) -> tuple[list[str], IncrementalDetokenizer, str | None]:
    """Feed output_ids to a detokenizer in chunks; return (deltas, detok, stop)."""
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), **kwargs)
    deltas: list[str] = []
    stop = None
    pos = 0
    sizes = iter(chunk_sizes or [])
    while pos < len(output_ids) and stop is None:
        n = max(1, next(sizes, 1))
        stop = detok.update(output_ids[pos : pos + n])
        pos += n
        deltas.append(detok.take_delta(finished=stop is not None))
    deltas.append(detok.take_delta(finished=True))
    return deltas, detok, stop


# --------------------------------------------------------------------- Tokenizer


@pytest.mark.parametrize("text", ASCII_TEXTS)
def test_ascii_text_round_trips_through_encode_and_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text, f"decode(encode(x)) should give back {text!r}"


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_multibyte_unicode_round_trips_through_encode_and_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text, f"decode(encode(x)) should give back {text!r}"


def test_multibyte_characters_are_split_across_tokens(tok: Tokenizer) -> None:
    # Precondition for the streaming tests below: they are only meaningful if
    # some token on its own decodes to an incomplete character.
    ids = tok.encode("😀 你好", add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids), (
        "expected at least one token of an emoji/CJK string to hold a partial UTF-8 character"
    )


def test_encode_prepends_bos_only_with_special_tokens(tok: Tokenizer) -> None:
    with_special = tok.encode("Hello")
    without = tok.encode("Hello", add_special_tokens=False)
    assert with_special[0] == tok.bos_token_id, "encode() should start with the BOS id"
    assert with_special[1:] == without, "encode() should only add BOS in front of the text ids"
    assert tok.bos_token_id not in without, "add_special_tokens=False should not add BOS"


def test_special_token_text_encodes_as_one_special_id(tok: Tokenizer) -> None:
    ids = tok.encode("<|user|>", add_special_tokens=False)
    assert ids == [tok.token_to_id("<|user|>")], "'<|user|>' in the text should be its special id"


def test_decode_skips_special_tokens_unless_asked_not_to(tok: Tokenizer) -> None:
    ids = tok.encode("<|user|>\nhi<|end|>\n")
    assert tok.decode(ids) == "\nhi\n", "special tokens should be dropped by default"
    assert tok.decode(ids, skip_special_tokens=False) == "<s><|user|>\nhi<|end|>\n", (
        "skip_special_tokens=False should keep the special tokens' text"
    )


def test_special_ids_and_vocab_size_come_from_the_model_files(
    tok: Tokenizer, model_dir: Path
) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert tok.vocab_size == config["vocab_size"], "vocab_size should match config.json"
    assert tok.bos_token_id == tok.token_to_id("<s>"), "bos_token_id should be the id of <s>"
    assert tok.eos_token_ids == (tok.token_to_id("</s>"), tok.token_to_id("<|end|>")), (
        "eos_token_ids should list generation_config.json's ids, </s> then <|end|>"
    )
    assert tok.eos_token_id == tok.token_to_id("</s>"), "eos_token_id should be the first eos id"
    expected = {
        tok.token_to_id(t)
        for t in ("<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
    }
    assert tok.all_special_ids == frozenset(expected), (
        "all six special tokens should be special ids"
    )


def test_id_to_token_and_token_to_id_are_inverse(tok: Tokenizer) -> None:
    for token_id in (0, 5, 100, tok.vocab_size - 1):
        token = tok.id_to_token(token_id)
        assert token is not None and tok.token_to_id(token) == token_id, (
            f"token_to_id(id_to_token({token_id})) should be {token_id}"
        )
    assert tok.convert_ids_to_tokens([0, 1]) == ["<s>", "</s>"], (
        "ids 0 and 1 should be <s> and </s>"
    )


def test_from_pretrained_without_tokenizer_json_names_the_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_int_eos_token_id_in_config_json_is_used_without_generation_config(
    model_dir: Path, tmp_path: Path
) -> None:
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_ids == (5,), "an int eos_token_id should become a one-element tuple"
    assert tok.eos_token_id == 5, "eos_token_id should come from config.json"
    assert tok.chat_template is None, "no tokenizer_config.json means no chat template"


def test_add_bos_token_false_removes_the_post_processor_bos(
    model_dir: Path, tmp_path: Path
) -> None:
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "add_bos_token": False})
    )
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.encode("Hello") == tok.encode("Hello", add_special_tokens=False), (
        "add_bos_token=false should stop encode() from adding BOS"
    )
    assert tok.encode("<s>Hello")[0] == tok.bos_token_id, "a BOS written in the text should be kept"


def test_add_bos_token_true_does_not_duplicate_bos(model_dir: Path, tmp_path: Path) -> None:
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "add_bos_token": True})
    )
    tok = Tokenizer.from_pretrained(tmp_path)
    ids = tok.encode("Hello")
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id, (
        "expected exactly one leading BOS"
    )


# -- how many characters a token stands for -------------------------------------------


def _altered(tok: Tokenizer, **sections) -> Tokenizer:
    """``tok`` with sections of its tokenizer.json replaced."""
    spec = json.loads(tok.backend().to_str())
    spec.update(sections)
    return Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec)))


def test_max_chars_per_token_is_the_longest_entry_and_bounds_the_worst_texts(tok: Tokenizer) -> None:
    bound = tok.max_chars_per_token()
    vocab = tok.backend().get_vocab(with_added_tokens=True)
    assert bound == max(len(t) for t in vocab) == 16, bound
    longest = sorted(vocab, key=len)[-30:]  # each repeated: the fewest tokens a text can have
    texts = [tok.decode([vocab[t]], skip_special_tokens=False) * 50 for t in longest]
    for text in [*texts, *ASCII_TEXTS, *UNICODE_TEXTS, PROMPT * 20]:
        tokens = len(tok.encode(text, add_special_tokens=False))
        assert len(text) <= bound * tokens, f"{text[:40]!r}: {len(text)} characters in {tokens} tokens"


@pytest.fixture(scope="session")
def max_chars(tok: Tokenizer) -> int:
    return tok.max_chars_per_token()


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_no_text_has_fewer_tokens_than_its_characters_over_max_chars_per_token(
    tok: Tokenizer, max_chars: int, text: str
) -> None:
    tokens = len(tok.encode(text, add_special_tokens=False))
    assert len(text) <= max_chars * tokens, f"{len(text)} characters in {tokens} tokens"


@pytest.mark.parametrize(
    "sections,factor",
    [
        ({"normalizer": {"type": "NFC"}}, 4),  # a character and three marks compose into one
        ({"normalizer": {"type": "Sequence", "normalizers": [
            {"type": "NFKC"}, {"type": "Replace", "pattern": {"String": "ab"}, "content": "c"}]}}, 8),
        ({"normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}}, 1),
    ],
)
def test_a_normalizer_that_shrinks_text_widens_the_bound(tok: Tokenizer, sections, factor) -> None:
    assert _altered(tok, **sections).max_chars_per_token() == 16 * factor


def _added_rstrip(tok: Tokenizer) -> list[dict]:
    added = json.loads(tok.backend().to_str())["added_tokens"]
    return [{**t, "rstrip": t["content"] == "<|user|>"} for t in added]


@pytest.mark.parametrize(
    "name,sections,text",
    [
        ("whitespace pre-tokenizer", {"pre_tokenizer": {"type": "Whitespace"}}, " " * 5000),
        ("stripping normalizer", {"normalizer": {"type": "Strip", "strip_left": True, "strip_right": True}},
         " " * 5000),
        ("regex replace", {"normalizer": {"type": "Replace", "pattern": {"Regex": "a+"}, "content": "a"}},
         "a" * 5000),
        ("no byte-level pre-tokenizer", {"pre_tokenizer": None}, "\u2603" * 5000),  # unknown: dropped
        ("added token with rstrip", {"added_tokens": None}, "<|user|>" + " " * 5000),
        ("truncation", {"truncation": {"direction": "Right", "max_length": 8, "strategy": "LongestFirst",
                                       "stride": 0}}, "hello world " * 500),
    ],
)
def test_a_tokenizer_that_can_drop_text_gives_no_bound(tok: Tokenizer, name, sections, text) -> None:
    if name == "added token with rstrip":
        sections = {"added_tokens": _added_rstrip(tok)}
    altered = _altered(tok, **sections)
    assert altered.max_chars_per_token() is None, name
    # Why: this text has far more characters than a 16-character bound allows for its tokens.
    assert len(altered.encode(text, add_special_tokens=False)) < len(text) / 16, name


def test_wordpiece_gives_no_bound_as_a_whole_word_can_be_one_unknown_token(tok: Tokenizer) -> None:
    wordpiece = {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                 "max_input_chars_per_word": 100, "vocab": {"[UNK]": 0, "a": 1}}
    altered = _altered(tok, model=wordpiece, added_tokens=[], post_processor=None, decoder=None,
                       pre_tokenizer={"type": "Whitespace"})
    assert altered.max_chars_per_token() is None
    assert altered.encode("b" * 5000, add_special_tokens=False) == [0]


@pytest.mark.parametrize(
    "text", [*ASCII_TEXTS, *UNICODE_TEXTS, "<|system|>\nBe brief.<|end|>\n<|assistant|>\n"]
)
def test_ids_match_transformers_auto_tokenizer(tok: Tokenizer, hf_tok, text: str) -> None:
    assert tok.encode(text) == hf_tok(text)["input_ids"], (
        f"ids for {text!r} should match HF AutoTokenizer"
    )
    assert (
        tok.encode(text, add_special_tokens=False)
        == hf_tok(text, add_special_tokens=False)["input_ids"]
    ), f"ids without special tokens for {text!r} should match HF AutoTokenizer"


# ----------------------------------------------------------------- chat template

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Name a river."},
]


def test_chat_template_renders_each_turn_and_the_generation_prompt(tok: Tokenizer) -> None:
    expected = (
        "<|system|>\nBe brief.<|end|>\n"
        "<|user|>\nHi!<|end|>\n"
        "<|assistant|>\nHello.<|end|>\n"
        "<|user|>\nName a river.<|end|>\n"
        "<|assistant|>\n"
    )
    assert tok.apply_chat_template(CONVERSATION) == expected, "unexpected chat prompt"
    assert tok.apply_chat_template(
        CONVERSATION, add_generation_prompt=False
    ) == expected.removesuffix("<|assistant|>\n"), (
        "add_generation_prompt=False should omit the trailing '<|assistant|>\\n'"
    )


def test_chat_template_matches_transformers(tok: Tokenizer, hf_tok) -> None:
    ours = tok.apply_chat_template(CONVERSATION)
    theirs = hf_tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert ours == theirs, "our rendering should match transformers' apply_chat_template"


def test_chat_template_rejects_unknown_roles(tok: Tokenizer) -> None:
    with pytest.raises(jinja2.TemplateError, match="unsupported chat role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "{}"}])


def test_apply_chat_template_without_template_raises_value_error(
    model_dir: Path, tmp_path: Path
) -> None:
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(CONVERSATION)


def test_chat_template_is_sandboxed(tok: Tokenizer) -> None:
    tok = Tokenizer(tok._tok, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template(CONVERSATION)


# ------------------------------------------------------- IncrementalDetokenizer


@pytest.mark.parametrize("text", UNICODE_TEXTS + ASCII_TEXTS[:3])
def test_streamed_deltas_concatenate_to_the_full_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    deltas, detok, _ = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids), "concatenated deltas should equal decode(all ids)"
    assert detok.output_text() == tok.decode(ids), "output_text() should equal decode(all ids)"
    assert not any("\ufffd" in d for d in deltas), (
        "no delta should contain a partial character (U+FFFD)"
    )


def test_output_text_never_ends_with_an_incomplete_character(tok: Tokenizer) -> None:
    ids = tok.encode("🌍🍞你好😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT))
    for token_id in ids:
        detok.update([token_id])
        assert not detok.output_text().endswith("\ufffd"), (
            f"output_text() {detok.output_text()!r} should not end with a partial character"
        )
    assert detok.output_text() == "🌍🍞你好😀", "all characters should be complete at the end"


def test_first_output_token_keeps_its_leading_space(tok: Tokenizer) -> None:
    ids = tok.encode(" world", add_special_tokens=False)
    deltas, _, _ = _stream(tok, ids, prompt="Hello")
    assert "".join(deltas) == " world", "the leading space of the first output token should be kept"


def test_finishing_mid_character_releases_it_like_a_full_decode(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀", add_special_tokens=False)
    truncated = ids[:-1]  # cut inside the emoji's bytes
    assert tok.decode(truncated).endswith("\ufffd"), "precondition: truncated ids end mid-character"
    deltas, _, _ = _stream(tok, truncated)
    assert "".join(deltas) == tok.decode(truncated), (
        "finishing should release the partial char as decode does"
    )


def test_special_tokens_are_skipped_or_kept_in_stream(tok: Tokenizer) -> None:
    ids = tok.encode("Hello<|end|>", add_special_tokens=False)
    skipped, _, _ = _stream(tok, ids)
    kept, _, _ = _stream(tok, ids, skip_special_tokens=False)
    assert "".join(skipped) == "Hello", "special tokens should not appear in the stream by default"
    assert "".join(kept) == "Hello<|end|>", (
        "skip_special_tokens=False should stream special tokens' text"
    )


def _spanning_stop(tok: Tokenizer, text: str, stop: str) -> list[int]:
    """Encode text and check that no single token contains ``stop``."""
    ids = tok.encode(text, add_special_tokens=False)
    assert stop in text and all(stop not in tok.decode([i]) for i in ids), (
        f"precondition: {stop!r} should span several tokens of {text!r}"
    )
    return ids


def test_stop_string_spanning_tokens_is_found_and_cut_before(tok: Tokenizer) -> None:
    text = "The river runs slowly through the valley. More text follows."
    ids = _spanning_stop(tok, text, "slowly through")
    deltas, detok, stop = _stream(tok, ids, stop=["slowly through"])
    assert stop == "slowly through", "update() should return the matched stop string"
    assert detok.stop_str == "slowly through", "stop_str should record the matched stop"
    assert detok.output_text() == "The river runs ", (
        "text should be cut right before the stop string"
    )
    assert "".join(deltas) == "The river runs ", "deltas should add up to the text before the stop"


def test_stop_string_is_kept_with_include_stop_str_in_output(tok: Tokenizer) -> None:
    text = "The river runs slowly through the valley."
    ids = _spanning_stop(tok, text, "slowly through")
    deltas, detok, stop = _stream(
        tok, ids, stop=["slowly through"], include_stop_str_in_output=True
    )
    assert stop == "slowly through", "update() should return the matched stop string"
    assert "".join(deltas) == "The river runs slowly through", (
        "text should end with the stop string"
    )
    assert detok.output_text() == "The river runs slowly through", (
        "output_text() should include the stop"
    )


def test_deltas_never_contain_part_of_a_stop_string_that_matches_later(tok: Tokenizer) -> None:
    text = "Answer: 42. END OF ANSWER and then junk"
    stop = "END OF ANSWER"
    ids = _spanning_stop(tok, text, stop)
    expected = text[: text.index(stop)]
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), stop=[stop])
    streamed = ""
    for token_id in ids:  # one token at a time, as a decode step delivers them
        matched = detok.update([token_id])
        streamed += detok.take_delta(finished=matched is not None)
        # Deltas cannot be taken back once sent, so every prefix must be clean.
        assert expected.startswith(streamed), (
            f"streamed text {streamed!r} should always be a prefix of {expected!r}"
        )
        if matched:
            break
    assert streamed == expected, f"the streamed text should stop right before {stop!r}"


def test_held_back_text_is_released_when_the_stop_string_does_not_complete(tok: Tokenizer) -> None:
    text = "We reached the END OF THE ROAD and kept walking."
    ids = tok.encode(text, add_special_tokens=False)
    deltas, _, stop = _stream(tok, ids, stop=["END OF ANSWER"])
    assert stop is None, "a stop string that never completes should not match"
    assert "".join(deltas) == text, (
        "text held back as a possible stop prefix should be released later"
    )


def test_earliest_of_several_stop_strings_wins(tok: Tokenizer) -> None:
    text = "alpha beta gamma delta"
    ids = tok.encode(text, add_special_tokens=False)
    # All of the text arrives in one update, so both stops are visible at once.
    deltas, _, stop = _stream(tok, ids, stop=["delta", "beta"], chunk_sizes=[len(ids)])
    assert stop == "beta", "the stop string occurring first in the text should win"
    assert "".join(deltas) == "alpha ", "text should be cut before the earliest stop"


def test_stop_string_of_multibyte_characters_is_found(tok: Tokenizer) -> None:
    text = "Greeting: 你好，世界 and more"
    ids = tok.encode(text, add_special_tokens=False)
    deltas, _, stop = _stream(tok, ids, stop=["世界"])
    assert stop == "世界", "a CJK stop string should match"
    assert "".join(deltas) == "Greeting: 你好，", "text should be cut before the CJK stop string"


def test_tokens_after_a_stop_are_ignored(tok: Tokenizer) -> None:
    ids = tok.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["two"])
    assert detok.update(ids) == "two", "the stop should match in the first update"
    assert detok.update(tok.encode(" more", add_special_tokens=False)) is None, (
        "update() after a stop should not report another stop"
    )
    assert detok.output_text() == "one ", "tokens after the stop should not change the text"
    assert detok.take_delta() == "one ", "after a stop the remaining text is released at once"


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(
        alphabet=st.sampled_from([*"ab c,.\n", "é", "你", "好", "😀", "🌍", "👍"]),
        max_size=40,
    ),
    stop=st.text(alphabet=st.sampled_from([*"ab c", "你", "😀"]), min_size=1, max_size=4),
    chunks=st.lists(st.integers(min_value=1, max_value=4), max_size=40),
    include_stop=st.booleans(),
)
def test_streaming_matches_cutting_the_full_text_at_the_first_stop(
    tok: Tokenizer, text: str, stop: str, chunks: list[int], include_stop: bool
) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    idx = full.find(stop)
    if idx == -1:
        expected = full
    else:
        expected = full[: idx + len(stop)] if include_stop else full[:idx]
    deltas, _, _ = _stream(
        tok, ids, stop=[stop], chunk_sizes=chunks, include_stop_str_in_output=include_stop
    )
    assert "".join(deltas) == expected, (
        f"streaming {text!r} with stop {stop!r} should give {expected!r}"
    )


def test_a_single_stop_string_is_not_split_into_characters(tok: Tokenizer) -> None:
    ids = tok.encode("one two three", add_special_tokens=False)
    deltas, _, stop = _stream(tok, ids, stop="three")
    assert stop == "three", "a bare string should act as one stop string"
    assert "".join(deltas) == "one two ", "text should be cut before 'three', not at the letter 'e'"


@pytest.mark.parametrize("text", ["ok 😀 你好 done", "a\u00e2 stray lead byte then text"])
def test_a_migrated_stream_resumes_with_the_text_its_first_worker_had_sent(tok: Tokenizer, text: str) -> None:
    """``skip(ids[:k])`` leaves the state streaming ``ids[:k]`` one step at a time left:
    what is streamed after it is what the first worker would have streamed, at every
    split, also right after a token that ends mid-character (or holds a byte that never
    becomes a character)."""
    ids = tok.encode(text, add_special_tokens=False)
    if "\u00e2" in text:  # a lone UTF-8 lead byte (0xE2, 'â' in the byte-level alphabet) in mid-output
        stray = tok.token_to_id("\u00e2")
        assert stray is not None
        ids = tok.encode("a", add_special_tokens=False) + [stray] + tok.encode(" then text", add_special_tokens=False)
    splits = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
    assert splits, "the text should have a split right after a token that ends mid-character"
    whole, _, _ = _stream(tok, ids)
    for k in range(1, len(ids)):
        resumed = IncrementalDetokenizer(tok, tok.encode(PROMPT))
        resumed.skip(ids[:k])
        deltas = []
        for token_id in ids[k:]:
            resumed.update([token_id])
            deltas.append(resumed.take_delta())
        deltas.append(resumed.take_delta(finished=True))
        assert "".join(whole[:k]) + "".join(deltas) == "".join(whole), f"resumed after {k} tokens"
