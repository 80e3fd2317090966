"""Stop strings: where a request's growing output text first completes one.

What it owns: one automaton (Aho-Corasick) over a request's stop strings, and how much
of the text it has read. The detokenizer only appends to the text, so each step reads
just the new characters: a step costs its new text's length, whatever the number and
length of the stop strings. (A ``str.find`` per stop string and step cost a Python call
each: 110k strings took 28 ms a token. A regex alternation is no better: Python's
engine tries every string at every position, quadratic on text that nearly matches
long strings.) Building costs the strings' total length, once per request;
``SamplingParams`` bounds it (``MAX_STOP_STRINGS`` of ``MAX_STOP_STRING_LEN``).

Which match wins (vLLM's rule): of the matches that end in the new text, the one that
starts first; of those starting there, the stop string listed first. None of them ends
in text read before: a match there would have ended the request then.

Lifecycle::

    built (at the root) ─▶ find(text) each step: reads what is new ─▶ ... ─▶ a match
    (the request stops; it is not asked again)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

__all__ = ["StopMatcher"]


class StopMatcher:
    """Finds the first stop string a growing text completes, reading each character once."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        # The trie: node 0 is the root; _goto[node] maps a character to the next node.
        self._goto: list[dict[str, int]] = [{}]
        # The longest stop string that ends the text a node stands for (0: none).
        self._longest: list[int] = [0]
        for stop in self._stops:
            self._insert(stop)
        self._fail = self._link()
        self._node = 0  # where the text read so far leads
        self._read = 0  # characters of the text read so far

    def _insert(self, stop: str) -> None:
        node = 0
        for ch in stop:
            child = self._goto[node].get(ch)
            if child is None:
                child = len(self._goto)
                self._goto[node][ch] = child
                self._goto.append({})
                self._longest.append(0)
            node = child
        self._longest[node] = len(stop)

    def _link(self) -> list[int]:
        """Each node's failure link (the node of its longest proper suffix in the trie),
        breadth first; a node's longest match is its own string or its link's."""
        goto, longest = self._goto, self._longest
        fail = [0] * len(goto)
        queue = deque(goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in goto[node].items():
                link = fail[node]
                while link and ch not in goto[link]:
                    link = fail[link]
                fail[child] = goto[link].get(ch, 0)
                longest[child] = longest[child] or longest[fail[child]]
                queue.append(child)
        return fail

    def find(self, text: str) -> tuple[int, str] | None:
        """Read what ``text`` adds to the text of the previous call (it must extend it) and
        return the winning match ending in it as (start index, stop string), or None."""
        if not self._stops:
            return None
        goto, fail, longest = self._goto, self._fail, self._longest
        node, start, first = self._node, self._read, None
        for end, ch in enumerate(text[start:], start + 1):  # end: just past ch
            while node and ch not in goto[node]:
                node = fail[node]
            node = goto[node].get(ch, 0)
            n = longest[node]
            if n and (first is None or end - n < first):
                first = end - n
        self._node, self._read = node, len(text)
        if first is None:
            return None
        # Several strings may start there (one a prefix of another): the first listed wins.
        return first, next(s for s in self._stops if text.startswith(s, first) and first + len(s) > start)
