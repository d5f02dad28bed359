"""A large JSON document read one value at a time.

``json.loads`` builds every object of a document before the caller sees any: for the
index of 100,000 tensors, about 90 MiB of lists, strings and ints that the caller turns
into other objects and drops. :class:`JsonCursor` walks the document instead: the
members of an object and the elements of an array are handed over one by one, each
parsed by ``json``'s own C scanner (what ``JSONDecoder.raw_decode`` calls), so only one element's
objects exist besides what the caller keeps. What it accepts is what ``json.loads``
accepts (the same scanner, whitespace as JSON defines it, nothing after the document).

Example:
    >>> cursor = JsonCursor('{"a": [1, [2]], "b": {"c": null}}')
    >>> [(k, list(cursor.elements()) if k == "a" else cursor.value()) for k in cursor.members()]
    [('a', [1, [2]]), ('b', {'c': None})]
    >>> cursor.end()
"""

from __future__ import annotations

import json
import json.scanner
import re
from collections.abc import Callable, Container, Iterator
from typing import Any

_WHITESPACE = re.compile(r"[ \t\n\r]*")
# The C scanner, as JSONDecoder.raw_decode calls it (same options as json.loads).
_scan_once: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(
    json.JSONDecoder()  # type: ignore[arg-type]  # typeshed names the wrong class
)


# json's string scanner: the string starting after the quote at ``pos``, and the
# position after its closing quote (ValueError where it is not a JSON string).
scan_string: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]


def _scan(text: str, pos: int) -> tuple[Any, int]:
    """The value starting at ``pos`` and the position after it."""
    try:
        return _scan_once(text, pos)
    except StopIteration as err:
        raise json.JSONDecodeError("Expecting value", text, err.value) from None


_SPACE = frozenset(" \t\n\r")  # "" (the end) is not in it


def json_text(data: bytes) -> str:
    """``data`` as text, in the encoding ``json.loads`` would detect (UTF-8/16/32)."""
    return data.decode(json.detect_encoding(data), "surrogatepass")


class JsonCursor:
    """A position in a JSON text; see the module docstring.

    Raises (from every method):
        json.JSONDecodeError: the text is not JSON of the shape asked for.
    """

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.dropped = 0  # elements a selected walk did not yield (see elements)

    def peek(self) -> str:
        """The next character that is not whitespace ("" at the end)."""
        self.pos = _WHITESPACE.match(self.text, self.pos).end()  # type: ignore[union-attr]
        return self.text[self.pos : self.pos + 1]

    def _expect(self, char: str, what: str) -> None:
        if self.peek() != char:
            raise json.JSONDecodeError(f"expected {what}", self.text, self.pos)
        self.pos += 1

    def value(self) -> Any:
        """The whole value at the cursor, as ``json.loads`` makes it."""
        text = self.text
        if text[self.pos : self.pos + 1] in _SPACE:
            self.peek()
        value, self.pos = _scan(text, self.pos)
        return value

    def _after(self, close: str) -> bool:
        """After a member or element: True at a comma (skipped), False at ``close``."""
        char = self.text[self.pos : self.pos + 1]
        if char in _SPACE:  # (compact JSON, as this library writes it, has none)
            char = self.peek()
        self.pos += 1
        if char == ",":
            return True
        if char != close:
            raise json.JSONDecodeError(f"expected ',' or '{close}'", self.text, self.pos - 1)
        return False

    def members(self) -> Iterator[str]:
        """The keys of the object at the cursor; after each, the caller reads its value
        (:meth:`value`, :meth:`elements` or :meth:`members`) before asking for the next."""
        self._expect("{", "an object")
        if self.peek() == "}":
            self.pos += 1
            return
        text = self.text
        while True:
            if self.peek() != '"':
                raise json.JSONDecodeError("expected a key", text, self.pos)
            key, self.pos = _scan(text, self.pos)
            if text[self.pos : self.pos + 1] == ":":
                self.pos += 1
            else:
                self._expect(":", "':'")
            start = self.pos
            yield key
            if self.pos == start:  # the caller did not read the value: skip it
                self.value()
            if not self._after("}"):
                return

    def elements(
        self, select: tuple[re.Pattern[str], Container[str]] | None = None
    ) -> Iterator[Any]:
        """The elements of the array at the cursor, each parsed whole.

        ``select=(tail, wanted)``: only the elements whose first item (their key) is
        in ``wanted`` are yielded, and those that have no first item (for the caller
        to refuse). An element that is an array starting with a string not in
        ``wanted`` is stepped over without being parsed where ``tail`` matches what
        follows the string, else parsed and dropped (so is any other element whose
        first item is not wanted). ``tail`` must match only what completes a valid JSON
        array, so that what is accepted stays what ``json.loads`` accepts.
        :attr:`dropped` counts the elements not yielded.
        """
        if select is not None:
            return self._selected(*select)
        return self._elements()

    def _elements(self) -> Iterator[Any]:
        if not self._opened():
            return
        text, after = self.text, self._after
        while True:
            if text[self.pos : self.pos + 1] in _SPACE:
                self.peek()
            value, self.pos = _scan(text, self.pos)
            yield value
            if text[self.pos : self.pos + 1] == ",":  # the usual case, inline
                self.pos += 1
            elif not after("]"):
                return

    def _opened(self) -> bool:
        """Past the ``[`` of an array: False where it is empty (then past it)."""
        self._expect("[", "an array")
        if self.peek() == "]":
            self.pos += 1
            return False
        return True

    def _selected(self, tail: re.Pattern[str], wanted: Container[str]) -> Iterator[Any]:
        if not self._opened():
            return
        text, match, after = self.text, tail.match, self._after
        # After a wanted element the next is parsed at once (a run of wanted ones costs
        # about what a plain walk costs); after another, its key is read first.
        parse = False
        while True:
            pos = self.pos
            if not parse and text[pos : pos + 2] == '["':  # the key, by json's scanner
                try:
                    key, end = scan_string(text, pos + 2)
                except ValueError:  # not a string: parsed below, which raises json's error
                    key, end = None, pos
                if key is not None and key not in wanted and (skipped := match(text, end)):
                    self.dropped += 1
                    pos = skipped.end()
                    if text[pos : pos + 1] == ",":  # the usual case, inline
                        self.pos = pos + 1
                        continue
                    self.pos = pos
                    if not after("]"):
                        return
                    continue
            if text[pos : pos + 1] in _SPACE:
                self.peek()
            value, self.pos = _scan(text, self.pos)
            try:
                parse = value[0] in wanted
            except (TypeError, LookupError):  # no first item (or an unhashable one)
                parse = False
                yield value
            else:
                if parse:
                    yield value
                else:
                    self.dropped += 1
            if text[self.pos : self.pos + 1] == ",":
                self.pos += 1
            elif not after("]"):
                return

    def end(self) -> None:
        """Check that nothing but whitespace follows."""
        if self.peek():
            raise json.JSONDecodeError("extra data", self.text, self.pos)


__all__ = ["JsonCursor", "json_text", "scan_string"]
