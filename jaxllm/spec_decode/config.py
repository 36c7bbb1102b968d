"""``--speculative-config``: speculative decoding's engine-wide settings, in vLLM's JSON shape
(``LLM(speculative_config={...})`` takes the same dict).  Kept apart from the proposers so the
engine configuration imports nothing heavy.

Methods:

- ``ngram``: prompt lookup.  The last ``n`` tokens of the request (``prompt_lookup_max``
  down to ``prompt_lookup_min``) are looked up earlier in its prompt and output; the tokens
  that followed there are proposed.  No model.
- ``draft_model``: a smaller checkpoint with the same vocabulary (``model``) proposes.

Whatever proposes, a proposal is accepted only where it equals the token plain decoding
draws at that position (``sample/sampler.accept``), so speculation changes the speed, never
the output.  ``min_acceptance_rate`` is jaxllm's off-switch: a request whose recent proposals
are rarely accepted stops proposing for a while (``spec_decode/controller.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")
_NOT_HERE = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp", "suffix")
"""vLLM methods jaxllm does not have (yet): refused by name, not ignored."""

FLAG = "--speculative-config"


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 0
    """Tokens proposed per request and step (k); the verification scores k + 1 positions."""
    model: str | None = None
    """``draft_model``: the draft checkpoint (an HF folder, a .gguf file or a Hub repo id,
    downloaded as the target model is, into ``--download-dir``)."""
    revision: str | None = None
    """``draft_model``: the branch, tag or commit of a Hub draft id (vLLM's key); None: main."""
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    """``ngram``: the n-gram lengths tried, longest first (vLLM's defaults: both 5 when neither
    is given, else the one given for both)."""
    min_acceptance_rate: float = 0.25
    """Off-switch: when fewer than this share of a request's last ``acceptance_window``
    judged tokens were accepted, the request stops proposing (0 turns it off).  A
    verification judges its proposals up to the first rejected one, so the rate does not fall
    with k (spec_decode/controller.py)."""
    acceptance_window: int = 32
    """Judged proposed tokens the acceptance rate is measured over."""
    probe_interval: int = 64
    """Steps a switched-off request waits before it proposes again (doubling each time the rate
    is still too low, up to 16 times this)."""
    cost_model: bool = True
    """Choose each step's k by the measured step time of its bucket against the expected
    accepted tokens (spec_decode/controller.py); off: always k."""

    def __post_init__(self):
        if self.method in _NOT_HERE:
            raise ValueError(f"{FLAG}: method {self.method!r} is not available in jaxllm; "
                             f"expected one of {', '.join(METHODS)}")
        if self.method not in METHODS:
            raise ValueError(f"{FLAG}: unknown method {self.method!r}; expected one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"{FLAG}: num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(f"{FLAG}: method draft_model needs \"model\" (the draft checkpoint)")
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError(f"{FLAG}: prompt_lookup_min/max are ngram settings; method is draft_model")
            if self.revision is not None and (not isinstance(self.revision, str) or not self.revision.strip()):
                raise ValueError(f"{FLAG}: revision must be a non-empty string, got {self.revision!r}")
        else:
            if self.model is not None or self.revision is not None:
                raise ValueError(f"{FLAG}: method ngram takes no \"model\" nor \"revision\"")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = 5
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"{FLAG}: {name} must be a positive integer, got {v!r}")
            if lo > hi:
                raise ValueError(f"{FLAG}: prompt_lookup_min={lo} is larger than prompt_lookup_max={hi}")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        r = self.min_acceptance_rate
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
            raise ValueError(f"{FLAG}: min_acceptance_rate must be a number in [0, 1], got {r!r}")
        if not isinstance(self.cost_model, bool):
            raise ValueError(f"{FLAG}: cost_model must be true or false, got {self.cost_model!r}")
        for name in ("acceptance_window", "probe_interval"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{FLAG}: {name} must be a positive integer, got {v!r}")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """A config from itself, a dict or JSON text (the CLI flag), or None (speculation off).
        Unknown keys are refused; vLLM's spelling ``"model": "ngram"`` names the method."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{FLAG}: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{FLAG} must be a JSON object, e.g. "
                             '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
        value = dict(value)
        if value.get("model") in ("ngram", "[ngram]") and value.get("method") in (None, "ngram"):
            value.pop("model")
            value["method"] = "ngram"
        if "method" not in value:
            if value.get("model") is None:
                raise ValueError(f"{FLAG}: give \"method\" ({', '.join(METHODS)}) or a draft \"model\"")
            value["method"] = "draft_model"
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{FLAG}: unknown key(s) {unknown}; known: {sorted(known)}")
        if "num_speculative_tokens" not in value:
            raise ValueError(f"{FLAG}: num_speculative_tokens is required")
        return cls(**value)
