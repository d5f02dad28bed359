"""Host memory of a test's process: the peak RSS while a block runs."""

from __future__ import annotations

import threading

import psutil


class PeakRss:
    """The largest RSS of this process seen while the ``with`` block runs (sampled every
    0.2 ms); ``base`` is the RSS when it began, ``added`` how far the peak rose above it."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.0002):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def added(self) -> int:
        return self.peak - self.base

    def __enter__(self) -> PeakRss:
        self.base = self.peak = self.proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
