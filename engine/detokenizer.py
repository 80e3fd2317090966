"""Token ids back to text, as a stream: ``IncrementalDetokenizer``.

It turns a growing list of a request's generated token ids into text deltas for
streaming, correct across multi-byte characters split over tokens and stop strings
spanning token boundaries (``engine.stop_strings`` finds them). It decodes through an
``engine.tokenizer.Tokenizer``, which owns the rest of tokenization (and re-exports
this class, where it lived first); the output processor (``engine.output_processor``)
keeps one per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.stop_strings import StopMatcher

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

# What a byte-level decoder emits for bytes that do not (yet) form a complete
# UTF-8 character.
_REPLACEMENT_CHAR = "\ufffd"

# How many prompt tokens the incremental detokenizer decodes as left context.
# Some decoders (SentencePiece/Metaspace) strip the leading space of the first
# token they see; giving them a few tokens of context makes the first output
# token decode exactly as it would inside the full sequence. vLLM uses 5 too.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas, correct across
    multi-byte characters (byte-level BPE emits partial UTF-8 as U+FFFD until
    completed) and stop strings spanning tokens.

    Usage per request::

        detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["\\n\\n"])
        for step_ids in generated:
            stop = detok.update(step_ids)
            send(detok.take_delta(finished=stop is not None))
            if stop is not None:
                break

    Each update decodes only a small window of tokens (vLLM's
    ``prefix_offset`` / ``read_offset`` scheme): ``prefix_offset..read_offset``
    is text already emitted, kept as left context, and ``read_offset..`` holds
    the tokens whose text is not emitted yet. Decoding the window and cutting
    off the context's text yields the new text without re-decoding the whole
    output, and without the surprises of decoding a token in isolation.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._include_stop = include_stop_str_in_output
        if isinstance(stop, str):
            stop = (stop,)  # not a sequence of one-character stop strings
        # An empty stop string would match immediately; it is meaningless.
        stops = tuple(s for s in stop if s)
        self._stops = StopMatcher(stops)
        # Text ending in the last len(stop)-1 chars may be the start of a stop
        # string, so take_delta must not release it yet.
        self._holdback = max((len(s) for s in stops), default=1) - 1

        # The decode window: _ids[:_read_offset] is context whose text was
        # already emitted, _ids[_read_offset:] is pending. vLLM's prefix_offset
        # is always 0 here because ids before the window are dropped as it
        # slides, which keeps memory bounded. It starts with the prompt's tail.
        self._ids: list[int] = [int(i) for i in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]]
        self._read_offset = len(self._ids)

        self._text = ""  # decoded output so far (complete characters only)
        self._sent = 0  # chars of _text already returned by take_delta
        self._stop_str: str | None = None
        self._flushed = False

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stop_str

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Append generated tokens; return the stop string they completed, if any.

        When a stop string matches, the text is cut before it (or just after
        it with ``include_stop_str_in_output``) and later tokens are ignored.
        """
        if self._stop_str is not None or self._flushed:
            return None
        self._ids.extend(int(i) for i in new_token_ids)
        return self._advance(force=False)

    def skip(self, streamed_token_ids: Sequence[int]) -> None:
        """Take in tokens whose text another worker already streamed (a migrated
        request), leaving the state that worker had: their text counts as sent.

        They go in one at a time, as that worker's steps fed them: fed at once, tokens
        ending mid-character would all stay pending and be sent a second time.
        """
        for token_id in streamed_token_ids:
            self.update((token_id,))
        self.take_delta()

    def output_text(self) -> str:
        """The full output text so far, cut at the stop string if one matched.

        Until ``take_delta(finished=True)`` it never ends with an incomplete
        character: bytes of a partial character stay pending.
        """
        return self._text

    def take_delta(self, finished: bool = False) -> str:
        """Return the text produced since the previous call.

        While not finished, the last ``len(longest stop) - 1`` characters are
        held back because they might begin a stop string. With ``finished``
        everything is released, including any trailing partial character (as
        U+FFFD, exactly as a full decode would show it).
        """
        if finished and self._stop_str is None and not self._flushed:
            self._advance(force=True)
            self._flushed = True
        if finished or self._stop_str is not None:
            # The text is final: nothing more can extend it into a stop string.
            end = len(self._text)
        else:
            end = max(self._sent, len(self._text) - self._holdback)
        delta = self._text[self._sent : end]
        self._sent = end
        return delta

    def _advance(self, *, force: bool) -> str | None:
        """Decode pending tokens into ``_text`` and look for stop strings.

        Without ``force``, pending tokens whose text ends in an incomplete
        character stay pending until a later token completes it.
        """
        if self._read_offset >= len(self._ids):
            return None
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[: self._read_offset], self._skip_special_tokens)
        full_text = decode(self._ids, self._skip_special_tokens)
        # A trailing U+FFFD means the last token ended mid-character. Shorter
        # text means the new tokens decode to nothing yet (e.g. skipped special
        # tokens); waiting keeps the window so the context stays valid.
        if not force and (
            len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR)
        ):
            return None

        new_text = full_text[len(prefix_text) :]
        # Slide the window: the tokens just emitted become the next context.
        self._ids = self._ids[self._read_offset :]
        self._read_offset = len(self._ids)

        self._text += new_text
        return self._check_stop()

    def _check_stop(self) -> str | None:
        """Look for a stop string ending in the new text (``engine.stop_strings`` says
        which wins); on a match, cut the text there and remember it."""
        match = self._stops.find(self._text)
        if match is None:
            return None
        idx, stop = match
        self._text = self._text[: idx + len(stop) if self._include_stop else idx]
        self._stop_str = stop
        return stop
