"""The pooling runner end to end, offline: ``LLM(path)`` on a tiny random BERT saved as a
sentence-transformers folder embeds as ``SentenceTransformer.encode`` does (float32), for MEAN
pooling and for CLS pooling + Normalize, read from the folder's own files, and an XLM-RoBERTa
(positions offset past the padding id); a batch equals its
inputs alone; Matryoshka ``dimensions`` (``PoolingParams``, ``--pooler-config``) cut as
``SentenceTransformer(truncate_dim=d)`` does; wrong uses are ValueErrors naming what to use.
Steps of short prompts run in the runner's grid programs (the narrowest that holds them), a
precompiled engine compiles nothing more, and a second start loads every program from the
persistent compile cache."""

from __future__ import annotations

import json
import subprocess

import jax
import numpy as np
import pytest

from jaxllm import LLM, PoolingParams
from jaxllm.config import EngineConfig
from jaxllm.models.bert import model as bert
from jaxllm.models.bert.model import attention_layout
from jaxllm.runner import compile as cc
from support.probes import probe_command, probe_env
from support.tiny_encoders import build_bert_st, declare_matryoshka, st_encode

# Small buckets (16, 32, 64 tokens), the strict compile guard on: a step never traces or compiles
# a bucket it already built.
POOLING_ENGINE = dict(max_num_batched_tokens=64, max_num_seqs=8, strict_compile_guard=True)
TEXTS = ["the cat sat on the mat", "a dog", "search rank embed model query document jax engine token vector",
         "sky", "the big red house by the river is not small, and the green tree is tall!"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert_st")
    return {"mean": build_bert_st(str(root / "mean"), "mean"),
            # Matryoshka with the sizes it allows (vLLM's matryoshka_dimensions).
            "cls_normalize": declare_matryoshka(build_bert_st(str(root / "cls"), "cls", normalize=True, seed=1),
                                                [8, 16]),
            "xlm_roberta_mean": build_bert_st(str(root / "xlmr"), "mean", seed=2, model="xlm-roberta")}


@pytest.fixture(scope="module")
def llms(folders):
    # runner="auto" (the default) picks the pooling runner for an encoder checkpoint.
    return {name: LLM(path, **POOLING_ENGINE) for name, path in folders.items()}


def _vectors(outs) -> np.ndarray:
    return np.array([o.outputs.embedding for o in outs], np.float32)


@pytest.mark.parametrize("name", ["mean", "cls_normalize", "xlm_roberta_mean"])
def test_embeddings_match_sentence_transformers(folders, llms, name):
    llm = llms[name]
    assert llm.pooling_engine.pooler.pooling_type == {"mean": "MEAN", "cls_normalize": "CLS",
                                                      "xlm_roberta_mean": "MEAN"}[name]
    got = _vectors(llm.embed(TEXTS))
    ref = st_encode(folders[name], TEXTS)
    assert got.shape == ref.shape == (len(TEXTS), 32)
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.99999, cos
    assert np.abs(got - ref).max() <= 1e-4
    if name == "cls_normalize":
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


def test_a_mixed_batch_equals_each_input_alone(llms):
    llm = llms["mean"]
    batch = _vectors(llm.embed(TEXTS))
    alone = np.concatenate([_vectors(llm.embed([t])) for t in TEXTS])
    # Different buckets sum in different orders: equal to float32 rounding, not bit for bit.
    np.testing.assert_allclose(batch, alone, rtol=0, atol=1e-6)


def test_prompts_attended_row_by_row_match_sentence_transformers(folders):
    """With ``max_model_len`` 16 the 64-token bucket lays attention out per prompt (each prompt
    moved into a row of an [8, 16] grid, the rows attended one after another): still
    sentence-transformers' vectors."""
    assert attention_layout(64, POOLING_ENGINE["max_num_seqs"], 16) == "per_prompt"
    llm = LLM(folders["mean"], max_model_len=16, **POOLING_ENGINE)
    short = [t for t in TEXTS if len(llm.get_tokenizer().encode(t)) <= 16]
    texts = short + [t.upper() for t in short[::-1]]
    assert 32 < sum(len(llm.get_tokenizer().encode(t)) for t in texts) <= 64 and len(texts) <= 8   # one 64-token step
    got = _vectors(llm.embed(texts))
    ref = st_encode(folders["mean"], texts)
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.99999, cos
    assert np.abs(got - ref).max() <= 1e-4


@pytest.mark.parametrize("group_tokens", [32, bert.GROUP_TOKENS])
def test_whole_layers_in_grid_rows_equal_the_flat_encoder(llms, monkeypatch, group_tokens):
    """A step whose ``[rows, max_len]`` grid is no bigger than the step runs every layer in the
    grid (the rows layout), groups of rows one after another: the same hidden states as the flat
    encoder under the dense same-prompt mask (which matches sentence-transformers above), for
    prompts of ``max_len`` tokens and shorter, two empty rows and padding after the last prompt;
    with 32-token groups (2 rows of 16: four groups; the flat reference then runs the part after
    attention in four 32-token pieces) and the default (one group of 8 rows, one flat piece)."""
    monkeypatch.setattr(bert, "GROUP_TOKENS", group_tokens)
    runner = llms["mean"].pooling_engine.runner
    T, rows, max_len = 128, 8, 16
    assert bert.encoder_layout(T, rows, max_len) == "rows" and bert.encoder_layout(T, rows + 1, max_len) != "rows"
    assert bert.group_rows(rows, max_len) == min(rows, group_tokens // max_len)
    lengths = [16, 5, 16, 9, 1, 16]                     # rows 6 and 7 empty; 63 tokens, then padding
    rng = np.random.default_rng(0)
    seq = np.full(T, -1, np.int32)
    seq[:sum(lengths)] = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    pos = np.zeros(T, np.int32)
    pos[:sum(lengths)] = np.concatenate([np.arange(n) for n in lengths])
    ids = np.where(seq >= 0, rng.integers(5, runner.arch.vocab_size, T), 0).astype(np.int32)
    types = (pos % 2).astype(np.int32)
    run = jax.jit(lambda *a: bert.encode(*a), static_argnums=(0, 6, 7))   # a fresh trace: GROUP_TOKENS is read then
    got = np.asarray(run(runner.arch, runner.params, ids, pos, seq, types, max_len, rows))        # [T, D]
    want = np.asarray(run(runner.arch, runner.params, ids, pos, seq, types, None, None))         # dense
    real = seq >= 0
    np.testing.assert_allclose(got[real], want[real], rtol=0, atol=1e-5)
    assert not got[~real].any()


def _id_prompts(llm, lengths: list[int], seed: int) -> list[list[int]]:
    """[CLS] + random word ids + [SEP], ``lengths`` tokens each."""
    tok, rng = llm.get_tokenizer(), np.random.default_rng(seed)
    return [[tok.cls_token_id, *rng.integers(5, tok.vocab_size, n - 2).tolist(), tok.sep_token_id] for n in lengths]


# Steps up to 256 tokens: the 256-token bucket has grid programs (runner.GRID_MIN_TOKENS).
GRID_ENGINE = dict(max_num_batched_tokens=256, max_num_seqs=8, strict_compile_guard=True)


@pytest.fixture(scope="module")
def grid_llm(folders):
    return LLM(folders["mean"], **GRID_ENGINE)


def test_steps_of_short_prompts_run_in_the_narrowest_grid_that_holds_them(grid_llm, folders):
    """The runner's grid programs (``T // w`` rows of at most ``w`` tokens, BERT's rows layout):
    a step runs in the narrowest grid that holds its prompts, else in its bucket's own program
    (prompts up to ``max_model_len``); the vectors are sentence-transformers' and each prompt's
    alone, in a grid filled to its last cell and one prompt past it."""
    llm = grid_llm
    runner = llm.pooling_engine.runner
    assert llm.pooling_engine.max_model_len == 128
    assert runner.grid_widths[256] == [16, 32, 64, 128] and runner.grid_widths[128] == []
    assert runner.grid_width(256, 4, 64) == 64       # a full 4 x 64 grid
    assert runner.grid_width(256, 2, 65) == 128
    assert runner.grid_width(256, 5, 40) is None     # 5 rows: more than the 64-wide grid holds
    assert runner.grid_width(256, 1, 200) is None
    full = _id_prompts(llm, [64, 64, 64, 64], seed=3)              # one 256-token step, every cell
    over = _id_prompts(llm, [48, 48, 48, 48, 48], seed=4)          # 240 tokens, five prompts
    two = _id_prompts(llm, [100, 90], seed=5)                       # a 2 x 128 grid
    for prompts, width in ((full, 64), (over, None), (two, 128)):
        assert runner.plan([len(p) for p in prompts]) == [list(range(len(prompts)))]   # one step
        assert runner.grid_width(256, len(prompts), max(map(len, prompts))) == width
        batch = _vectors(llm.embed(prompts))
        alone = np.concatenate([_vectors(llm.embed([p])) for p in prompts])
        np.testing.assert_allclose(batch, alone, rtol=0, atol=1e-6)
    texts = [" ".join(["the cat sat on the mat"] * 6), " ".join(["a dog and the big red house by the river"] * 4),
             " ".join([TEXTS[2]] * 4), " ".join(["sky is green and the tree is tall"] * 5)]
    lengths = [len(llm.get_tokenizer().encode(t)) for t in texts]
    assert 128 < sum(lengths) <= 256 and runner.grid_width(256, len(texts), max(lengths)) == 64, lengths
    got, ref = _vectors(llm.embed(texts)), st_encode(folders["mean"], texts)
    assert np.abs(got - ref).max() <= 1e-4


def test_a_precompiled_engine_compiles_nothing_for_any_step(folders):
    """``precompile="all"`` builds every bucket's program and every grid program: steps in grids of
    each width and in a bucket's own program then trace and compile nothing."""
    cc.install_listeners()
    llm = LLM(folders["mean"], precompile="all", **GRID_ENGINE)
    before = cc.counts()
    for lengths in ([64, 64, 64, 64], [100, 90], [48] * 5, [30] * 8, [20] * 8, [16] * 8, [120], [5]):
        llm.embed(_id_prompts(llm, lengths, seed=len(lengths)))
    after = cc.counts()
    assert (after["traces"], after["compiles"]) == (before["traces"], before["compiles"])


def test_a_second_start_loads_every_program_from_the_persistent_cache(folders, tmp_path):
    """Two processes start the same encoder with every program built, on one compile cache: the
    first compiles them (persistent-cache misses), the second loads every one (no miss) and
    embeds the same vector."""
    cache = str(tmp_path / "xla")

    def start():
        r = subprocess.run(probe_command("pooling_cache_probe", folders["mean"], cache), capture_output=True,
                           text=True, timeout=300, env=probe_env())
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first, second = start(), start()
    assert first["programs"] == second["programs"] == 5 + 4          # 16 ... 256, and 4 grids of 256
    assert first["cache_misses"] >= first["programs"]
    assert second["cache_misses"] == 0 and second["cache_hits"] >= second["programs"], second
    assert second["vector"] == first["vector"]


def test_token_ids_embed_as_their_text_does(llms):
    llm = llms["mean"]
    ids = llm.get_tokenizer().encode(TEXTS[0])
    by_ids, by_text = llm.embed([ids, TEXTS[0]])
    assert by_ids.prompt_token_ids == by_text.prompt_token_ids == ids
    assert by_ids.outputs.embedding == by_text.outputs.embedding


def test_too_long_input_is_refused_naming_input_or_truncated(llms):
    llm = llms["mean"]
    long_ids = list(range(5, 100)) + [3]   # 96 tokens; the engine takes 64
    with pytest.raises(ValueError, match=r"input\[1\] has 96 tokens, more than the maximum of 64"):
        llm.embed([[5, 6], long_ids])
    # truncate_prompt_tokens keeps the last k tokens (vLLM's rule).
    (cut,) = llm.embed([long_ids], truncate_prompt_tokens=10)
    assert cut.prompt_token_ids == long_ids[-10:]
    assert cut.outputs.embedding == llm.embed([long_ids[-10:]])[0].outputs.embedding


def test_generation_on_a_pooling_model_is_a_value_error_naming_embed(llms, folders):
    with pytest.raises(ValueError, match=r"generate\(\) is for generative models.*use embed\(\)"):
        llms["mean"].generate(["the cat"])
    with pytest.raises(ValueError, match="is an encoder: it embeds rather than generates"):
        LLM(folders["mean"], runner="generate")
    with pytest.raises(ValueError, match="runner='pooling' does not take kv_cache_dtype"):
        LLM(folders["mean"], runner="pooling", kv_cache_dtype="int8")
    # The generation engine itself, built directly, refuses an encoder by name.
    with pytest.raises(ValueError, match="BertModel is an encoder: .*use the pooling runner"):
        LLM.from_engine_config(EngineConfig.from_kwargs(model=folders["mean"]))


def test_an_embedder_scores_by_cosine_similarity(folders, llms):
    """vLLM's rule for ``score`` on an embedding model: the cosine of the two embeddings."""
    ref = st_encode(folders["mean"], [TEXTS[0], TEXTS[1], TEXTS[2]])
    want = [float(ref[0] @ ref[i] / np.linalg.norm(ref[0]) / np.linalg.norm(ref[i])) for i in (1, 2)]
    got = [o.outputs.score for o in llms["mean"].score(TEXTS[0], [TEXTS[1], TEXTS[2]])]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_matryoshka_dimensions_match_sentence_transformers_truncate_dim(folders, llms):
    """Cut to the first 8 values, then normalized (the folder's Normalize), as
    ``SentenceTransformer(truncate_dim=8).encode(normalize_embeddings=True)``; ``encode`` too."""
    llm = llms["cls_normalize"]
    got = _vectors(llm.embed(TEXTS, pooling_params=PoolingParams(dimensions=8)))
    ref = st_encode(folders["cls_normalize"], TEXTS, truncate_dim=8, normalize=True)
    assert got.shape == ref.shape == (len(TEXTS), 8)
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.99999 and np.abs(got - ref).max() <= 1e-4
    encoded = np.array([o.outputs.data for o in llm.encode(TEXTS, pooling_params=PoolingParams(dimensions=8))])
    np.testing.assert_allclose(encoded, got, rtol=0, atol=1e-7)


def test_pooler_config_dimensions_is_the_default_size(folders):
    llm = LLM(folders["cls_normalize"], pooler_config={"dimensions": 16}, **POOLING_ENGINE)
    (out,) = llm.embed(TEXTS[:1])
    ref = st_encode(folders["cls_normalize"], TEXTS[:1], truncate_dim=16, normalize=True)
    np.testing.assert_allclose([out.outputs.embedding], ref, rtol=0, atol=1e-4)


def test_dimensions_refused_as_vllm_words_it(folders, llms):
    with pytest.raises(ValueError, match="does not support matryoshka representation"):
        llms["mean"].embed(TEXTS[:1], pooling_params=PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match=r"only supports \[8, 16\] matryoshka dimensions"):
        llms["cls_normalize"].embed(TEXTS[:1], pooling_params=PoolingParams(dimensions=12))
    with pytest.raises(ValueError, match="--pooler-config dimensions: .*does not support matryoshka"):
        LLM(folders["mean"], pooler_config={"dimensions": 8}, **POOLING_ENGINE)


def test_an_embedder_refuses_to_classify_naming_embed(llms):
    with pytest.raises(ValueError, match=r"is an embedding model: it embeds texts \(embed\(\), /v1/embeddings\)"):
        llms["mean"].classify(TEXTS[:1])
