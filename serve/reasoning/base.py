"""The reasoning-parser interface: a model's output -> (reasoning, content) (``--reasoning-parser``).

One instance per choice of one request.  ``split(text, final)`` is the one function a
parser writes; ``extract_reasoning`` (whole output) and ``extract_reasoning_streaming`` /
``finish_streaming`` (pieces) both come from it, so a stream's joined deltas equal the
non-streaming answer for every way of cutting the text.  A partial end tag is held back,
never sent as reasoning or content.

``end_token_ids()`` are the token ids that end reasoning: a grammar for structured output
or a required tool call starts after them (the engine's option for that belongs to
structured outputs; the server passes these ids).  ``reasoning_span(token_ids, text)`` says
which output tokens were reasoning: usage's ``reasoning_tokens`` counts them, and the
Responses API's ``output_text`` logprobs leave them out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

from serve.tool_parsers.base import held_back


@dataclass(frozen=True)
class ReasoningDelta:
    reasoning: str | None = None
    content: str | None = None


class ReasoningParser:
    name: ClassVar[str] = ""

    def __init__(self, tokenizer=None, prompt_text: str = ""):
        self.tokenizer = tokenizer
        self.prompt_text = prompt_text
        self._text = ""
        self._sent_reasoning = 0
        self._sent_content = 0

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning so far or None when the output has none, content so far); while not
        ``final`` both may hold text back; each only ever grows."""
        raise NotImplementedError

    def end_token_ids(self) -> tuple[int, ...]:
        raise NotImplementedError

    def reasoning_span(self, token_ids: Sequence[int], text: str) -> tuple[int, int, int]:
        """(start, end, content_start) over a whole output's token ids: tokens [start, end) are
        the reasoning and the content starts at ``content_start`` (tags in between); (0, 0, 0)
        when the output has no reasoning.  This generic answer re-tokenizes the parts ``split``
        finds (for a plugin parser that writes only ``split``); the <think> parsers read the
        token ids themselves."""
        reasoning, content = self.split(text, final=True)
        if reasoning is None:
            return 0, 0, 0
        n = len(token_ids)

        def count(part: str) -> int:
            return len(self.tokenizer.encode(part, add_special_tokens=False)) if part else 0

        end = min(count(reasoning), n)
        return 0, end, max(end, n - count(content))

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for an empty part."""
        reasoning, content = self.split(text, final=True)
        return (reasoning or None), (content or None)

    def extract_reasoning_streaming(self, delta_text: str) -> ReasoningDelta | None:
        self._text += delta_text
        return self._advance(final=False)

    def finish_streaming(self) -> ReasoningDelta | None:
        return self._advance(final=True)

    def _advance(self, final: bool) -> ReasoningDelta | None:
        reasoning, content = self.split(self._text, final)
        reasoning = reasoning or ""
        r = reasoning[self._sent_reasoning:]
        c = content[self._sent_content:]
        self._sent_reasoning, self._sent_content = len(reasoning), len(content)
        if not r and not c:
            return None
        return ReasoningDelta(reasoning=r or None, content=c or None)


class ThinkReasoningParser(ReasoningParser):
    """The ``<think>...</think>`` family.  Subclasses say whether an output without a leading
    ``<think>`` starts inside reasoning (``starts_in_reasoning``)."""

    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"

    def starts_in_reasoning(self) -> bool:
        raise NotImplementedError

    def end_token_ids(self) -> tuple[int, ...]:
        return self._tag_ids(self.end_tag)

    def _tag_ids(self, tag: str) -> tuple[int, ...]:
        tok = self.tokenizer
        if tok is None:
            raise ValueError(f"the {self.name} reasoning parser needs the tokenizer for its tag token ids")
        vocab = tok.get_vocab()
        if tag in vocab:
            return (int(vocab[tag]),)
        return tuple(int(i) for i in tok.encode(tag, add_special_tokens=False))

    def reasoning_span(self, token_ids: Sequence[int], text: str) -> tuple[int, int, int]:
        """``split``'s rule on the token ids: a start tag (after whitespace only) opens the
        reasoning, else it opens at the first token when the prompt did (``starts_in_reasoning``);
        it ends at the end tag, or with the output."""
        ids = list(token_ids)
        start_ids = self._tag_ids(self.start_tag)
        at = _find(ids, start_ids, 0)
        if at >= 0 and (at == 0 or not self.tokenizer.decode(ids[:at]).strip()):
            body = at + len(start_ids)
        elif self.starts_in_reasoning():
            body = 0
        else:
            return 0, 0, 0
        end_ids = self.end_token_ids()
        end = _find(ids, end_ids, body)
        if end < 0:
            return body, len(ids), len(ids)
        return body, end, end + len(end_ids)

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        lead = len(text) - len(text.lstrip())
        rest = text[lead:]
        if rest.startswith(self.start_tag):
            body = lead + len(self.start_tag)
        elif not final and self.start_tag.startswith(rest):
            return "", ""  # whitespace, or a start tag still arriving: undecided
        elif self.starts_in_reasoning():
            body = 0
        else:
            return None, text
        end = text.find(self.end_tag, body)
        if end < 0:
            safe = len(text) if final else len(text) - held_back(text, (self.end_tag,))
            return text[body:max(body, safe)], ""
        return text[body:end], text[end + len(self.end_tag):]


def _find(ids: list[int], sub: tuple[int, ...], start: int) -> int:
    """The first index >= start where ``sub`` occurs in ``ids``, or -1."""
    n = len(sub)
    if n == 0:
        return -1
    for i in range(start, len(ids) - n + 1):
        if ids[i] == sub[0] and tuple(ids[i:i + n]) == sub:
            return i
    return -1
