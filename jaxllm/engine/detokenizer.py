"""Incremental detokenization and stop-string matching for one output sequence.

Text is produced with ``tokenizers``' ``DecodeStream`` (primed with the prompt, so the
first token's leading space is decided as a full decode would), which holds back bytes
until they form complete UTF-8 characters.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._skip = skip_special_tokens
        if self._backend is not None:
            # Prime with the prompt's tail only: enough context for spacing, cheap for long prompts.
            self._stream = DecodeStream(ids=list(prompt_token_ids[-8:]), skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._text = ""

    def add(self, token_id: int) -> str:
        """Appends a token; returns the text it completes (possibly empty)."""
        if self._backend is not None:
            piece = self._stream.step(self._backend, token_id)
            return piece or ""
        # Slow tokenizers: decode the whole output and diff.
        self._ids.append(token_id)
        text = self.tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        if text.endswith("\ufffd"):
            return ""
        new, self._text = text[len(self._text):], text
        return new


def find_stop_string(text: str, new_len: int, stops: list[str], include: bool) -> tuple[str, int] | None:
    """Looks for a stop string that ends inside the last ``new_len`` characters of ``text``.

    Returns (stop string, length to truncate the text to), or None.
    """
    if not stops or new_len == 0:
        return None
    best = None
    for s in stops:
        start = max(0, len(text) - new_len - len(s) + 1)
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[1]):
            best = (s, i)
    if best is None:
        return None
    s, i = best
    return s, i + len(s) if include else i
