"""Prompt-lookup proposals (``method: ngram``): the tokens that followed the latest earlier
occurrence of the request's last n tokens, for the longest n in [prompt_lookup_min,
prompt_lookup_max] that occurs.  No model: copying from the prompt (code edits, extraction,
summaries that quote) is where it pays.

Each request's index is kept by request id and grows with its tokens: for every n, a map
from each n-gram to the position right after its latest occurrence that has a continuation,
so a step costs a few dict operations per new token, not a scan of the sequence.
"""

from __future__ import annotations


class _Index:
    def __init__(self, sizes: range):
        self.sizes = sizes
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.indexed = 0
        """Continuation positions < this are in the maps."""

    def extend(self, tokens: list[int]) -> None:
        """Indexes every n-gram that ends before the last token (its continuation exists)."""
        for e in range(self.indexed, len(tokens)):
            for n in self.sizes:
                if e >= n:
                    self.maps[n][tuple(tokens[e - n:e])] = e
        self.indexed = len(tokens)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in reversed(self.sizes):
            if len(tokens) < n:
                continue
            start = self.maps[n].get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start:start + k]
        return []


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.sizes = range(prompt_lookup_min, prompt_lookup_max + 1)
        self._index: dict[str, _Index] = {}

    def propose(self, req_id: str, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``token_ids`` (the request's prompt and outputs)."""
        index = self._index.get(req_id)
        if index is None:
            index = self._index[req_id] = _Index(self.sizes)
        # The index covers continuations before the last token: the suffix never matches itself.
        index.extend(token_ids)
        return index.lookup(token_ids, k)

    def remove(self, req_id: str) -> None:
        self._index.pop(req_id, None)
