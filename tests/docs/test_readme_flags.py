"""The README's flag tables ("server flag" and "Engine flags") are ``jaxllm serve``'s parser:
every flag a table names exists, and every flag the parser takes is in a table (or in
NOT_IN_TABLES, each with the reason)."""

from __future__ import annotations

import argparse
import os
import re

from jaxllm import cli

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")

# Flags the tables leave out on purpose.
NOT_IN_TABLES = {
    "--help", "-h",          # argparse's own
    "--kv-cache-memory",     # an alias of --kv-cache-memory-bytes (the table's name, vLLM's)
}


def table_flags() -> set[str]:
    """Flags named in the first cell of every row of the README's two flag tables."""
    text = open(README, encoding="utf-8").read()
    flags: set[str] = set()
    for header in ("| server flag | meaning |", "| flag | meaning |"):
        assert header in text, f"README has no table headed {header!r}"
        rows = text[text.index(header):].split("\n\n", 1)[0].splitlines()[2:]
        assert rows, f"the table headed {header!r} is empty"
        for row in rows:
            first = row.strip("|").split("|")[0]
            flags |= set(re.findall(r"(?<![\w-])(-{1,2}[a-z][a-z0-9-]*)", first))
    return flags


def parser_flags() -> set[str]:
    """Every option string of ``jaxllm serve`` and of ``jaxllm`` itself (``--log-level``)."""
    parser = cli.build_parser()
    serve = cli._subparser(parser, "serve")
    assert serve is not parser, "jaxllm serve is not installed in this checkout"
    flags = set()
    for p in (parser, serve):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            flags |= set(action.option_strings)
    return flags


def test_every_table_flag_is_in_the_parser():
    unknown = table_flags() - parser_flags()
    assert not unknown, f"README's flag tables name flags jaxllm serve does not take: {sorted(unknown)}"


def test_every_parser_flag_is_in_a_table():
    missing = parser_flags() - table_flags() - NOT_IN_TABLES
    assert not missing, f"jaxllm serve takes flags no README table names: {sorted(missing)}"


def test_exclusions_are_real_flags():
    assert NOT_IN_TABLES <= parser_flags(), sorted(NOT_IN_TABLES - parser_flags())
