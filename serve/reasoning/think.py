"""The ``<think>...</think>`` reasoning parsers.

- ``deepseek_r1``: DeepSeek-R1 (and QwQ): its chat template opens ``<think>`` in the prompt,
  so the output is reasoning up to ``</think>`` (a leading ``<think>`` is dropped); without
  ``</think>`` it is all reasoning.
- ``qwen3``: Qwen3 thinks only when the output opens with ``<think>`` or the prompt ends
  with one (thinking-only templates); with ``enable_thinking=False`` the template closes an
  empty ``<think></think>`` in the prompt and the output is all content.
"""

from __future__ import annotations

from serve.reasoning.base import ThinkReasoningParser
from serve.reasoning.registry import ReasoningParserManager


@ReasoningParserManager.register_module(["deepseek_r1"])
class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    name = "deepseek_r1"

    def starts_in_reasoning(self) -> bool:
        return True


@ReasoningParserManager.register_module(["qwen3"])
class Qwen3ReasoningParser(ThinkReasoningParser):
    name = "qwen3"

    def starts_in_reasoning(self) -> bool:
        return self.prompt_text.rstrip().endswith(self.start_tag)
