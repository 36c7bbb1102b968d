"""Structured outputs offline (``SamplingParams(structured_outputs=...)``): every kind of
constraint is obeyed, the grammar bitmask never leaks into another row, the grammar state
survives preemption and is per sequence for n > 1, and a constraint that does not compile
is refused naming the field.  The tiny random-weight Llama's unconstrained output is
gibberish, so obeying a grammar is the grammar's doing."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from support.engines import SMALL_ENGINE

from jaxllm import LLM, SamplingParams
from jaxllm.engine.processor import InvalidRequestError
from jaxllm.sampling_params import StructuredOutputsParams as SO

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
EMAIL = r"[a-z]{2,6}@(foo|bar)\.(com|org)"
LARK = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'


def gen(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [c for o in outs for c in o.outputs]


def sp(so, **kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": 60, "structured_outputs": so, **kw})


def test_every_kind_of_constraint_is_obeyed(tiny_llm):
    prompts = ["Describe a person:", "An email:", "Yes or no?", "Sum:", "Any object:"]
    params = [sp(SO(json=PERSON, disable_any_whitespace=True)), sp(SO(regex=EMAIL)),
              sp(SO(choice=["yes", "no", "maybe"])), sp(SO(grammar=LARK)), sp(SO(json_object=True), max_tokens=80)]
    outs = gen(tiny_llm, prompts, params)
    person, email, choice, expr, obj = outs
    jsonschema.validate(json.loads(person.text), PERSON)
    assert person.finish_reason == "stop"
    assert re.fullmatch(EMAIL, email.text), email.text
    assert choice.text in ("yes", "no", "maybe")
    assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", expr.text), expr.text
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.lstrip().startswith("{")


def test_seeded_random_rows_obey_the_grammar_too(tiny_llm):
    params = [sp(SO(json=PERSON, disable_any_whitespace=True), temperature=1.0, seed=s) for s in range(3)]
    for out in gen(tiny_llm, ["A person:"] * 3, params):
        jsonschema.validate(json.loads(out.text), PERSON)


def test_mask_never_leaks_across_rows(tiny_llm):
    """A constrained and an unconstrained request in one batch give each the tokens it gives
    alone, greedy and seeded."""
    free = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=7, max_tokens=20, ignore_eos=True)]
    tight = [sp(SO(regex=EMAIL)), sp(SO(choice=["alpha", "beta"]), temperature=0.8, seed=3)]
    prompts = ["The weather today is", "Once upon a time"]
    solo = [gen(tiny_llm, [p], [q])[0].token_ids for p, q in zip(prompts * 2, free + tight)]
    together = [c.token_ids for c in gen(tiny_llm, prompts * 2, free + tight)]
    assert together == solo
    assert gen(tiny_llm, [prompts[0]], [free[0]])[0].token_ids != solo[2]


def test_n_sequences_each_follow_their_own_grammar(tiny_llm):
    outs = gen(tiny_llm, ["People:"], [sp(SO(json=PERSON, disable_any_whitespace=True), n=3, temperature=1.0,
                                          seed=11)])
    assert len(outs) == 3
    for out in outs:
        jsonschema.validate(json.loads(out.text), PERSON)
    assert len({o.text for o in outs}) > 1


def test_preemption_and_prefix_cache_hits_keep_the_grammar_state(tiny_llama, tiny_llm):
    """Under preemption (a pool too small for the batch) and on a prefix-cache hit, every
    constrained request gives the tokens it gives alone on a roomy engine."""
    llm = LLM(tiny_llama, **{**SMALL_ENGINE, "num_blocks_override": 10, "max_model_len": 128})
    prompts = [" ".join(f"word{i}x{j}" for j in range(8)) for i in range(4)]   # ~30 tokens each
    params = [sp(SO(json=PERSON, disable_any_whitespace=True), max_tokens=80) for _ in prompts]
    outs = gen(llm, prompts, params)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    solo = [gen(tiny_llm, [p], [q])[0] for p, q in zip(prompts, params)]
    for out, ref in zip(outs, solo):
        jsonschema.validate(json.loads(out.text), PERSON)
        assert out.token_ids == ref.token_ids
    hit = tiny_llm.generate(prompts[:1], params[0], use_tqdm=False)[0]   # the prompt's blocks are cached now
    assert hit.num_cached_tokens > 0 and hit.outputs[0].token_ids == solo[0].token_ids


@pytest.mark.parametrize("so, needle", [
    (SO(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "strin"),
    (SO(json="{not json"), "not valid JSON"),
    (SO(regex="(ab"), "unclosed group"),
    (SO(grammar="start: undefined_rule"), "undefined_rule"),
])
def test_a_constraint_that_does_not_compile_is_refused(tiny_llm, so, needle):
    with pytest.raises(InvalidRequestError, match=re.escape(needle)) as e:
        tiny_llm.generate(["x"], sp(so), use_tqdm=False)
    assert e.value.param == "structured_outputs"
    assert not tiny_llm.llm_engine.has_unfinished_requests()


def test_grammar_applies_after_reasoning_ends(tiny_llama, tiny_llm):
    """With reasoning end ids configured, the output is free until one of them is generated
    (a logit bias forces it first here), then the grammar holds; without them (as with
    ``enable_in_reasoning``) the grammar masks from the first token."""
    end = 1500   # stands for </think>; not a token of "yes" / "no"
    params = sp(SO(choice=["yes", "no"]), logit_bias={end: 100.0})
    out = gen(tiny_llm, ["Think first."], [params])[0]
    assert end not in out.token_ids and out.text in ("yes", "no"), out.token_ids
    llm = LLM(tiny_llama, **SMALL_ENGINE, structured_outputs_config={"reasoning_end_token_ids": [end]})
    out = gen(llm, ["Think first."], [params])[0]
    assert out.token_ids[0] == end, out.token_ids
    answer = llm.get_tokenizer().decode(out.token_ids[1:], skip_special_tokens=True)
    assert answer in ("yes", "no"), out.token_ids
    # an end token already in the prompt (a template closing an empty reasoning block):
    # constrained from the first output token, the bias on the end token notwithstanding
    ids = llm.get_tokenizer().encode("Think first.") + [end]
    out = gen(llm, [{"prompt_token_ids": ids}], [params])[0]
    assert end not in out.token_ids and out.text in ("yes", "no"), out.token_ids


def test_reasoning_end_tag_becomes_its_token_id(smollm_tokenizer_dir, caplog):
    """``jaxllm serve --reasoning-parser`` names the end tag as text; the engine turns it into
    the tokenizer's id, and says so when the tag is not one token (then no reasoning wait)."""
    from transformers import AutoTokenizer

    from jaxllm.structured.config import StructuredOutputsConfig
    tok = AutoTokenizer.from_pretrained(smollm_tokenizer_dir)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = StructuredOutputsConfig(reasoning_end_tag="<|im_end|>").with_tag_resolved(tok)
    assert cfg.reasoning_end_token_ids == (im_end,) and cfg.reasoning_end_tag == ""
    with caplog.at_level("WARNING", logger="jaxllm.structured"):
        cfg = StructuredOutputsConfig(reasoning_end_tag="</think>").with_tag_resolved(tok)
    assert cfg.reasoning_end_token_ids == () and "not one token" in caplog.text


def test_serve_reasoning_parser_sets_the_end_tag():
    from jaxllm import cli
    from serve.cli import serving_config_from_args, with_reasoning_end
    p = cli.build_parser()
    for extra, want in [(["--reasoning-parser", "deepseek_r1"], "</think>"), ([], ""),
                        (["--reasoning-parser", "qwen3", "--structured-outputs-config",
                          '{"reasoning_end_token_ids": [7]}'], "")]:
        args = p.parse_args(["serve", *extra])
        cfg = with_reasoning_end(cli.engine_config_from_args(args), serving_config_from_args(args))
        assert cfg.structured_outputs_config.reasoning_end_tag == want, extra


def test_structured_outputs_config_flag():
    from jaxllm import cli
    from jaxllm.structured.config import StructuredOutputsConfig

    p = cli.build_parser()
    args = p.parse_args(["generate", "--structured-outputs-config", '{"backend": "guidance", '
                         '"disable_any_whitespace": true}', "hi"])
    assert cli.engine_config_from_args(args).structured_outputs_config == StructuredOutputsConfig(
        backend="guidance", disable_any_whitespace=True)
    for bad, needle in [('{"backend": "xgrammar"}', "xgrammar"), ('{"foo": 1}', "foo"), ("nope", "JSON")]:
        args = p.parse_args(["generate", "--structured-outputs-config", bad, "hi"])
        with pytest.raises(ValueError, match=needle):
            cli.engine_config_from_args(args)


def test_json_whitespace_is_compact_by_default_and_flexible_on_request():
    """Compact JSON by default (docs/BENCHMARKS.md, "Structured outputs: whitespace": sampled
    outputs complete within max_tokens more often); ``disable_any_whitespace: false``
    engine-wide gives llguidance's flexible whitespace, where a request's own flag still makes
    it compact."""
    from jaxllm.structured.config import StructuredOutputsConfig
    from jaxllm.structured.grammar import grammar_text

    def flexible(so, config=None):
        return json.loads(grammar_text(so, config))["grammars"][0]["json_schema"]["x-guidance"]["whitespace_flexible"]

    engine_flexible = StructuredOutputsConfig.parse('{"disable_any_whitespace": false}')
    assert flexible(SO(json=PERSON)) is False
    assert flexible(SO(json_object=True)) is False
    assert flexible(SO(json=PERSON), engine_flexible) is True
    assert flexible(SO(json=PERSON, disable_any_whitespace=True), engine_flexible) is False


def test_what_json_whitespace_each_setting_accepts(smollm_tokenizer_dir):
    """The README's rule, on llguidance's matcher: compact accepts no whitespace between JSON
    tokens, flexible any (newlines too), a request's whitespace pattern exactly its pattern."""
    import llguidance
    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    from jaxllm.structured.config import StructuredOutputsConfig
    from jaxllm.structured.grammar import grammar_text

    tok = PreTrainedTokenizerFast.from_pretrained(smollm_tokenizer_dir)
    ll_tok = llguidance.hf.from_tokenizer(tok)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    flexible = StructuredOutputsConfig(disable_any_whitespace=False)

    def accepts(grammar, text):
        m = llguidance.LLMatcher(ll_tok, grammar)
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and not m.is_error()

    texts = ['{"a":1}', '{"a": 1}', '{\n  "a" : 1 }']
    assert [accepts(grammar_text(SO(json=schema)), t) for t in texts] == [True, False, False]
    assert [accepts(grammar_text(SO(json=schema), flexible), t) for t in texts] == [True, True, True]
    assert [accepts(grammar_text(SO(json=schema, whitespace_pattern="[ ]?")), t) for t in texts] == [True, True, False]


def test_structural_tag_and_schema_options_compile(tiny_llm):
    from jaxllm.structured.grammar import GrammarError, _no_additional_properties
    gc = tiny_llm.llm_engine.grammar
    tag = {"structures": [{"begin": "<function=get>", "schema": {"type": "object"}, "end": "</function>"}],
           "triggers": ["<function="]}
    m = gc.matcher(SO(structural_tag=tag))
    assert not m.is_error()
    with pytest.raises(GrammarError, match="trigger"):
        gc.compile(SO(structural_tag={"structures": [{"begin": "<x>", "schema": {}, "end": ""}], "triggers": ["<y"]}))
    assert _no_additional_properties({"type": "object", "properties": {"a": {"type": "object"}}}) == {
        "type": "object", "properties": {"a": {"type": "object", "additionalProperties": False}},
        "additionalProperties": False}
    hits = gc.hits
    gc.compile(SO(structural_tag=tag))
    assert gc.hits == hits + 1          # the same grammar is compiled once


def test_a_constrained_request_compiles_nothing(tiny_llm):
    from jaxllm.runner import compile as cc
    gen(tiny_llm, ["warm"], [sp(SO(regex="[0-9]{2}"))])
    before = cc.counts()
    out = gen(tiny_llm, ["Digits:", "More"], [sp(SO(regex="[0-9]{4}")), sp(SO(json={"type": "array"}), max_tokens=8)])
    assert re.fullmatch("[0-9]{4}", out[0].text)
    after = cc.counts()
    assert (after["traces"], after["compiles"]) == (before["traces"], before["compiles"])
