"""Tiny random Qwen3 decoders as pooling models, with their oracles: a sentence-transformers
folder (Transformer + Pooling(lasttoken) + Normalize, instruction prompts declared) vs
``SentenceTransformer.encode``; a ``Qwen3ForSequenceClassification`` vs transformers' logits;
a Qwen3-Reranker-style causal LM vs the softmax of its "no"/"yes" logits at the last token."""

from __future__ import annotations

import os

import numpy as np
import torch
import transformers
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules as st_models

from support.tiny_models import BASE, VARIANTS, build_tiny

QWEN3 = "qwen3_qk_norm"
QUERY_PROMPT = "Instruct: find the document\nQuery: "
# Qwen3-Reranker's documented format (vLLM's examples/offline_inference/qwen3_reranker.py).
RERANK_PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the '
                 'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANKER_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                      "is_original_qwen3_reranker": True}


def rerank_query(query: str, instruction: str = "Given a web search query, retrieve relevant passages") -> str:
    return f"{RERANK_PREFIX}<Instruct>: {instruction}\n<Query>: {query}\n"


def rerank_document(doc: str) -> str:
    return f"<Document>: {doc}{RERANK_SUFFIX}"


def build_qwen3_st(out_dir: str, tokenizer_dir: str, seed: int = 0) -> str:
    """A sentence-transformers folder over a tiny random ``Qwen3ForCausalLM``: last-token pooling,
    Normalize, and a ``query`` instruction prompt in ``config_sentence_transformers.json``."""
    hf_dir = build_tiny(QWEN3, out_dir.rstrip("/") + "_hf", tokenizer_dir, seed=seed)
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    if tok.pad_token is None:   # sentence-transformers pads a batch
        tok.pad_token = tok.eos_token
    # Without a chat template: sentence-transformers 6 would wrap a text in it (an embedder's
    # folder, Qwen3-Embedding's, encodes the text as it is, as vLLM does).
    tok.chat_template = None
    if os.path.exists(os.path.join(hf_dir, "chat_template.jinja")):
        os.remove(os.path.join(hf_dir, "chat_template.jinja"))
    tok.save_pretrained(hf_dir)
    transformer = st_models.Transformer(hf_dir, max_seq_length=64)
    pool = st_models.Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken")
    SentenceTransformer(modules=[transformer, pool, st_models.Normalize()], device="cpu",
                        prompts={"query": QUERY_PROMPT}).save(out_dir)
    return out_dir


def st_encode(path: str, texts: list[str]) -> np.ndarray:
    """The oracle: ``SentenceTransformer.encode`` (float32, no prompt_name: the texts as given)."""
    return SentenceTransformer(path, device="cpu").encode(texts, convert_to_numpy=True, batch_size=len(texts))


def build_qwen3_classifier(out_dir: str, tokenizer_dir: str, seed: int = 4) -> str:
    """A tiny random ``Qwen3ForSequenceClassification`` with one label (its ``score`` head)."""
    _, overrides = VARIANTS[QWEN3]
    cfg = transformers.Qwen3Config(**{**BASE, **overrides, "num_labels": 1, "pad_token_id": None})
    cfg.architectures = ["Qwen3ForSequenceClassification"]
    torch.manual_seed(seed)
    model = transformers.Qwen3ForSequenceClassification(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (1.5 / np.sqrt(p.shape[-1])))
    model.save_pretrained(out_dir, safe_serialization=True)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
    return out_dir


def classifier_scores(path: str, pairs: list[tuple[str, str]]) -> np.ndarray:
    """The oracle: sigmoid of ``AutoModelForSequenceClassification``'s logit for each pair as the
    tokenizer encodes it (one pair at a time: no padding)."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for a, b in pairs:
            ids = torch.tensor([tok(a, b)["input_ids"]])
            out.append(torch.sigmoid(model(input_ids=ids).logits[0, 0]).item())
    return np.array(out)


def yes_no_scores(path: str, pairs: list[tuple[str, str]]) -> np.ndarray:
    """The oracle of Qwen3-Reranker: softmax over the "no" and "yes" logits at the last token of
    query + document (one text), p(yes), from transformers' causal LM."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for a, b in pairs:
            logits = model(input_ids=torch.tensor([tok(a + b)["input_ids"]])).logits[0, -1]
            out.append(torch.softmax(logits[[no, yes]].double(), 0)[1].item())
    return np.array(out)


def mean_hidden(path: str, prompts: list[list[int]]) -> np.ndarray:
    """The MEAN-pooling oracle: transformers' base model (``AutoModel``, float32) on each token-id
    list alone, its final-norm hidden states averaged over the tokens -> [N, D]."""
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return np.stack([model(torch.tensor([ids])).last_hidden_state[0].mean(0).numpy() for ids in prompts])
