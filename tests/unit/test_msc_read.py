"""How an ``msc://`` data file is read: which GETs, how many chunks held (no server:
the GET function is replaced by one that serves an in-memory object and logs requests)."""

from __future__ import annotations

import pytest

from dist_checkpointing.engine.storage import msc_read
from dist_checkpointing.engine.storage.msc_read import RangedReader, plan_chunks

MIB = 1 << 20


def test_plan_merges_neighbours_and_takes_the_whole_object() -> None:
    spans = [(0, 10), (10, 20), (30 + 4096, 50)]  # small gaps
    assert plan_chunks(spans, 30 + 4096 + 50, gap=MIB, chunk=64 * MIB) == [(0, 4176)]


def test_plan_cuts_near_the_chunk_size_without_slivers() -> None:
    size = 67 * MIB
    assert plan_chunks([(0, size)], size, gap=MIB, chunk=64 * MIB) == [(0, size)]
    chunks = plan_chunks([(0, size)], size, gap=MIB, chunk=16 * MIB)
    assert len(chunks) == 4 and chunks[0][0] == 0 and chunks[-1][1] == size
    assert all(b[0] == a[1] for a, b in zip(chunks, chunks[1:]))


def test_plan_keeps_distant_ranges_apart() -> None:
    size = 100 * MIB
    spans = [(10 * MIB, MIB), (50 * MIB, 2 * MIB)]
    assert plan_chunks(spans, size, gap=MIB, chunk=64 * MIB) == [
        (10 * MIB, 11 * MIB),
        (50 * MIB, 52 * MIB),
    ]


class FakeStore:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.requests: list[tuple[int, int, bool]] = []

    def get(self, url: str, offset: int, size: int, whole: bool = False) -> bytes:
        self.requests.append((offset, size, whole))
        return self.data if whole else self.data[offset : offset + size]


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> FakeStore:
    fake = FakeStore(bytes(range(256)) * (40 * MIB // 256))
    monkeypatch.setattr(msc_read, "get", fake.get)
    monkeypatch.setattr(msc_read, "open_stream", lambda *args, **kwargs: None)  # cannot presign
    return fake


def _read(reader: RangedReader, offset: int, n: int) -> bytes:
    buf = bytearray(n)
    reader.seek(offset)
    done = 0
    while done < n:
        got = reader.readinto(memoryview(buf)[done:])
        if not got:
            break
        done += got
    return bytes(buf[:done])


def test_a_file_read_whole_is_one_plain_get(store: FakeStore) -> None:
    reader = RangedReader("msc://p/f", len(store.data))
    items = [(i * 4 * MIB, 4 * MIB) for i in range(10)]
    reader.plan(items)
    for offset, length in items:
        assert _read(reader, offset, 4096) == store.data[offset : offset + 4096]  # header
        assert _read(reader, offset, length) == store.data[offset : offset + length]
    reader.close()
    assert store.requests == [(0, len(store.data), True)]


def test_chunks_are_fetched_ahead_and_released(
    store: FakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DIST_CKPT_MSC_READ_CHUNK_BYTES", str(4 * MIB))
    monkeypatch.setenv("DIST_CKPT_MSC_READ_AHEAD", "1")
    reader = RangedReader("msc://p/f", len(store.data))
    reader.plan([(0, len(store.data))])
    held = 0
    for offset in range(0, len(store.data), MIB):  # 1 MiB blocks, as a verified read goes
        assert _read(reader, offset, MIB) == store.data[offset : offset + MIB]
        held = max(held, len(reader._held))
    reader.close()
    assert held <= 3  # MSC_READ_AHEAD + 2
    assert sorted(store.requests) == [(i * 4 * MIB, 4 * MIB, False) for i in range(10)]


def test_the_tail_of_a_large_item_read_first_is_one_small_get(
    store: FakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DIST_CKPT_MSC_READ_CHUNK_BYTES", str(4 * MIB))
    reader = RangedReader("msc://p/f", len(store.data))
    size = len(store.data)
    reader.plan([(0, size)])
    assert _read(reader, 0, 4096) == store.data[:4096]
    assert _read(reader, size - 4096, 4096) == store.data[-4096:]
    assert _read(reader, 4096, size - 8192) == store.data[4096:-4096]
    reader.close()
    assert (size - 4096, 4096, False) in store.requests
    assert sum(n for _, n, _ in store.requests) == size + 4096  # every chunk fetched once


def test_a_truncated_object_gives_a_short_read(store: FakeStore) -> None:
    reader = RangedReader("msc://p/f", len(store.data) + 100)  # the object is shorter
    reader.plan([(0, len(store.data) + 100)])
    assert len(_read(reader, 0, len(store.data) + 100)) == len(store.data)
    reader.close()


def test_reads_outside_the_plan_fetch_just_their_bytes(store: FakeStore) -> None:
    reader = RangedReader("msc://p/f", len(store.data))
    reader.plan([(0, 100)])
    assert _read(reader, 5 * MIB, 10) == store.data[5 * MIB : 5 * MIB + 10]
    reader.close()
    assert store.requests == [(5 * MIB, 10, False)]


def test_reading_everything_without_a_plan_is_one_get(store: FakeStore) -> None:
    reader = RangedReader("msc://p/f", len(store.data))
    assert reader.read() == store.data
    assert store.requests == [(0, len(store.data), True)]
    reader.close()


# ----------------------------------------------------------------------------- streamed GETs


class FakeStream:
    """A streamed GET of ``data[start:end]`` (see ``msc_stream.Stream``)."""

    def __init__(self, data: bytes, start: int, end: int) -> None:
        self.data, self.pos, self.end = data, start, end

    def readinto(self, view: memoryview) -> int:
        n = max(0, min(len(view), self.end - self.pos))
        view[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n

    def skip(self, n: int) -> None:
        self.pos = min(self.end, self.pos + n)

    def close(self) -> None:
        pass


@pytest.fixture
def streams(store: FakeStore, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, bool]]:
    opened: list[tuple[int, int, bool]] = []

    def open_stream(url: str, start: int, end: int, whole: bool) -> FakeStream:
        opened.append((start, end, whole))
        return FakeStream(store.data, 0 if whole else start, end)

    monkeypatch.setattr(msc_read, "open_stream", open_stream)
    return opened


def test_streamed_item_reads_go_in_order_from_one_get(
    store: FakeStore, streams: list[tuple[int, int, bool]]
) -> None:
    size = len(store.data)
    reader = RangedReader("msc://p/f", size)
    items = [(0, 3 * MIB), (3 * MIB, 5 * MIB)]
    reader.plan(items)
    for offset, length in items:
        # an item's first 4 KiB, then its data from inside them, then its last bytes
        assert _read(reader, offset, 4096) == store.data[offset : offset + 4096]
        body = (offset + 1000, length - 1000 - 700)
        assert _read(reader, *body) == store.data[body[0] : body[0] + body[1]]
        tail = offset + length - 4096
        assert _read(reader, tail, 4096) == store.data[tail : tail + 4096]
    assert streams == [(0, 8 * MIB, False)] and store.requests == []


def test_streamed_reads_far_away_open_new_gets(
    store: FakeStore, streams: list[tuple[int, int, bool]]
) -> None:
    size = len(store.data)
    reader = RangedReader("msc://p/f", size)
    reader.plan([(0, size)])
    assert _read(reader, 0, 2 * MIB) == store.data[: 2 * MIB]
    # A gap under 1 MiB is read past; a small read behind what is kept is one ranged GET.
    assert _read(reader, 2 * MIB + 500, 100) == store.data[2 * MIB + 500 : 2 * MIB + 600]
    assert _read(reader, 10, 100) == store.data[10:110] and store.requests == [(10, 100, False)]
    # A large read far ahead opens a GET from there to the end of the chunk.
    far = 30 * MIB
    assert _read(reader, far, MIB) == store.data[far : far + MIB]
    assert streams == [(0, size, True), (far, size, False)]


def test_a_broken_stream_names_the_url() -> None:
    from dist_checkpointing.engine.storage.msc_stream import Stream
    from dist_checkpointing.errors import StorageAccessError

    class Broken:
        def getheader(self, name: str, default: str) -> str:
            return "100"

        def readinto(self, view: memoryview) -> int:
            raise ConnectionResetError("reset by peer")

    class Conn:
        def close(self) -> None:
            pass

    stream = Stream("msc://p/ckpt/__0_0.distcp", ("http", "h", 80), Conn(), Broken(), 10)  # type: ignore[arg-type]
    with pytest.raises(StorageAccessError, match=r"msc://p/ckpt/__0_0.distcp.*byte 10.*reset"):
        stream.readinto(memoryview(bytearray(50)))
    stream.close()
