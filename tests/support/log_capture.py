"""The warnings a test's code logs, kept as text: :class:`WarningRecords`."""

from __future__ import annotations

import logging


class WarningRecords(logging.Handler):
    """A handler that keeps the message of every record of level WARNING or above."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
