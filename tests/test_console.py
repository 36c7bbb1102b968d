"""jaxllm/console.py: when a progress bar is drawn, and the log handler ``LLM()`` installs."""

from __future__ import annotations

import io
import logging
import re
import sys

import pytest
from tqdm import tqdm

from jaxllm import console


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bars_only_on_a_terminal_and_never_inside_another_bar(monkeypatch):
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())          # a pipe or a log file
    assert not console.bars_allowed()
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert console.bars_allowed()
    # "Processed prompts" is open: a compile bar would nest one line down with cursor codes.
    outer = tqdm(total=2, desc="Processed prompts", file=term)
    try:
        assert not console.bars_allowed()
    finally:
        outer.close()
    assert console.bars_allowed()


@pytest.fixture
def bare_logging(monkeypatch):
    """The logging of a script that configured none; whatever the test installs is removed.
    (The root logger's handlers are emptied in the test itself: pytest adds its own after setup.)"""
    logger = logging.getLogger("jaxllm")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    monkeypatch.setattr(console, "_installed", None)
    yield logger
    monkeypatch.undo()
    logger.manager._clear_cache()   # isEnabledFor caches levels; the ones set here are gone


def test_handler_installed_once_with_timestamps_on_the_current_stderr(bare_logging, monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    handler = console.install_default_handler()
    assert handler is not None and bare_logging.handlers == [handler]
    assert console.install_default_handler() is None            # once per process
    assert bare_logging.getEffectiveLevel() == logging.INFO
    # A notebook swaps sys.stderr per cell: each line goes to the stderr of its moment.
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    logging.getLogger("jaxllm.engine").info("loading weights of %s", "m")
    monkeypatch.setattr(sys, "stderr", second)
    logging.getLogger("jaxllm.runner").info("2 programs ready")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d INFO jaxllm\.engine: loading weights of m\n", first.getvalue())
    assert second.getvalue().endswith("INFO jaxllm.runner: 2 programs ready\n")


def test_a_program_that_configured_logging_keeps_its_choice(bare_logging, monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    assert console.install_default_handler() is None and bare_logging.handlers == []
    # A level the script set on "jaxllm" is kept when the handler is installed.
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    bare_logging.setLevel(logging.WARNING)
    handler = console.install_default_handler()
    assert bare_logging.handlers == [handler] and handler is not None
    assert bare_logging.level == logging.WARNING
