"""``jaxllm bench perplexity`` (bench/perplexity.py): llama-perplexity's windows and arithmetic,
checked against a direct computation from transformers' float32 logits on the tiny Llama, and
its argument errors (all raised before the model loads, except the two that need its tokenizer
or its context length)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from bench.perplexity import Estimate, scored_slice, tokenize, windows
from support.engines import SMALL_ENGINE

ENGINE_FLAGS = ["--max-num-seqs", str(SMALL_ENGINE["max_num_seqs"]),
                "--max-num-batched-tokens", str(SMALL_ENGINE["max_num_batched_tokens"]),
                "--max-model-len", str(SMALL_ENGINE["max_model_len"]), "--dtype", "float32"]

TEXT = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; "
        "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. "
        "And God said, Let there be light: and there was light. And God saw the light, that it was good: "
        "and God divided the light from the darkness.\n")


def run_cli(argv, capsys):
    from jaxllm.cli import main
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------------------- the arithmetic alone


def test_windows_drop_the_tail_and_put_the_bos_first():
    toks = list(range(10, 31))                      # 21 tokens
    assert windows(toks, 8, None) == [list(range(10, 18)), list(range(18, 26))]
    assert windows(toks, 8, 1) == [[1] + list(range(11, 18)), [1] + list(range(19, 26))]
    assert windows(toks, 8, None, n_chunks=1) == [list(range(10, 18))]
    # llama.cpp's first = n_ctx/2: logits from position 4 on, so tokens 5..7 are scored.
    assert scored_slice(8) == slice(5, 8)
    assert scored_slice(9) == slice(5, 9)


def test_estimate_is_llama_cpp_formula():
    est = Estimate()
    est.add([1.0, 2.0])
    est.add([3.0])
    v = np.array([1.0, 2.0, 3.0])
    assert est.running == pytest.approx([math.exp(1.5), math.exp(2.0)])
    assert est.ppl == pytest.approx(math.exp(2.0))
    # sqrt((E[v^2] - E[v]^2) / (n - 1)) * ppl
    assert est.stderr == pytest.approx(math.sqrt((np.mean(v * v) - v.mean() ** 2) / 2) * math.exp(2.0))


class _Tok:
    """A tokenizer that adds a BOS (id 1) with special tokens, one id per character."""

    bos_token_id = 1

    def encode(self, text, add_special_tokens=True):
        ids = [100 + ord(c) % 50 for c in text]
        return ([1] + ids) if add_special_tokens else ids


def test_tokenize_follows_the_tokenizers_bos_rule(smollm_tokenizer_dir):
    assert tokenize(_Tok(), "abc") == ([1, 100 + ord("a") % 50, 100 + ord("b") % 50, 100 + ord("c") % 50], 1)
    from transformers import AutoTokenizer
    smol = AutoTokenizer.from_pretrained(smollm_tokenizer_dir)   # the built-in GGUF's: adds no BOS
    ids, bos = tokenize(smol, TEXT)
    assert bos is None and ids == smol.encode(TEXT, add_special_tokens=False)


# ---------------------------------------------------------------------------- against transformers


def direct_perplexity(model_dir: str, text: str, n_ctx: int) -> tuple[float, float, list[float]]:
    """llama-perplexity's number computed here from transformers' float32 logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok.encode(text, add_special_tokens=False)
    nlls, running = [], []
    first = n_ctx // 2
    for i in range(len(ids) // n_ctx):
        w = torch.tensor([ids[i * n_ctx:(i + 1) * n_ctx]])
        with torch.no_grad():
            lp = torch.log_softmax(model(w).logits[0].double(), dim=-1)          # [n_ctx, V]
        # logits at positions first .. n_ctx-2 predict tokens first+1 .. n_ctx-1
        nlls += [-float(lp[p, w[0, p + 1]]) for p in range(first, n_ctx - 1)]
        running.append(math.exp(np.mean(nlls)))
    v = np.array(nlls)
    ppl = math.exp(v.mean())
    return ppl, math.sqrt((np.mean(v * v) - v.mean() ** 2) / (len(v) - 1)) * ppl, running


def test_perplexity_matches_transformers(tiny_llama, tmp_path, capsys):
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT * 4)
    out_json = tmp_path / "ppl.json"
    n_ctx = 48   # more than --max-num-batched-tokens: each window is prefilled in two chunks
    rc, out, err = run_cli(["bench", "perplexity", str(text_file), "--ctx-size", str(n_ctx), "--model", tiny_llama,
                            *ENGINE_FLAGS, "--output-json", str(out_json)], capsys)
    assert rc == 0, err
    ppl, stderr, running = direct_perplexity(tiny_llama, TEXT * 4, n_ctx)
    assert len(running) >= 4
    got = json.loads(out_json.read_text())
    assert got["num_windows"] == len(running) and got["scored_tokens"] == len(running) * (n_ctx - n_ctx // 2 - 1)
    assert got["ppl"] == pytest.approx(ppl, rel=1e-4)
    assert got["ppl_stderr"] == pytest.approx(stderr, rel=1e-3)
    assert got["running"] == pytest.approx(running, rel=1e-4)
    m = re.search(r"^Final estimate: PPL = (\d+\.\d{4}) \+/- (\d+\.\d{5})$", out, re.M)
    assert m, out
    assert float(m.group(1)) == pytest.approx(ppl, rel=1e-4)
    assert re.search(r"^\[1\]\d+\.\d{4},\[2\]\d+\.\d{4},", out, re.M), out
    assert re.search(r"evaluated in \d+\.\d s \(\d+\.\d tokens/s", out), out

    # --chunks 2: the first two windows' estimate.
    rc, out, err = run_cli(["bench", "perplexity", str(text_file), "--ctx-size", str(n_ctx), "--chunks", "2",
                            "--model", tiny_llama, *ENGINE_FLAGS], capsys)
    assert rc == 0, err
    m = re.search(r"^Final estimate: PPL = (\d+\.\d{4})", out, re.M)
    assert float(m.group(1)) == pytest.approx(running[1], rel=1e-4)


# ---------------------------------------------------------------------------- argument errors


@pytest.mark.parametrize("extra, needle", [
    (["--ctx-size", "3"], "--ctx-size must be at least 4"),
    (["--chunks", "0"], "--chunks must be a positive integer, or -1"),
    (["--ctx-size", "256"], "--ctx-size 256 needs --max-model-len of at least 257"),
    (["--ctx-size", "16", "--output-json", "/nonexistent-folder/x.json"], "the folder /nonexistent-folder does not exist"),
])
def test_argument_errors_before_the_model_loads(extra, needle, tmp_path, capsys):
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT)
    # A model path that does not exist: each error must come before any attempt to load it.
    rc, out, err = run_cli(["bench", "perplexity", str(text_file), "--model", str(tmp_path / "no-model"),
                            *ENGINE_FLAGS, *extra], capsys)
    assert rc == 2, (out, err)
    assert "error:" in err and needle in err, err


def test_file_errors(tmp_path, capsys):
    missing = tmp_path / "missing.txt"
    rc, _, err = run_cli(["bench", "perplexity", str(missing), "--model", str(tmp_path / "no-model")], capsys)
    assert rc == 2 and f"{missing}: no such file" in err, err
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    rc, _, err = run_cli(["bench", "perplexity", str(empty), "--model", str(tmp_path / "no-model")], capsys)
    assert rc == 2 and "is empty" in err, err
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00abc")
    rc, _, err = run_cli(["bench", "perplexity", str(binary), "--model", str(tmp_path / "no-model")], capsys)
    assert rc == 2 and "is not UTF-8 text" in err, err
    rc, _, err = run_cli(["bench", "perplexity"], capsys)
    assert rc == 2 and "FILE" in err, err


def test_too_short_a_text_says_how_many_tokens_it_needs(tiny_llama, tmp_path, capsys):
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT)
    rc, _, err = run_cli(["bench", "perplexity", str(text_file), "--ctx-size", "128", "--model", tiny_llama,
                          *ENGINE_FLAGS], capsys)
    assert rc == 2, err
    assert re.search(r"needs at least 256 tokens for --ctx-size 128 \(as llama-perplexity\); \S+ tokenizes to "
                     r"only \d+", err), err
