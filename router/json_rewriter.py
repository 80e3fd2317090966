"""``JsonRewriter``: a JSON value read as its text arrives and written again as
``json.dumps`` writes it, so that a streamed tool call's argument pieces add up to the
arguments of the whole output's parse. Pure: no Ray, no torch."""

from __future__ import annotations

import enum
import json
import re
import string

_JSON_WS = re.compile(r"[ \t\n\r]*")  # JSON's blanks (inside and around a JSON text)
_LITERAL_CHARS = frozenset(string.ascii_letters + string.digits + "+-.")
_LITERAL_END = re.compile(r"[^0-9A-Za-z+\-.]")
_STRING_STOP = re.compile(r'["\\]')


class _Want(enum.IntEnum):
    """What a JSON text takes next: up to ITEM a value, up to MEMBER a key."""

    VALUE = 0  # after ":" or an array's ","
    ITEM = 1  # after "[": a value or "]"
    KEY = 2  # after an object's ","
    MEMBER = 3  # after "{": a key or "}"
    COLON = 4
    NEXT = 5  # after a value in a container: "," or the container's close


class _Token(enum.IntEnum):
    NONE = 0
    KEY = 1
    STRING = 2
    LITERAL = 3  # a number, true, false, null (or NaN and Infinity, which json takes)


def _string_stop(text: str, i: int, limit: int) -> tuple[int, bool]:
    """How far a JSON string's characters from ``i`` may be decoded now, and whether
    the string closes there: an escape waits until it is whole, and a high surrogate's
    escape until the six characters after it (its pair, perhaps) have come."""
    while m := _STRING_STOP.search(text, i, limit):
        k = m.start()
        if text[k] == '"':
            return k, True
        if k + 1 == limit or (text[k + 1] == "u" and k + 6 > limit):
            return k, False
        if text[k + 1] != "u":
            i = k + 2
        elif "d800" <= text[k + 2:k + 6].lower() <= "dbff" and k + 12 > limit:
            return k, False
        else:
            i = k + 6
    return limit, False


class JsonRewriter:
    """One JSON value read as its text arrives, and written again as ``json.dumps(value,
    ensure_ascii=False)`` writes the value ``json.loads`` makes of it, as far as that is
    certain: ``out`` only grows, since that writes each part of a value apart (blanks
    dropped, ", " and ": " between parts, a string's characters escaped each alone, a
    number or literal as Python writes what it reads).

    ``read`` goes on from where it stopped, in the same text grown longer. A string's
    characters go to ``out`` as they come, a key or a number once it ends. ``broken`` once the
    text cannot be JSON (an object that gives a key twice included); ``end``, the index
    past the value, once it is whole. For an object, ``members`` holds where each of its
    values lies in ``out`` (the end None while it is read).
    """

    def __init__(self, start: int) -> None:
        self.start = start  # the value's first character in the text
        self.pos = start  # the next character to read
        self.out = ""
        self.stack: list[set[str] | None] = []  # each open container: an object's keys so far, None for an array
        self.want = _Want.VALUE
        self.token = _Token.NONE  # a string or literal begun and not yet ended
        self.token_at = 0  # a key's or a literal's first character in the text
        self.key = ""  # the outer object's key whose value comes next
        self.members: dict[str, tuple[int, int | None]] = {}
        self.broken = False
        self.end: int | None = None

    def read(self, text: str, limit: int) -> None:
        """Read on in ``text`` up to ``limit`` (or until the value ends or breaks)."""
        more = True
        while more and self.pos < limit and self.end is None and not self.broken:
            if self.token is _Token.LITERAL:
                more = self._literal(text, limit)
            elif self.token:
                more = self._string(text, limit)
            else:
                more = self._mark(text, limit)

    def _mark(self, text: str, limit: int) -> bool:
        """The next structural character, or the start of a string or a literal."""
        i = _JSON_WS.match(text, self.pos, limit).end()
        self.pos = i
        if i == limit:
            return False
        c, want = text[i], self.want
        in_object = bool(self.stack) and self.stack[-1] is not None
        self.pos = i + 1
        if c == '"' and want <= _Want.ITEM:
            self._value_begins()
            self.token, self.out = _Token.STRING, self.out + c
        elif c == '"' and want <= _Want.MEMBER:
            self.token, self.token_at = _Token.KEY, i
        elif c in "{[" and want <= _Want.ITEM:
            self._value_begins()
            self.out += c
            self.stack.append(set() if c == "{" else None)
            self.want = _Want.MEMBER if c == "{" else _Want.ITEM
        elif c in "}]" and in_object == (c == "}") and want in (_Want.NEXT, _Want.MEMBER if in_object else _Want.ITEM):
            self.out += c
            self.stack.pop()
            self._value_ends()
        elif c == ":" and want is _Want.COLON:
            self.out, self.want = self.out + ": ", _Want.VALUE
        elif c == "," and want is _Want.NEXT:
            self.out, self.want = self.out + ", ", _Want.KEY if in_object else _Want.VALUE
        elif c in _LITERAL_CHARS and want <= _Want.ITEM:
            self._value_begins()
            self.token, self.token_at = _Token.LITERAL, i
        else:
            self.broken = True
        return True

    def _string(self, text: str, limit: int) -> bool:
        end, closed = _string_stop(text, self.pos, limit)
        if self.token is _Token.KEY:
            return closed and self._key(text, end)
        if end > self.pos:
            try:
                chars = json.loads(f'"{text[self.pos:end]}"')
            except ValueError:  # a bad escape, a raw control character
                self.broken = True
                return False
            self.out += json.dumps(chars, ensure_ascii=False)[1:-1]
            self.pos = end
        if not closed:
            return False
        self.pos, self.out = end + 1, self.out + '"'
        self._value_ends()
        return True

    def _key(self, text: str, end: int) -> bool:
        """A key, whole: it goes out once known to be new to its object."""
        try:
            key = json.loads(text[self.token_at:end + 1])
        except ValueError:
            key = None
        if key is None or key in self.stack[-1]:
            self.broken = True
            return False
        self.stack[-1].add(key)
        self.pos, self.out = end + 1, self.out + json.dumps(key, ensure_ascii=False)
        self.token, self.want = _Token.NONE, _Want.COLON
        if len(self.stack) == 1:
            self.key = key
        return True

    def _literal(self, text: str, limit: int) -> bool:
        m = _LITERAL_END.search(text, self.pos, limit)
        if m is None:
            self.pos = limit
            return False
        try:
            value = json.loads(text[self.token_at:m.start()])
        except ValueError:
            self.broken = True
            return False
        self.pos, self.out = m.start(), self.out + json.dumps(value)
        self._value_ends()
        return True

    def _value_begins(self) -> None:
        if len(self.stack) == 1 and self.stack[0] is not None:
            self.members[self.key] = (len(self.out), None)

    def _value_ends(self) -> None:
        self.token = _Token.NONE
        if not self.stack:
            self.end = self.pos
            return
        if len(self.stack) == 1 and self.stack[0] is not None:
            self.members[self.key] = (self.members[self.key][0], len(self.out))
        self.want = _Want.NEXT


