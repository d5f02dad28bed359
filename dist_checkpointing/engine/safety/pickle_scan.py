"""Bounds checked on a pickle's opcodes before any unpickler runs: :func:`check_pickle`.

Two attacks cost a crafted pickle almost nothing and no unpickler can stop once it
has started:

* nesting: a ~1 MB pickle of a tuple nested 500,000 deep, used as a dict key, makes
  CPython hash it recursively in C and the process dies with SIGSEGV;
* hash collisions: dict keys whose hashes collide (large ints, floats, tuples of
  ``-1``/``-2``) make each insertion scan all the others: 0.5 MB takes minutes.

The scan simulates the unpickler's stack with a depth per object and refuses a
pickle that nests deeper than :data:`MAX_DEPTH`, or that inserts more than
:data:`MAX_COLLIDABLE_KEYS` keys of a type whose hash a file can make collide.
Strings and bytes (whose hashes are randomized per process) and small ints (which
hash to themselves) are not counted. Files with few container opcodes skip the scan
(they cannot nest deeply nor hold many keys). Pure Python: about a second per
megabyte, so it runs on ``torch.save`` payloads (``common.pt``, objects), not on
``.metadata`` (see :mod:`.metadata` for how that is bounded).

It only reads: anything it does not understand is left to the unpickler.
"""

from __future__ import annotations

import struct

from dist_checkpointing.errors import CorruptCheckpointError

MAX_DEPTH = 512
MAX_COLLIDABLE_KEYS = 4096
# BUILDs on an object already referenced elsewhere (from the memo): each can add up to
# MAX_DEPTH to the real depth of what references it without the scan seeing it.
MAX_SHARED_BUILDS = 16

# Key kinds: 0 safe (str, bytes, None, bool, small int), 1 collidable.
_SAFE, _COLLIDABLE = 0, 1

_FIXED = {  # opcode -> bytes of argument
    **{ord("K"): 1, ord("M"): 2, ord("J"): 4, ord("G"): 8, ord("h"): 1, ord("j"): 4},
    **{ord("q"): 1, ord("r"): 4, 0x82: 1, 0x83: 2, 0x84: 4, 0x80: 1, 0x95: 8},
}
_LEN1 = {0x8A, ord("U"), ord("C"), 0x8C}  # 1-byte length, then data
_LEN4 = {0x8B, ord("T"), ord("B"), ord("X")}
_LEN8 = {0x8E, 0x96, 0x8D}
_LINE = {ord(c) for c in "ILSVFgpP"}
_TWO_LINES = {ord("c"), ord("i")}
_LEAF = {ord(c) for c in "N"} | {0x88, 0x89, 0x97}
_COLLIDABLE_LEAF = {ord("I"), ord("L"), 0x8A, 0x8B, ord("F"), ord("G")}
_EMPTY = {ord(c) for c in "])}"} | {0x8F}
_MARK_BUILD = {ord(c) for c in "tld"} | {0x91}


class _TooDeep(Exception):
    pass


def _arg_end(data: bytes, pos: int, op: int) -> int:
    """The position after the argument of ``op`` that starts at ``pos``."""
    if op in _FIXED:
        return pos + _FIXED[op]
    if op in _LEN1:
        return pos + 1 + data[pos]
    if op in _LEN4:
        return pos + 4 + int(struct.unpack_from("<I", data, pos)[0])
    if op in _LEN8:
        return pos + 8 + int(struct.unpack_from("<Q", data, pos)[0])
    if op in _LINE:
        return data.index(b"\n", pos) + 1
    if op in _TWO_LINES:
        return data.index(b"\n", data.index(b"\n", pos) + 1) + 1
    return pos


def check_pickle(data: bytes | bytearray | memoryview, source: str) -> None:
    """Refuse a pickle that nests too deeply or holds too many collidable dict keys.

    Raises:
        CorruptCheckpointError: naming ``source`` and the bound exceeded.
    """
    raw = bytes(data)
    # Cheap screen: nesting needs a nesting opcode per level, and every key is at
    # least one byte; a file below both bounds needs no scan.
    nesting = sum(map(raw.count, (b"\x85", b"\x86", b"\x87", b"t", b"\x91", b"b", b"R")))
    if len(raw) <= MAX_COLLIDABLE_KEYS and nesting < MAX_DEPTH:
        return
    try:
        _Scanner(raw).run()
    except _TooDeep as exc:
        raise CorruptCheckpointError(f"{source}: refusing to unpickle: {exc}") from None
    except (IndexError, ValueError, KeyError, struct.error):
        return  # malformed: the unpickler reports it


_SIMPLE_LEAF = _LEN1 | _LEN4 | _LEN8 | _LEAF | {ord("S"), ord("V")}
_TUPLES = {0x85: 1, 0x86: 2, 0x87: 3}
_CALLS = {ord("R"): 2, 0x81: 2, 0x92: 3}


class _Scanner:
    """The unpickler's stack, simulated with a depth and a key kind per object."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.depth: list[int] = []  # per object created
        self.kind: list[int] = []
        self.shared: set[int] = set()  # objects referenced more than once
        self.stack: list[int] = []  # object ids
        self.marks: list[int] = []
        self.memo: dict[int, int] = {}
        self.collidable = 0
        self.shared_builds = 0

    def run(self) -> None:
        data, pos, n = self.data, 0, len(self.data)
        while pos < n:
            op = data[pos]
            start = pos + 1
            pos = _arg_end(data, start, op)
            if op == ord("."):
                return
            if not (
                self._leaf(op, start, pos)
                or self._container(op)
                or self._memo(op, start, pos)
                or self._other(op)
            ):
                return  # an opcode the unpickler will refuse

    def _new(self, d: int, k: int = _COLLIDABLE) -> None:
        if d > MAX_DEPTH:
            raise _TooDeep(f"it nests deeper than {MAX_DEPTH} levels")
        self.depth.append(d)
        self.kind.append(k)
        self.stack.append(len(self.depth) - 1)

    def _grow(self, obj: int, d: int) -> None:
        if d > MAX_DEPTH:
            raise _TooDeep(f"it nests deeper than {MAX_DEPTH} levels")
        self.depth[obj] = max(self.depth[obj], d)

    def _keys(self, keys: list[int]) -> None:
        self.collidable += sum(self.kind[k] for k in keys)
        if self.collidable > MAX_COLLIDABLE_KEYS:
            raise _TooDeep(
                f"it inserts more than {MAX_COLLIDABLE_KEYS} dict keys or set items whose "
                "hashes a file can make collide (large ints, floats, tuples)"
            )

    def _pop(self, count: int) -> list[int]:
        items = self.stack[len(self.stack) - count :] if count else []
        del self.stack[len(self.stack) - len(items) :]
        if len(items) != count:
            raise IndexError("stack underflow")
        return items

    def _pop_mark(self) -> list[int]:
        return self._pop(len(self.stack) - self.marks.pop())

    def _max(self, items: list[int]) -> int:
        return max((self.depth[i] for i in items), default=0)

    def _leaf(self, op: int, start: int, end: int) -> bool:
        if op in (ord("J"), ord("K"), ord("M")):
            value = int.from_bytes(self.data[start:end], "little", signed=op == ord("J"))
            self._new(0, _COLLIDABLE if value in (-1, -2) else _SAFE)
        elif op == ord("I"):
            value = int(self.data[start : end - 1] or b"0")
            self._new(0, _SAFE if 0 <= value < 1 << 60 else _COLLIDABLE)
        elif op in _COLLIDABLE_LEAF:
            self._new(0)
        elif op in _SIMPLE_LEAF:
            self._new(0, _SAFE)
        elif op in _EMPTY:
            self._new(1)
        elif op in (ord("c"), ord("P"), 0x82, 0x83, 0x84):
            self._new(0)
        else:
            return False
        return True

    def _container(self, op: int) -> bool:
        if op == ord("("):
            self.marks.append(len(self.stack))
        elif op in _MARK_BUILD or op in (ord("i"), ord("o")):
            items = self._pop_mark()
            self._keys(items if op == 0x91 else items[::2] if op == ord("d") else [])
            self._new(self._max(items) + 1, _SAFE if op in (ord("i"), ord("o")) else _COLLIDABLE)
        elif op in _TUPLES:
            self._new(self._max(self._pop(_TUPLES[op])) + 1)
        elif op in (ord("a"), ord("s")):
            items = self._pop(2 if op == ord("s") else 1)
            self._keys(items[:1] if op == ord("s") else [])
            self._grow(self.stack[-1], self._max(items) + 1)
        elif op in (ord("e"), ord("u"), 0x90):
            items = self._pop_mark()
            self._keys(items[::2] if op == ord("u") else items if op == 0x90 else [])
            if items:
                self._grow(self.stack[-1], self._max(items) + 1)
        elif op == ord("b"):
            (state,) = self._pop(1)
            if self.stack[-1] in self.shared:
                self.shared_builds += 1
                if self.shared_builds > MAX_SHARED_BUILDS:
                    raise _TooDeep(
                        f"it sets the state of more than {MAX_SHARED_BUILDS} shared objects"
                    )
            self._grow(self.stack[-1], self.depth[state] + 1)
        elif op in _CALLS:  # an instance: hashed by its class, not collidable here
            self._new(self._max(self._pop(_CALLS[op])) + 1, _SAFE)
        else:
            return False
        return True

    def _memo(self, op: int, start: int, end: int) -> bool:
        if op in (ord("h"), ord("j"), ord("g")):
            obj = self.memo[self._index(op, start, end)]
            self.shared.add(obj)
            self.stack.append(obj)
        elif op in (ord("p"), ord("q"), ord("r")):
            self.memo[self._index(op, start, end)] = self.stack[-1]
        elif op == 0x94:
            self.memo[len(self.memo)] = self.stack[-1]
        else:
            return False
        return True

    def _index(self, op: int, start: int, end: int) -> int:
        if op in (ord("g"), ord("p")):
            return int(self.data[start : end - 1])
        return int.from_bytes(self.data[start:end], "little")

    def _other(self, op: int) -> bool:
        if op == ord("2"):
            self.shared.add(self.stack[-1])
            self.stack.append(self.stack[-1])
        elif op == ord("0"):
            if self.marks and self.marks[-1] == len(self.stack):
                self.marks.pop()
            else:
                self._pop(1)
        elif op == ord("1"):
            self._pop_mark()
        elif op in (0x93, ord("Q")):
            self._pop(2 if op == 0x93 else 1)
            self._new(0)
        elif op not in (0x80, 0x95, 0x98):
            return False
        return True


__all__ = ["MAX_COLLIDABLE_KEYS", "MAX_DEPTH", "check_pickle"]
