"""SamplingParams: what a request asks of the sampler and the stop logic, with vLLM's meaning.

Field names, defaults, ranges and error messages follow vLLM's ``SamplingParams`` so that
code written for vLLM ports with an import change.  Every check raises ``ValueError``
naming the parameter; the server turns that into an HTTP 400.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, fields
from typing import Any

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's ``StructuredOutputsParams``).

    Exactly one of the constraint fields is set: ``json`` (a JSON schema, as a dict or its
    JSON text), ``regex``, ``choice`` (the output is one of these strings), ``grammar`` (Lark
    or EBNF text), ``json_object`` (any JSON object) or ``structural_tag`` (vLLM's
    structural-tag JSON).  Whether the constraint compiles is checked at admission.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    _KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self):
        set_ = [k for k in self._KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError("structured_outputs: exactly one of json, regex, choice, grammar, json_object, "
                             f"structural_tag must be set, got {set_ or 'none'}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                    isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", list(self.choice))

    @property
    def kind(self) -> str:
        """The name of the one constraint field that is set."""
        return next(k for k in self._KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    n: int = 1
    """Number of completions returned for the prompt."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    """0 (anything below 1e-5) is greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1 disables."""
    min_p: float = 0.0
    seed: int | None = None
    """Makes the draw reproducible; unseeded requests get a random 64-bit seed at admission."""
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    """None: up to the model's context length."""
    min_tokens: int = 0
    logprobs: int | None = None
    """Number of top logprobs per output token (raw, before any processing)."""
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    """A grammar the output must follow (JSON schema, regex, choice, grammar)."""
    extra_args: dict[str, Any] | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()
        if self.temperature < SAMPLING_EPS:
            # Greedy: the truncation parameters cannot change an argmax.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        # Resolved by the engine at admission (vLLM's private fields of the same names):
        # stop ids that min_tokens suppresses (stop_token_ids plus the model's EOS ids), and
        # bad_words as token-id sequences.
        self._all_stop_token_ids: set[int] = set(self.stop_token_ids)
        self._bad_words_token_ids: list[list[int]] | None = None

    def _verify(self) -> None:
        def num(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{name} must be a number, got {v!r}")
            return v

        def integer(name, v=None):
            v = getattr(self, name) if v is None else v
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an integer, got {v!r}")
            return v

        if integer("n") < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if not -2.0 <= num("presence_penalty") <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= num("frequency_penalty") <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if num("repetition_penalty") <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if num("temperature") < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < num("top_p") <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if integer("top_k") < 0:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= num("min_p") <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None:
            integer("seed")
        if self.max_tokens is not None and integer("max_tokens") < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if integer("min_tokens") < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        if self.logprobs is not None and integer("logprobs") < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and integer("prompt_logprobs") < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must be a string or a list of strings, got {s!r}")
            if not s:
                raise ValueError("stop cannot contain an empty string.")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids is not None and empty!")
            for t in self.allowed_token_ids:
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise ValueError(f"allowed_token_ids must be non-negative integers, got {t!r}")
        if self.logit_bias is not None:
            clean = {}
            for k, v in self.logit_bias.items():
                try:
                    tok = int(k)
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ValueError(f"logit_bias values must be numbers, got {v!r}")
                if not math.isfinite(v):
                    raise ValueError(f"logit_bias values must be finite, got {v!r} for token {tok}")
                clean[tok] = float(v)
            self.logit_bias = clean
        if self.bad_words is not None:
            for w in self.bad_words:
                if not isinstance(w, str):
                    raise ValueError(f"bad_words must be a list of strings, got {w!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if self.n > 1 and self.temperature < SAMPLING_EPS:
            raise ValueError("n must be 1 when using greedy sampling (temperature 0), got n="
                             f"{self.n}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        """stop_token_ids plus the model's EOS ids once the engine has resolved them: the ids
        min_tokens keeps from being sampled (EOS included even with ignore_eos, as in vLLM)."""
        return self._all_stop_token_ids

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """bad_words as token-id sequences, after :meth:`update_from_tokenizer`."""
        return self._bad_words_token_ids

    def update_from_eos(self, eos_token_ids) -> None:
        """Adds the model's EOS ids to :attr:`all_stop_token_ids` (vLLM's update_from_generation_config)."""
        self._all_stop_token_ids = set(self.stop_token_ids) | set(eos_token_ids)

    def update_from_tokenizer(self, tokenizer) -> None:
        """Tokenizes bad_words as vLLM does: each word alone and after a space (when the space
        makes it a different token sequence of the same length), without special tokens."""
        if not self.bad_words:
            return
        seqs: list[list[int]] = []
        for word in self.bad_words:
            for prefix_space in (False, True):
                ids = tokenizer.encode(("" if not prefix_space else " ") + word.lstrip(), add_special_tokens=False)
                if not ids:
                    raise ValueError(f"bad_words: {word!r} encodes to no tokens")
                if not prefix_space or (ids[0] != seqs[-1][0] and len(ids) == len(seqs[-1])):
                    seqs.append(list(ids))
        self._bad_words_token_ids = seqs

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)

    def replace(self, **changes) -> "SamplingParams":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return SamplingParams(**values)
