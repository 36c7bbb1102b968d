"""Reasoning parsers: a model's output -> (reasoning, content) (``--reasoning-parser``).

Built in: deepseek_r1 and qwen3 (the ``<think>...</think>`` family).
"""

from serve.reasoning.base import ReasoningDelta, ReasoningParser, ThinkReasoningParser
from serve.reasoning.registry import ReasoningParserManager

__all__ = ["ReasoningDelta", "ReasoningParser", "ReasoningParserManager", "ThinkReasoningParser"]
