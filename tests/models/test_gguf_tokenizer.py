"""The torch-free GGUF tokenizer (jaxllm.engine.gguf_tokenizer) against transformers' own GGUF
conversion, ``AutoTokenizer.from_pretrained(folder, gguf_file=name)``, which needs torch and is
the oracle here: the built-in SmolLM2 file, and tiny files written with gguf.GGUFWriter."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from jaxllm.engine.gguf_tokenizer import tokenizer_from_gguf
from jaxllm.engine.tokenizer import load_tokenizer
from jaxllm.errors import ModelLoadError
from jaxllm.models.builtin import builtin_gguf_path
from jaxllm.models.loader import TokenizerSource

TEXTS = [
    "Hello, world!", " Hello world", "hello world.  The  end", "", " ", "   ", "\n", "\n\n\t  \n",
    "Ünïcödé naïve café, Straße, ØÆÅ", "日本語のテキスト、世界", "emoji 🤗🚀👍🏽 and 🇫🇷", "Привет, мир",
    "def f(x):\n    return x ** 2  # square\n\tpass", "if (a != b) { c += 1; }", "1234567890 3.14159 -42 1e-9",
    "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>", "a<|im_end|>b<|im_start|>", "<repo_name>x",
    "<s>hello</s>", "<think>ok</think>", "it's we're they'll I'd", "trailing space ", "\u00a0nbsp\u200bzw",
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? Answer in 日本語."},
    {"role": "assistant", "content": "4 🤗"},
    {"role": "user", "content": "  Thanks!\n"},
]


def oracle(path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def assert_same_tokenizer(ours, ref, texts=TEXTS, conversations=(CONVERSATION, CONVERSATION[1:])):
    for text in texts:
        for special in (True, False):
            ids = ref.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), \
                    (text, special, skip)
    assert ours(texts[:4])["input_ids"] == ref(texts[:4])["input_ids"]
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id",
                 "unk_token_id", "pad_token_id", "add_bos_token", "add_eos_token", "all_special_tokens",
                 "all_special_ids", "chat_template", "padding_side", "model_max_length"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert ours.get_vocab() == ref.get_vocab()
    assert len(ours) == len(ref)
    assert ours.convert_ids_to_tokens(list(range(len(ref)))) == ref.convert_ids_to_tokens(list(range(len(ref))))
    if ref.chat_template:
        for conv in conversations:
            for gen in (True, False):
                text = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
                assert ours.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen) == text
                assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    # Everything the backend does follows from its serialization: compare that too.
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())


# ------------------------------------------------------------------ the built-in SmolLM2 (gpt2 kind)

@pytest.fixture(scope="module")
def smollm_gguf():
    return builtin_gguf_path()


@pytest.fixture(scope="module")
def smollm_oracle(smollm_gguf):
    return oracle(smollm_gguf)


def test_smollm2_matches_transformers(smollm_gguf, smollm_oracle):
    ours = tokenizer_from_gguf(smollm_gguf)
    assert_same_tokenizer(ours, smollm_oracle)
    assert ours.bos_token == "<|im_start|>" and ours.eos_token == "<|im_end|>" and not ours.add_bos_token


def test_load_tokenizer_caches_the_conversion(smollm_gguf, smollm_oracle, tmp_path):
    src = TokenizerSource(os.path.dirname(smollm_gguf), os.path.basename(smollm_gguf))
    # A tokenizer at the key the transformers-based converter used must not be picked up.
    st = os.stat(smollm_gguf)
    old_key = hashlib.sha1(f"{os.path.abspath(smollm_gguf)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stale = tmp_path / "tokenizers" / old_key
    stale.mkdir(parents=True)
    (stale / "tokenizer.json").write_text("not a tokenizer")
    fresh = load_tokenizer(src, str(tmp_path))
    written = [d for d in os.listdir(tmp_path / "tokenizers") if d != old_key]
    assert len(written) == 1 and os.path.isfile(tmp_path / "tokenizers" / written[0] / "tokenizer.json")
    cached = load_tokenizer(src, str(tmp_path))
    assert_same_tokenizer(fresh, smollm_oracle)
    # Reloaded from the cache: the same tokenizer (transformers does not save add_bos_token; the
    # post-processor in tokenizer.json carries it, and the encode comparisons check it).
    assert_same_tokenizer(cached, smollm_oracle)


NO_TORCH = """
import json, os, sys
sys.modules["torch"] = None  # as if torch were not installed: import fails, find_spec answers None
from jaxllm.engine.tokenizer import load_tokenizer
from jaxllm.models.builtin import builtin_gguf_path
from jaxllm.models.loader import TokenizerSource
p = builtin_gguf_path()
tok = load_tokenizer(TokenizerSource(os.path.dirname(p), os.path.basename(p)), os.environ["JAXLLM_CACHE_DIR"])
texts = json.loads(sys.argv[1])
print(json.dumps({"ids": [tok.encode(t) for t in texts],
                  "torch": [m for m, v in sys.modules.items() if m.split(".")[0] == "torch" and v is not None]}))
"""


def test_builtin_tokenizer_loads_without_torch(smollm_oracle, tmp_path):
    env = dict(os.environ, JAXLLM_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", NO_TORCH, json.dumps(TEXTS)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["torch"] == []
    assert out["ids"] == [smollm_oracle.encode(t) for t in TEXTS]


@pytest.mark.parametrize("package", ["gguf", "tokenizers"])
def test_a_missing_package_is_named(package, smollm_gguf, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")] or [package]:
        monkeypatch.setitem(sys.modules, name, None)
    for module in ("jaxllm.engine.gguf_tokenizer", "jaxllm.models.gguf_file"):   # re-imported: fail on `package`
        monkeypatch.delitem(sys.modules, module, raising=False)
    src = TokenizerSource(os.path.dirname(smollm_gguf), os.path.basename(smollm_gguf))
    with pytest.raises(ModelLoadError) as e:
        load_tokenizer(src, str(tmp_path))
    msg = str(e.value)
    assert f"'{package}'" in msg and f"pip install {package}" in msg and os.path.basename(smollm_gguf) in msg


# ------------------------------------------------------------------ tiny files from gguf.GGUFWriter

CHAT = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
       "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


def write_gguf(path, arch, kind, tokens=None, types=None, scores=None, merges=None, pre=None, ids=None,
               add_bos=None, add_eos=None, template=None):
    """A tokenizer-only GGUF: transformers needs neither tensors nor model keys to read one."""
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    if kind is not None:
        w.add_tokenizer_model(kind)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    if tokens is not None:
        w.add_token_list(tokens)
        w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    for name, value in (ids or {}).items():
        getattr(w, f"add_{name}_token_id")(value)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def llama_vocab():
    """A SentencePiece-style vocabulary: <unk>/<s>/</s>, the 256 byte tokens, scored pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256  # UNKNOWN, CONTROL, BYTE
    pieces = ["▁", "e", "t", "h", "l", "o", "▁t", "he", "▁the", "ll", "llo", "▁he", "▁hello", "w", "r", "d", "▁w",
              "or", "▁wor", "ld", "▁world", "a", "n", "i", "s", "▁a", "▁is", "in", "ing", "▁th", "é", "▁é", "世",
              "界", "世界", "1", "2", "3", "12", "▁1", "▁▁", "▁▁▁", "x", "y", "z", ".", ",", "!", "'", "▁it", "'s"]
    tokens += pieces + ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    types += [1] * len(pieces) + [3, 3, 4, 4]  # NORMAL, CONTROL, USER_DEFINED
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0] * 4
    return tokens, types, scores


def byte_level_vocab(specials):
    """A byte-level BPE vocabulary: the 256 byte characters, a few merges, then ``specials``."""
    from jaxllm.engine.gguf_tokenizer import _byte_alphabet
    merges = ["Ġ t", "h e", "Ġt he", "l l", "ll o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "Ġ h", "Ġh e",
              "Ġhe llo", "1 2", "Ġ Ġ", "ĠĠ Ġ", "Ċ Ċ", "ä ¸", "Ã ©"]
    tokens = list(_byte_alphabet().values()) + [m.replace(" ", "") for m in merges] + specials
    return tokens, [1] * (len(tokens) - len(specials)) + [3] * len(specials), merges


@pytest.mark.parametrize("flags", [dict(), dict(add_bos=False, add_eos=True), dict(add_bos=True)])
def test_llama_kind_matches_transformers(tmp_path, flags):
    tokens, types, scores = llama_vocab()
    ids = dict(bos=1, eos=2, unk=0) if flags else dict(bos=1, eos=2, unk=0, pad=2)
    path = write_gguf(tmp_path / "spm.gguf", "llama", "llama", tokens, types, scores=scores, ids=ids,
                      template=CHAT, **flags)
    ref = oracle(path)
    ours = tokenizer_from_gguf(path)
    assert_same_tokenizer(ours, ref)
    # Byte fallback and the BOS flag (absent means on) are really exercised.
    assert ours.add_bos_token == flags.get("add_bos", True)
    assert ours.encode("ü", add_special_tokens=False) == [tokens.index(t) for t in ("▁", "<0xC3>", "<0xBC>")]
    # The cache round trip keeps what save_pretrained does not write down (add_bos/add_eos).
    src = TokenizerSource(str(tmp_path), "spm.gguf")
    load_tokenizer(src, str(tmp_path / "cache"))
    cached = load_tokenizer(src, str(tmp_path / "cache"))
    assert [cached.encode(t) for t in TEXTS] == [ref.encode(t) for t in TEXTS]


def test_qwen2_byte_level_matches_transformers(tmp_path):
    # <think> user-defined; 控制 marked control but not in the byte alphabet (a converter's
    # mislabel, which transformers leaves out of the special tokens).
    tokens, types, merges = byte_level_vocab(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "控制"])
    types[-2] = 4
    n = len(tokens)
    path = write_gguf(tmp_path / "qwen.gguf", "qwen2", "gpt2", tokens, types, merges=merges, pre="qwen2",
                      ids=dict(bos=n - 5, eos=n - 3, pad=n - 5), add_bos=False, template=CHAT)
    ours, ref = tokenizer_from_gguf(path), oracle(path)
    assert_same_tokenizer(ours, ref)
    assert ours.encode("12345", add_special_tokens=False) == [tokens.index(c) for c in "12345"]  # one digit each


def test_llama3_byte_level_matches_transformers_but_adds_no_token(tmp_path):
    """transformers' converter starts from GPT-2's defaults, so for a vocabulary without
    <|endoftext|> (Llama 3's) it appends one, past the model's vocabulary.  We do not."""
    tokens, types, merges = byte_level_vocab(["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"])
    n = len(tokens)
    path = write_gguf(tmp_path / "llama3.gguf", "llama", "gpt2", tokens, types, merges=merges, pre="llama-bpe",
                      ids=dict(bos=n - 3, eos=n - 1), add_bos=True)
    ours, ref = tokenizer_from_gguf(path), oracle(path)
    assert ref.get_vocab() == {**ours.get_vocab(), "<|endoftext|>": n} and len(ours) == n
    texts = [t for t in TEXTS if "<|endoftext|>" not in t] + ["<|begin_of_text|>hi<|eot_id|>"]
    for text in texts:
        for special in (True, False):
            ids = ref.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, text
            assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
            assert ours.decode(ids) == ref.decode(ids)
    assert ours.encode("12345", add_special_tokens=False) == ref.encode("12345", add_special_tokens=False)
    assert (ours.bos_token, ours.eos_token, ours.add_bos_token) == (ref.bos_token, ref.eos_token, True)
    assert ours.encode("hi")[0] == n - 3


@pytest.mark.parametrize("case,expect", [
    (dict(arch="llama", kind="t5"), "'t5'"),
    (dict(arch="llama", kind=None), "None"),
    (dict(arch="gemma", kind="llama"), "'gemma'"),
    (dict(arch="llama", kind="gpt2", merges=None), "merges"),
    (dict(arch="llama", kind="llama", tokens=None), "tokens"),
])
def test_unsupported_files_say_to_pass_a_tokenizer(tmp_path, case, expect):
    tokens, types, scores = llama_vocab()
    args = dict(tokens=tokens, types=types, scores=scores) | case
    if args["tokens"] is None:
        args["scores"] = None
    path = write_gguf(tmp_path / "odd.gguf", args.pop("arch"), args.pop("kind"), **args)
    with pytest.raises(ModelLoadError) as e:
        tokenizer_from_gguf(path)
    msg = str(e.value)
    assert "odd.gguf" in msg and expect in msg and "--tokenizer" in msg
    with pytest.raises(ModelLoadError, match="--tokenizer"):
        load_tokenizer(TokenizerSource(str(tmp_path), "odd.gguf"), str(tmp_path / "cache"))
