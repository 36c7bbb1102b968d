"""The messages a logger emits inside a ``with`` block, whatever the log level or handlers
the run configured (pytest's caplog sees only the test's own call; engines shared across
tests log once, when they are built)."""

from __future__ import annotations

import contextlib
import logging


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def log_lines(name: str):
    """Yields the list that fills with logger ``name``'s messages (INFO and up) until the block ends."""
    logger = logging.getLogger(name)
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    if not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
