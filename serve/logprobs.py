"""Logprobs in the response shapes, rendered straight from the engine's ``Logprob`` objects.

A position's logprobs arrive as ``{token id: Logprob(logprob, rank, decoded_token)}`` (the
output processor made them once, from the runner's arrays); the chosen token comes first.
Three shapes: the legacy completions one (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``), chat's ``content`` list, and vLLM's ``prompt_logprobs``.  JSON has no
-inf, so a logprob is clamped at -9999 (as vLLM does).
"""

from __future__ import annotations

from typing import Iterable

from jaxllm.outputs import Logprob
from serve.protocol import (ChatCompletionLogProb, ChatCompletionLogProbs, ChatCompletionLogProbsContent,
                            CompletionLogProbs)

Step = dict[int, Logprob]
FLOOR = -9999.0


def _value(lp: Logprob) -> float:
    return max(lp.logprob, FLOOR)


def token_str(tokenizer, tid: int, lp: Logprob | None, as_token_ids: bool = False) -> str:
    """How a logprob names its token: the decoded text, or ``token_id:N`` (vLLM's
    ``return_tokens_as_token_ids``, and without a tokenizer)."""
    if as_token_ids:
        return f"token_id:{tid}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([tid]) if tokenizer is not None else f"token_id:{tid}"


def completion_logprobs(tokenizer, positions: Iterable[tuple[int, Step | None]], num: int,
                        initial_offset: int, as_token_ids: bool = False) -> CompletionLogProbs:
    """``positions``: (token id, its logprobs or None, e.g. the first prompt token's).  Top
    entries are the chosen token and the ``num`` most likely (as vLLM and the old OpenAI API
    return them)."""
    offsets: list[int] = []
    token_lps: list[float | None] = []
    tokens: list[str] = []
    tops: list[dict[str, float] | None] = []
    offset = initial_offset
    for tid, step in positions:
        lp = step.get(tid) if step is not None else None
        token = token_str(tokenizer, tid, lp, as_token_ids)
        token_lps.append(_value(lp) if lp is not None else None)
        tops.append(None if step is None else
                    {token_str(tokenizer, k, v, as_token_ids): _value(v)
                     for j, (k, v) in enumerate(step.items()) if j <= num})
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
    # Built in one go: stream chunks are dumped with only the fields that were set.
    return CompletionLogProbs(text_offset=offsets, token_logprobs=token_lps, tokens=tokens, top_logprobs=tops)


def chat_logprobs(tokenizer, token_ids: list[int], steps: list[Step] | None, top_n: int,
                  as_token_ids: bool = False) -> ChatCompletionLogProbs:
    content = []
    for i, tid in enumerate(token_ids):
        step = steps[i] if steps is not None and i < len(steps) else {}
        lp = step.get(tid)
        token = token_str(tokenizer, tid, lp, as_token_ids)
        # OpenAI's top_logprobs: the top_n most likely tokens, most likely first.
        ranked = sorted(step.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
        tops = [ChatCompletionLogProb(token=(t := token_str(tokenizer, k, v, as_token_ids)), logprob=_value(v),
                                      bytes=list(t.encode("utf-8", errors="replace")))
                for k, v in ranked[:top_n]]
        content.append(ChatCompletionLogProbsContent(
            token=token, logprob=_value(lp) if lp is not None else FLOOR,
            bytes=list(token.encode("utf-8", errors="replace")), top_logprobs=tops))
    return ChatCompletionLogProbs(content=content)


def prompt_logprobs_json(plp: list[Step | None] | None) -> list | None:
    """vLLM's shape: None for the first prompt token, then {token id: {logprob, rank, decoded_token}}."""
    if plp is None:
        return None
    return [None if step is None else
            {str(k): {"logprob": _value(v), "rank": v.rank, "decoded_token": v.decoded_token} for k, v in step.items()}
            for step in plp]
