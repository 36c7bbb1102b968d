"""Prompt-lookup proposals (``method: ngram``): the tokens that followed the latest earlier
occurrence of the request's last n tokens, for the longest n in [prompt_lookup_min,
prompt_lookup_max] that occurs.  No model: copying from the prompt (code edits, extraction,
summaries that quote) is where it pays.

Each request's index is kept by request id and grows with its tokens: for every n, a map
from each n-gram to the position right after its latest occurrence that has a continuation,
so a step costs a few dict operations per new token, not a scan of the sequence.
"""

from __future__ import annotations

from collections.abc import Mapping

from jaxllm.spec_decode.proposer import ProposalRequest


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
    """The ``Proposer`` of ``method: ngram`` (spec_decode/proposer.py)."""

    free = True
    """A few dict operations per request: the controller asks first and prices what was found."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.sizes = range(prompt_lookup_min, prompt_lookup_max + 1)
        self._index: dict[str, _Index] = {}

    def propose(self, requests: Mapping[str, ProposalRequest], k: int) -> dict[str, list[int]]:
        """Up to ``k`` tokens to follow each request's ``token_ids`` (its prompt and outputs)."""
        return {rid: self._lookup(rid, r.token_ids, k) for rid, r in requests.items()}

    def _lookup(self, req_id: str, token_ids: list[int], k: int) -> list[int]:
        index = self._index.get(req_id)
        if index is None:
            index = self._index[req_id] = _Index(self.sizes)
        # The index covers continuations before the last token: the suffix never matches itself.
        index.extend(token_ids)
        return index.lookup(token_ids, k)

    def cost(self, k: int, num_requests: int) -> float:
        return 0.0

    def remove(self, req_id: str) -> None:
        self._index.pop(req_id, None)
