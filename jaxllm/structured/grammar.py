"""A request's structured-output constraint -> a compiled llguidance grammar.

:func:`grammar_text` writes the llguidance grammar for each kind of
``StructuredOutputsParams`` (JSON schema, JSON object, regex, choice, Lark / EBNF grammar,
structural tag), with vLLM's options (compact whitespace, a whitespace pattern, no
additional properties).  :class:`GrammarCompiler` compiles it against the tokenizer once per
distinct grammar text, keeps the compiled matcher in an LRU cache shared by every request
(and every thread: the server's input processing and the engine thread), and hands each
request its own copy (``LLMatcher.deep_copy``, cheap next to a compile).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict

import llguidance

from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.structured.config import BACKENDS, StructuredOutputsConfig

log = logging.getLogger("jaxllm.structured")

__all__ = ["BACKENDS", "GrammarCompiler", "GrammarError", "StructuredOutputsConfig", "grammar_text"]


class GrammarError(ValueError):
    """The constraint does not compile (bad schema, regex or grammar): the message says why."""


def _no_additional_properties(schema):
    """A copy of ``schema`` where every object schema that does not say otherwise gets
    ``additionalProperties: false`` (vLLM's ``disable_additional_properties``)."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _json_schema(value, what: str):
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise GrammarError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, (dict, bool)):
        raise GrammarError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _structural_tag(value) -> str:
    """vLLM's structural tag ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``
    as llguidance structural tags: free text until a trigger, then the structure's begin,
    JSON of its schema, and its end."""
    spec = _json_schema(value, "structural_tag")
    if not isinstance(spec, dict) or not isinstance(spec.get("structures"), list) or not isinstance(
            spec.get("triggers"), list):
        raise GrammarError('structural_tag must be {"structures": [{"begin", "schema", "end"}, ...], '
                           '"triggers": [...]}')
    tags = []
    for s in spec["structures"]:
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise GrammarError("structural_tag: every structure needs string 'begin' and 'end' and a 'schema'")
        trigger = next((t for t in spec["triggers"] if isinstance(t, str) and t and s["begin"].startswith(t)), None)
        if trigger is None:
            raise GrammarError(f"structural_tag: no trigger starts the structure's begin {s['begin']!r}")
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"],
                                         grammar=json.dumps(_json_schema(s.get("schema", {}), "structural_tag "
                                                                         "schema")), end=s["end"]))
    if not tags:
        raise GrammarError("structural_tag: 'structures' is empty")
    return llguidance.StructTag.to_grammar(tags)


def grammar_text(so: StructuredOutputsParams, config: StructuredOutputsConfig | None = None) -> str:
    """The llguidance grammar (its serialized text) for ``so``.  Raises GrammarError for input
    that is malformed before compiling (not JSON, an unknown grammar syntax)."""
    config = config or StructuredOutputsConfig()
    kind = so.kind
    try:
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else _json_schema(so.json, "json")
            if so.disable_additional_properties or config.disable_additional_properties:
                schema = _no_additional_properties(schema)
            options: dict = {"whitespace_flexible": not (so.disable_any_whitespace or config.disable_any_whitespace)}
            if so.whitespace_pattern is not None:
                options["whitespace_pattern"] = so.whitespace_pattern
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if kind == "regex":
            return llguidance.grammar_from("regex", so.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(so.choice))
        if kind == "grammar":
            return llguidance.grammar_from("grammar", so.grammar)
        return _structural_tag(so.structural_tag)
    except GrammarError:
        raise
    except (ValueError, TypeError, AssertionError) as e:
        raise GrammarError(f"{kind}: {e}") from None


class GrammarCompiler:
    """Compiles constraints for one tokenizer; one per engine, shared by its threads."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 config: StructuredOutputsConfig | None = None):
        """``vocab_size``: the model's (may exceed the tokenizer's: the ids past it are never
        allowed in a constrained row); ``eos_token_ids``: allowed once a grammar is complete."""
        self.config = config or StructuredOutputsConfig()
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.n_vocab = max(vocab_size, len(tokenizer))
        """llguidance's vocabulary: the model's, or the tokenizer's if that is larger."""
        self._tokenizer = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary (built on first use: ~0.5 s for 49k tokens)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf   # imports transformers: only when a grammar is first needed
                t0 = time.perf_counter()
                n = self.n_vocab
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=n,
                                                               eos_token=list(self.eos_token_ids) or None)
                log.info("structured outputs: llguidance tokenizer of %d tokens in %.2f s", n,
                         time.perf_counter() - t0)
            return self._tokenizer

    def compile(self, so: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The compiled (cached) matcher of ``so``'s grammar: never consume tokens with it, take
        :meth:`matcher`.  Raises GrammarError saying why it does not compile."""
        text = grammar_text(so, self.config)
        with self._lock:
            m = self._cache.get(text)
            if m is not None:
                self._cache.move_to_end(text)
                self.hits += 1
                return m
        tok = self.tokenizer
        err = llguidance.LLMatcher.validate_grammar(text, tok)
        if err:
            raise GrammarError(f"{so.kind}: {err}")
        m = llguidance.LLMatcher(tok, text, log_level=0)
        if m.is_error():
            raise GrammarError(f"{so.kind}: {m.get_error()}")
        with self._lock:
            self.misses += 1
            self._cache[text] = m
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
        return m

    def matcher(self, so: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher of ``so`` for one request (a copy of the cached compile)."""
        return self.compile(so).deep_copy()
