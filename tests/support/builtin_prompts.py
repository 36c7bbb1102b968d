"""Short English and code prompts for the built-in model, shared by its packed and int8 tests."""

from __future__ import annotations

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "List three uses of copper:",
    "In 1969, the first humans",
]
