"""Tiny random BERT encoders saved as sentence-transformers folders (a Transformer module, a
Pooling module, optionally Normalize), and a tiny BERT cross-encoder, with a small WordPiece
vocabulary: the pooling tests' checkpoints and their oracles (``SentenceTransformer.encode``,
``CrossEncoder.predict``, ``AutoModelForSequenceClassification``, float32); and the files a test
writes into a folder (a Matryoshka declaration, a chat template)."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer
from sentence_transformers.sentence_transformer import modules as st_models
from transformers import (AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification, BertModel,
                          BertTokenizerFast, XLMRobertaConfig, XLMRobertaModel)

WORDS = ("the a an of to in is it and that for on with as was at by be this are from or his her not "
         "cat dog sat mat ran fast slow red blue green big small house tree river sky sun moon star "
         "jax engine token vector query document search rank embed model").split()
VOCAB = list(dict.fromkeys(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"abcdefghijklmnopqrstuvwxyz.,!?",
                            *("##" + c for c in "abcdefghijklmnopqrstuvwxyz")]))


def build_bert_st(out_dir: str, pooling: str = "mean", normalize: bool = False, seed: int = 0,
                  max_seq_length: int = 64, model: str = "bert") -> str:
    """Writes a sentence-transformers folder around a tiny random ``BertModel`` (``model="bert"``)
    or ``XLMRobertaModel`` (``"xlm-roberta"``: padding id 1 as in the real ones, so positions
    start at 2); ``pooling``: a sentence-transformers pooling mode (``mean``, ``cls``, ``lasttoken``)."""
    os.makedirs(out_dir, exist_ok=True)
    vocab = list(VOCAB)
    if model == "xlm-roberta":   # [PAD] at id 1, the id the model's positions are offset by
        vocab[0], vocab[1] = vocab[1], vocab[0]
    tok = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    assert len(tok) == len(vocab), "the tokenizer did not take the vocabulary"
    torch.manual_seed(seed)
    sizes = dict(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64)
    if model == "xlm-roberta":
        cfg = XLMRobertaConfig(**sizes, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1)
        bert = XLMRobertaModel(cfg).eval()
    else:
        bert = BertModel(BertConfig(**sizes, max_position_embeddings=128, type_vocab_size=2)).eval()
    with torch.no_grad():   # random LayerNorm and bias values, and matrices wider than the default
        for name, p in bert.named_parameters():   # init, so activations reach GELU's curved part
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif p.dim() == 2:
                p.normal_(0, 0.2)
    hf_dir = out_dir.rstrip("/") + "_hf"   # the bare transformers folder the Transformer module reads
    bert.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    transformer = st_models.Transformer(hf_dir, max_seq_length=max_seq_length)
    pool = st_models.Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling)
    modules = [transformer, pool] + ([st_models.Normalize()] if normalize else [])
    SentenceTransformer(modules=modules, device="cpu").save(out_dir)
    return out_dir


def st_encode(path: str, texts: list[str], truncate_dim: int | None = None, normalize: bool = False):
    """The oracle: ``SentenceTransformer.encode`` in float32, [N, D] numpy; ``truncate_dim``: its
    Matryoshka cut, ``normalize``: ``normalize_embeddings`` (applied after the cut)."""
    model = SentenceTransformer(path, device="cpu", truncate_dim=truncate_dim)
    return model.encode(texts, convert_to_numpy=True, batch_size=len(texts), normalize_embeddings=normalize)


def declare_matryoshka(folder: str, dimensions: list[int] | None = None) -> str:
    """Marks the checkpoint as vLLM reads it: ``is_matryoshka`` in config.json, and with
    ``dimensions`` the ``matryoshka_dimensions`` it allows."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["is_matryoshka"] = True
    if dimensions is not None:
        cfg["matryoshka_dimensions"] = list(dimensions)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    return folder


def write_chat_template(folder: str, template: str) -> str:
    """Gives the folder's tokenizer a chat template (``tokenizer_config.json``)."""
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = template
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    return folder


def build_bert_cross_encoder(out_dir: str, seed: int = 3, id2label: dict[int, str] | None = None) -> str:
    """A tiny random ``BertForSequenceClassification`` as an HF folder: one label (a reranker), or
    with ``id2label`` one label per entry (a classifier)."""
    torch.manual_seed(seed)
    labels = dict(id2label=id2label, label2id={v: k for k, v in id2label.items()}) if id2label else dict(num_labels=1)
    cfg = BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=128, type_vocab_size=2, **labels)
    model = BertForSequenceClassification(cfg).eval()
    with torch.no_grad():   # wider than the default init, so scores differ by document (and order them)
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    model.save_pretrained(out_dir)
    BertTokenizerFast(vocab={w: i for i, w in enumerate(VOCAB)}, do_lower_case=True).save_pretrained(out_dir)
    return out_dir


def cross_encoder_scores(path: str, pairs: list[tuple[str, str]]):
    """The oracle: ``CrossEncoder.predict`` (one label: the sigmoid of the logit), float32 numpy."""
    return CrossEncoder(path, device="cpu").predict(pairs, batch_size=len(pairs), convert_to_numpy=True)


def classifier_probs(path: str, texts: list[str]):
    """The oracle: transformers' ``AutoModelForSequenceClassification`` in float32, one text at a
    time -> [N, labels] numpy: the softmax of the logits (one label: the sigmoid)."""
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tok = BertTokenizerFast.from_pretrained(path)
    out = []
    with torch.no_grad():
        for t in texts:
            logits = model(**tok(t, return_tensors="pt")).logits[0].double()
            out.append((torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, -1)).numpy())
    return np.array(out, np.float32)
