"""What a person sees on stderr while the engine starts and runs: when a progress bar is
drawn, and the log handler that ``LLM()`` installs so that a script or a notebook shows the
same start-up phases (weights, tokenizer, kernel builds, compiles) as ``jaxllm serve``.

Bars are drawn only on a terminal or in a notebook kernel (elsewhere, e.g. stderr redirected
to a file, a bar is one long line of ``\\r`` updates; the phase's log lines say the same), and
never inside another open bar (tqdm would nest it one line down with cursor-movement codes).
"""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def _stderr_shows_bars() -> bool:
    # A notebook kernel's stderr is no terminal, but the notebook renders "\r" updates in place.
    if "ipykernel" in sys.modules:
        return True
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:   # a closed stream
        return False


def bars_allowed() -> bool:
    """Whether a progress bar may be drawn now: stderr shows one, and no other bar is open."""
    return _stderr_shows_bars() and not getattr(tqdm, "_instances", None)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at each record (a notebook swaps it per cell), and
    clears an open bar around the line so the line does not land after the bar's text."""

    def __init__(self):
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        self.setStream(sys.stderr)
        with tqdm.external_write_mode(file=sys.stderr):
            super().emit(record)


_installed: logging.Handler | None = None


def install_default_handler() -> logging.Handler | None:
    """Makes the ``jaxllm`` logger's INFO lines visible, with timestamps, when the program has
    not configured logging itself (no handler on the root logger nor on ``jaxllm``); once per
    process.  Returns the handler installed, or None."""
    global _installed
    logger = logging.getLogger("jaxllm")
    if _installed is not None or logging.getLogger().handlers or logger.handlers:
        return None
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
    logger.addHandler(handler)
    # Only if nobody chose a level: a script's logging.getLogger("jaxllm").setLevel(...) wins.
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    _installed = handler
    return handler
