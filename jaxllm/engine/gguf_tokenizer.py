"""Building a fast tokenizer from a GGUF file's vocabulary, without torch.

A GGUF carries no ``tokenizer.json``: its tokenizer is metadata under llama.cpp's key names
(``tokenizer.ggml.*``).  transformers can turn that into a tokenizer, but its GGUF reader
imports torch, which the runtime install does not have.  This module reads the same metadata
with jaxllm's GGUF reader (models/gguf_file.py) and builds the same tokenizer with the ``tokenizers`` library, then
wraps it as a ``transformers.PreTrainedTokenizerFast`` (which does not need torch).

"The same" means: what ``AutoTokenizer.from_pretrained(folder, gguf_file=name)`` of
transformers 5 builds -- same ids, same decoding, same special tokens, same BOS/EOS flags and
chat template -- and the tests check it against that.  Two vocabulary kinds are supported
(``tokenizer.ggml.model``):

* ``gpt2``: byte-level BPE (SmolLM2, Llama 3, Qwen2/3), split by the regex that
  ``tokenizer.ggml.pre`` names;
* ``llama``: SentencePiece-style BPE with byte fallback (Llama 2, Mistral, TinyLlama), merges
  rebuilt from the token scores when the file has none.

Anything else raises a ``ModelLoadError`` that says to pass an HF tokenizer folder instead.
"""

from __future__ import annotations

import os

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jaxllm.errors import ModelLoadError
from jaxllm.models.gguf_file import read_gguf

# Part of the cache key of a converted tokenizer: bump it whenever the output changes.
CONVERTER_VERSION = "jaxllm-gguf-tokenizer-1"

# llama.cpp's token types (gguf.TokenType); only these two change how a token is matched.
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer split patterns, keyed by the ``tokenizer.ggml.pre`` names llama.cpp writes.  A
# name that is not here gets GPT-2's own pattern (the ByteLevel default), as in transformers.
_SPLIT_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_SPLIT_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_SPLIT_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
                rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), _SPLIT_LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _SPLIT_QWEN2),
    "qwen35": _SPLIT_QWEN35,
    "tekken": _SPLIT_TEKKEN,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _SPLIT_GPT4O),
}

# Architectures whose "llama" vocabularies transformers builds differently (respelled tokens,
# another prefix-space rule); not reproduced here.
_OTHER_SENTENCEPIECE = ("gemma", "gemma2", "gemma3", "phi3")


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character map: printable Latin-1 bytes stand for themselves, the other
    bytes (controls, space, a few more) take the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in spelling):
        spelling[b] = chr(256 + n)
    return spelling


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece vocabularies list no merges: recover them the way transformers does.

    Every split of a token into two vocabulary tokens is a merge ranked by the token's score
    (best first, then longer left and right pieces first); merges of equal rank keep the
    order of the tokens, and within a token the order of the pieces' ids."""
    ids = {t: i for i, t in enumerate(tokens)}
    score = dict(zip(tokens, scores))
    found = []
    for piece, s in score.items():
        pairs = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in ids and piece[k:] in ids]
        pairs.sort(key=lambda p: (ids[p[0]], ids[p[1]]))
        found += [(left, right, s) for left, right in pairs]
    # sorted() is stable, so negating the key keeps equal merges in the order found
    found.sort(key=lambda m: (-m[2], -len(m[0]), -len(m[1])))
    return [(left, right) for left, right, _ in found]


def _unsupported(path: str, what: str) -> ModelLoadError:
    return ModelLoadError(f"{path}: cannot build a tokenizer from the GGUF metadata ({what}); pass --tokenizer "
                          f"with a Hugging Face tokenizer folder (tokenizer.json) for this model")


def tokenizer_from_gguf(path: str) -> PreTrainedTokenizerFast:
    """The fast tokenizer that the GGUF file at ``path`` describes."""
    fields = read_gguf(path).fields   # raises ModelLoadError naming the file

    def field(key, default=None):
        return fields.get(key, default)

    kind = field("tokenizer.ggml.model")
    tokens = field("tokenizer.ggml.tokens")
    arch = field("general.architecture")
    if kind not in ("gpt2", "llama"):
        raise _unsupported(path, f"tokenizer kind {kind!r}; supported: 'gpt2', 'llama'")
    if kind == "llama" and arch in _OTHER_SENTENCEPIECE:
        raise _unsupported(path, f"tokenizer kind 'llama' of architecture {arch!r}")
    if not tokens:
        raise _unsupported(path, f"tokenizer kind {kind!r} without tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type") or []
    merges = field("tokenizer.ggml.merges")
    if merges is not None:
        merges = [tuple(m.split(" ")) for m in merges]

    if kind == "gpt2":
        if merges is None:
            raise _unsupported(path, "tokenizer kind 'gpt2' without tokenizer.ggml.merges")
        spelling = _byte_alphabet()
        alphabet = set(spelling.values())
        # The file spells most tokens in the byte alphabet already; the others (often the added
        # tokens) are written as text and must be respelled byte by byte to be found.
        vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
                 for i, t in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        # A control token outside the byte alphabet is a converter's mislabel; making it a
        # special token would grow the vocabulary past the model's, so it stays out.
        can_be_special = lambda t: set(t) <= alphabet  # noqa: E731
    else:
        vocab = {t: i for i, t in enumerate(tokens)}
        if merges is None:
            scores = field("tokenizer.ggml.scores")
            if not scores:
                raise _unsupported(path, "tokenizer kind 'llama' with neither merges nor scores")
            merges = _merges_from_scores(tokens, scores)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
        # SentencePiece: spaces become "▁", with one in front of the text; decoding undoes both.
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])
        can_be_special = lambda t: True  # noqa: E731

    # Control tokens (<|im_start|>, <s>) and user-defined ones (<think>) are matched whole in
    # the text, as llama.cpp does; only control tokens are special (dropped when decoding with
    # skip_special_tokens).
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types) if ty == _CONTROL and can_be_special(t)])
    known = tok.get_vocab()
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in known])

    split = _SPLITS.get(field("tokenizer.ggml.pre"))
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=False)])

    def special(key):
        i = field(f"tokenizer.ggml.{key}")
        if i is None:
            return None
        if not 0 <= int(i) < len(tokens):
            raise ModelLoadError(f"{path}: tokenizer.ggml.{key} is {i}, outside the {len(tokens)}-token vocabulary")
        return tokens[int(i)]

    extra = {}
    # Older SentencePiece files carry no flag, and llama.cpp adds BOS to those.
    add_bos = field("tokenizer.ggml.add_bos_token", True if kind == "llama" else None)
    if add_bos is not None:
        extra["add_bos_token"] = bool(add_bos)
    if (add_eos := field("tokenizer.ggml.add_eos_token")) is not None:
        extra["add_eos_token"] = bool(add_eos)
    # The wrapper builds the BOS/EOS post-processor from these flags.  is_local, as from_pretrained
    # passes for a folder: the folder's name is never looked up on the Hub.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, name_or_path=os.path.dirname(os.path.abspath(path)), is_local=True,
        bos_token=special("bos_token_id"), eos_token=special("eos_token_id"),
        unk_token=special("unknown_token_id"), pad_token=special("padding_token_id"),
        chat_template=field("tokenizer.chat_template"), **extra)
