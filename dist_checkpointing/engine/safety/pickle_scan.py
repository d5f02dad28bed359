"""Bounds checked on a pickle's opcodes before any unpickler runs: :func:`check_pickle`.

Three attacks cost a crafted pickle almost nothing and no unpickler can stop once it
has started:

* nesting: a ~1 MB pickle of a tuple nested 500,000 deep, used as a dict key, makes
  CPython hash it recursively in C and the process dies with SIGSEGV;
* hash collisions: dict keys or set items whose hashes collide (large ints, floats,
  tuples of ints, ``torch.Size``) make each insertion scan all the others: 0.5 MB
  takes minutes, also when one ``set``/``frozenset``/``OrderedDict``/``Counter`` call
  (REDUCE) inserts the items of a list;
* shared structure: a tuple of two references to a tuple of two references to ... is
  a few hundred bytes, but hashing it as a key visits 2**depth elements (tuples do not
  cache their hash).

The scan simulates the unpickler's stack with, per object, a depth, a key kind and the
elements hashing it would visit ("cost", counted through shared references). It refuses
a pickle that nests deeper than :data:`MAX_DEPTH`, that inserts more than
:data:`MAX_COLLIDABLE_KEYS` keys of a kind whose hash a file can make collide (or such
keys of more than :data:`MAX_COLLIDABLE_WEIGHT` elements in all: comparing two
colliding keys walks them), or whose keys take more than :data:`MAX_HASH_WORK` (plus 8
per byte of the pickle) elements to hash. Strings and bytes (whose hashes are randomized
per process), tuples made only of them, and ints below ``2**61 - 1`` (which hash to
themselves) are not collidable. Pure Python: about a second per megabyte, so it runs on
``torch.save`` payloads (``common.pt``, objects) and small ``.metadata`` files; a large
``.metadata`` is bounded by CPU time instead (:mod:`.metadata`, :mod:`.cpu_bounded`).

It only reads: anything it does not understand is left to the unpickler.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from typing import cast

from dist_checkpointing.errors import CorruptCheckpointError

MAX_DEPTH = 512
MAX_COLLIDABLE_KEYS = 4096
MAX_COLLIDABLE_WEIGHT = 8 * MAX_COLLIDABLE_KEYS
MAX_HASH_WORK = 1 << 22
# BUILDs on an object already referenced elsewhere (from the memo): each can add up to
# MAX_DEPTH to the real depth of what references it without the scan seeing it.
MAX_SHARED_BUILDS = 16

# Key kinds: safe (None, bool, ints that hash to themselves), collidable, and random
# (non-empty str or bytes, and tuples of them: hashed with the per-process secret).
_SAFE, _COLLIDABLE, _RANDOM = 0, 1, 2
_COST_CAP = 1 << 62
_SMALL_INT = (1 << 61) - 1  # ints of smaller magnitude hash to themselves (but -1)

# Opcodes (pickletools names), as ints.
_MARK, _STOP, _POP, _POP_MARK, _DUP, _TUPLE, _LIST, _DICT = b"(.012tld"
_BININT, _BININT1, _BININT2, _INT, _LONG1, _GLOBAL, _INST, _OBJ = b"JKMI\x8aci\x6f"
_APPEND, _SETITEM, _APPENDS, _SETITEMS, _ADDITEMS, _BUILD = b"aseu\x90b"
_REDUCE, _NEWOBJ, _NEWOBJ_EX, _STACK_GLOBAL, _BINPERSID, _FROZENSET = b"R\x81\x92\x93Q\x91"
_STRING, _UNICODE_LINE, _MEMOIZE, _EMPTY_TUPLE = b"SV\x94)"
_GETS, _PUTS = b"hjg", b"qrp"

_FIXED = {  # opcode -> bytes of argument
    **{ord("K"): 1, ord("M"): 2, ord("J"): 4, ord("G"): 8, ord("h"): 1, ord("j"): 4},
    **{ord("q"): 1, ord("r"): 4, 0x82: 1, 0x83: 2, 0x84: 4, 0x80: 1, 0x95: 8},
}
_LEN1 = {0x8A, ord("U"), ord("C"), 0x8C}  # 1-byte length, then data
_LEN4 = {0x8B, ord("T"), ord("B"), ord("X")}
_LEN8 = {0x8E, 0x96, 0x8D}
_LINE = {ord(c) for c in "ILSVFgpP"}
_TWO_LINES = {ord("c"), ord("i")}
_SMALL_INTS = frozenset(b"JKM\x8a")  # LONG1 too, when of 8 bytes or fewer
_LEAF = frozenset(b"N\x88\x89\x97\x96")  # None, bools, buffers, bytearray
_COLLIDABLE_LEAF = frozenset(b"L\x8bFGcP\x82\x83\x84")  # numbers, globals, pids, EXT
_STRINGS = frozenset(b"UC\x8cTBX\x8e\x8dSV")
_UNICODE = frozenset(b"\x8cX\x8dV")  # their text is kept (STACK_GLOBAL names)
_EMPTY = frozenset(b"])}\x8f")
_LEAVES = _SMALL_INTS | _LEAF | _COLLIDABLE_LEAF | _STRINGS | _EMPTY | {_INT}
_TUPLES = {0x85: 1, 0x86: 2, 0x87: 3}
_CALLS = {_REDUCE: 2, _NEWOBJ: 2, _NEWOBJ_EX: 3}

# Callables whose result's key kind is known and which insert nothing into a hash
# table. Every other callable (set, frozenset, dict, OrderedDict, Counter, defaultdict,
# or unknown) may insert the items of its arguments, which then count as keys.
_CALL_KINDS = {
    "_codecs.encode": _RANDOM,  # bytes, in protocol 2
    "torch.Size": _COLLIDABLE,
    "builtins.complex": _COLLIDABLE,
    "torch.device": _SAFE,
    "torch.nn.parameter.Parameter": _SAFE,
    "builtins.bytearray": _SAFE,
    "torch.serialization._get_layout": _SAFE,
}
_SAFE_CALL_PREFIXES = ("torch._utils._rebuild_", "torch._tensor._rebuild_")


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
    """Refuse a pickle that nests too deeply, holds too many collidable dict keys or
    keys too costly to hash.

    Raises:
        CorruptCheckpointError: naming ``source`` and the bound exceeded.
    """
    raw = bytes(data)
    try:
        _Scanner(raw).run()
    except _TooDeep as exc:
        raise CorruptCheckpointError(f"{source}: refusing to unpickle: {exc}") from None
    except (IndexError, ValueError, KeyError, struct.error, UnicodeDecodeError):
        return  # malformed: the unpickler reports it


def _call_kind(name: str | None) -> int | None:
    """The key kind of what callable ``name`` returns, or None if it may insert the
    items of its arguments into a hash table (or is unknown)."""
    if name is None:
        return None
    if name.startswith("__builtin__."):  # protocol 2 names builtins so
        name = "builtins." + name[len("__builtin__.") :]
    if name.startswith(_SAFE_CALL_PREFIXES):
        return _SAFE
    return _CALL_KINDS.get(name)


class _Scanner:
    """The unpickler's stack, simulated with a depth, key kind and cost per object."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.depth: list[int] = []  # per object created
        self.kind: list[int] = []
        self.cost: list[int] = []  # elements hashing it visits
        self.elements: dict[int, list[int]] = {}  # of tuples
        self.items: dict[int, list[int]] = {}  # of lists, sets, dicts (keys): see _tally
        self.text: dict[int, str] = {}  # short strings (STACK_GLOBAL names)
        self.names: dict[int, str] = {}  # globals
        self.shared: set[int] = set()  # objects referenced more than once
        self.stack: list[int] = []  # object ids
        self.marks: list[int] = []
        self.memo: dict[int, int] = {}
        self.collidable = self.weight = self.work = 0
        self.work_limit = MAX_HASH_WORK + 8 * len(data)
        self.scale = 1  # how much a BUILD on a shared object may have grown older costs
        self.shared_builds = 0

    def run(self) -> None:
        data, pos, n, handlers = self.data, 0, len(self.data), _HANDLERS
        while pos < n:
            op = data[pos]
            start = pos + 1
            pos = _arg_end(data, start, op)
            handler = handlers.get(op)
            if handler is None:
                return  # STOP, or an opcode the unpickler will refuse
            handler(self, op, start, pos)

    # ------------------------------------------------------------------ bookkeeping

    def _new(self, d: int, k: int = _COLLIDABLE, cost: int = 1) -> int:
        if d > MAX_DEPTH:
            raise _TooDeep(f"it nests deeper than {MAX_DEPTH} levels")
        self.depth.append(d)
        self.kind.append(k)
        self.cost.append(cost if cost < _COST_CAP else _COST_CAP)
        obj = len(self.depth) - 1
        self.stack.append(obj)
        return obj

    def _grow(self, obj: int, d: int, cost: int) -> None:
        if d > MAX_DEPTH:
            raise _TooDeep(f"it nests deeper than {MAX_DEPTH} levels")
        if d > self.depth[obj]:
            self.depth[obj] = d
        self.cost[obj] = min(self.cost[obj] + cost, _COST_CAP)

    def _insert(self, count: int, weight: int, work: int) -> None:
        """``count`` collidable keys of ``weight`` elements, and keys of ``work``
        elements in all, inserted into hash tables."""
        self.collidable += count
        self.weight += weight * self.scale
        self.work += work * self.scale
        if self.work > self.work_limit:
            raise _TooDeep(
                f"its dict keys and set items take more than {self.work_limit} steps to "
                f"hash (a structure shared through the memo)"
            )
        if self.collidable > MAX_COLLIDABLE_KEYS or self.weight > MAX_COLLIDABLE_WEIGHT:
            raise _TooDeep(
                f"it inserts more than {MAX_COLLIDABLE_KEYS} dict keys or set items whose "
                f"hashes a file can make collide (large ints, floats, tuples), or such keys "
                f"of more than {MAX_COLLIDABLE_WEIGHT} elements in all"
            )

    def _tally(self, keys: list[int]) -> tuple[int, int, int]:
        """``(count, weight, work)`` of ``keys`` (see :meth:`_insert`)."""
        count = weight = work = 0
        kind, costs = self.kind, self.cost
        for key in keys:
            cost = costs[key]
            work += cost
            if kind[key] == _COLLIDABLE:
                count += 1
                weight += cost
        return count, weight, work

    def _add_items(self, obj: int, tally: tuple[int, int, int]) -> None:
        """``obj`` (a list, set or dict) now holds items (keys) of ``tally``."""
        held = self.items.get(obj)
        if held is None:
            self.items[obj] = list(tally)
        else:
            held[:] = [min(a + b, _COST_CAP) for a, b in zip(held, tally)]

    def _items_of(self, obj: int) -> tuple[int, int, int]:
        """What a call iterating ``obj`` (``set(obj)``, ``dict(obj)``...) inserts."""
        if obj in self.elements:
            return self._tally(self.elements[obj])
        held = self.items.get(obj, (0, 0, 0))
        return held[0], held[1], held[2]

    def _pop(self, count: int) -> list[int]:
        items = self.stack[len(self.stack) - count :] if count else []
        del self.stack[len(self.stack) - len(items) :]
        if len(items) != count:
            raise IndexError("stack underflow")
        return items

    def _pop_mark(self) -> list[int]:
        return self._pop(len(self.stack) - self.marks.pop())

    def _max(self, items: list[int]) -> int:
        depth = self.depth
        return max([depth[i] for i in items], default=0)

    def _sum(self, items: list[int]) -> int:
        cost = self.cost
        return sum([cost[i] for i in items])

    def _global_name(self, start: int, end: int) -> str:
        module, name, _ = self.data[start:end].split(b"\n")
        return f"{module.decode('latin-1')}.{name.decode('latin-1')}"

    # ------------------------------------------------------------------ opcodes

    def _leaf(self, op: int, start: int, end: int) -> None:
        if op in _SMALL_INTS and end - start - (op == _LONG1) <= 8:
            raw = self.data[start + (op == _LONG1) : end]
            value = int.from_bytes(raw, "little", signed=op in (_BININT, _LONG1))
            safe = -_SMALL_INT < value < _SMALL_INT and value not in (-1, -2)
            self._new(0, _SAFE if safe else _COLLIDABLE)
        elif op == _INT:
            value = int(self.data[start : end - 1] or b"0")
            self._new(0, _SAFE if 0 <= value < _SMALL_INT else _COLLIDABLE)
        elif op in _COLLIDABLE_LEAF or op == _LONG1:
            obj = self._new(0)
            if op == _GLOBAL:
                self.names[obj] = self._global_name(start, end)
        elif op in _STRINGS:
            self._string(op, start, end)
        elif op in _LEAF:
            self._new(0, _SAFE)
        else:  # empty list, tuple, dict, set
            obj = self._new(1)
            if op == _EMPTY_TUPLE:
                self.elements[obj] = []

    def _string(self, op: int, start: int, end: int) -> None:
        header = 1 if op in _LEN1 else 4 if op in _LEN4 else 8 if op in _LEN8 else 0
        body = self.data[start + header : end]
        if op in (_STRING, _UNICODE_LINE):  # a line: quoted (S) or escaped (V)
            body = body[:-1].strip(b"'\"") if op == _STRING else body[:-1]
        obj = self._new(0, _RANDOM if body else _SAFE)  # hash("") == hash(b"") == 0
        if op in _UNICODE and len(body) <= 256:
            self.text[obj] = body.decode("utf-8", "replace")

    def _tuple(self, items: list[int]) -> None:
        kind = self.kind
        random = bool(items) and all([kind[i] == _RANDOM for i in items])
        obj = self._new(self._max(items) + 1, _RANDOM if random else _COLLIDABLE)
        self.cost[obj] = min(1 + self._sum(items), _COST_CAP)
        self.elements[obj] = items

    def _container(self, op: int, start: int, end: int) -> None:
        if op == _MARK:
            self.marks.append(len(self.stack))
        elif op in _TUPLES:
            self._tuple(self._pop(_TUPLES[op]))
        elif op == _TUPLE:
            self._tuple(self._pop_mark())
        else:  # LIST, DICT, FROZENSET
            items = self._pop_mark()
            cost = 1 + (len(items) if op == _FROZENSET else self._sum(items))  # hash cached
            obj = self._new(self._max(items) + 1, cost=cost)
            tally = self._tally(items[::2] if op == _DICT else items)
            if op != _LIST:
                self._insert(*tally)
            self._add_items(obj, tally)

    def _update(self, op: int, start: int, end: int) -> None:
        """APPEND(S), SETITEM(S), ADDITEMS and BUILD: to the object below on the stack."""
        if op == _BUILD:
            self._build(*self._pop(1))
            return
        if op in (_APPEND, _SETITEM):
            items = self._pop(2 if op == _SETITEM else 1)
        else:
            items = self._pop_mark()
        if not items:
            return
        target = self.stack[-1]
        tally = self._tally(items[::2] if op in (_SETITEM, _SETITEMS) else items)
        if op not in (_APPEND, _APPENDS):
            self._insert(*tally)
        self._add_items(target, tally)
        self._grow(target, self._max(items) + 1, self._sum(items))

    def _build(self, state: int) -> None:
        target = self.stack[-1]
        if target in self.shared:
            self.shared_builds += 1
            if self.shared_builds > MAX_SHARED_BUILDS:
                raise _TooDeep(f"it sets the state of more than {MAX_SHARED_BUILDS} shared objects")
            # What already holds the target costs more to hash now than the scan counted.
            self.scale = min(self.scale * (1 + self.cost[state] * self.scale), _COST_CAP)
        self._grow(target, self.depth[state] + 1, self.cost[state])

    def _call(self, op: int, start: int, end: int) -> None:
        """REDUCE, NEWOBJ(_EX), INST, OBJ: a call of a global with arguments."""
        kwargs: list[int] = []
        name: str | None
        if op == _INST:
            every = positional = self._pop_mark()
            name = self._global_name(start, end)
        elif op == _OBJ:
            every = self._pop_mark()
            name = self.names.get(every[0])
            positional = every[1:]
        else:
            func, args, *kwargs = self._pop(_CALLS[op])
            name = self.names.get(func)
            positional = self.elements.get(args, [args])
            every = [func, args, *kwargs]
        kind = _call_kind(name)
        if kind is None:  # may insert the items of its arguments into a hash table
            for arg in (*positional, *kwargs):
                self._insert(*self._items_of(arg))
        cost = 1 + self._sum(positional) + self._sum(kwargs)
        self._new(self._max(every) + 1, _COLLIDABLE if kind is None else kind, cost)

    def _memo(self, op: int, start: int, end: int) -> None:
        if op in _GETS:
            obj = self.memo[self._index(op, start, end)]
            self.shared.add(obj)
            self.stack.append(obj)
        elif op == _MEMOIZE:
            self.memo[len(self.memo)] = self.stack[-1]
        else:
            self.memo[self._index(op, start, end)] = self.stack[-1]

    def _index(self, op: int, start: int, end: int) -> int:
        if op in b"gp":
            return int(self.data[start : end - 1])
        return int.from_bytes(self.data[start:end], "little")

    def _other(self, op: int, start: int, end: int) -> None:
        if op == _DUP:
            self.shared.add(self.stack[-1])
            self.stack.append(self.stack[-1])
        elif op == _POP:
            if self.marks and self.marks[-1] == len(self.stack):
                self.marks.pop()
            else:
                self._pop(1)
        elif op == _POP_MARK:
            self._pop_mark()
        elif op == _STACK_GLOBAL:
            module, name = (self.text.get(i) for i in self._pop(2))
            obj = self._new(0)
            if module is not None and name is not None:
                self.names[obj] = f"{module}.{name}"
        elif op == _BINPERSID:
            self._pop(1)
            self._new(0)
        # PROTO, FRAME, READONLY_BUFFER: nothing to do


_Handler = Callable[[_Scanner, int, int, int], None]
_HANDLERS: dict[int, _Handler] = {
    op: handler
    for handler, ops in [
        (_Scanner._leaf, _LEAVES),
        (_Scanner._container, b"(\x85\x86\x87tld\x91"),
        (_Scanner._update, b"aseu\x90b"),
        (_Scanner._call, b"R\x81\x92io"),
        (_Scanner._memo, b"hjgqrp\x94"),
        (_Scanner._other, b"210\x93Q\x80\x95\x98"),
    ]
    for op in cast("Iterable[int]", ops)
}

__all__ = [
    "MAX_COLLIDABLE_KEYS",
    "MAX_COLLIDABLE_WEIGHT",
    "MAX_DEPTH",
    "MAX_HASH_WORK",
    "check_pickle",
]
