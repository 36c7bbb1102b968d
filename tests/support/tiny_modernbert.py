"""Tiny random ModernBERT checkpoints and their oracles: a ``ModernBertModel`` saved as a
sentence-transformers folder (MEAN pooling + Normalize; oracle ``SentenceTransformer.encode``)
and a ``ModernBertForSequenceClassification`` with one label (oracles ``CrossEncoder.predict``
and transformers' logits).  Three layers (global, local, global) with a local window of 8
(4 tokens on either side) and a local RoPE base far from the global one, so prompts of 10-20
tokens exercise both.  The oracles run transformers' eager attention (float32)."""

from __future__ import annotations

import os

import torch
from sentence_transformers import CrossEncoder, SentenceTransformer
from sentence_transformers.sentence_transformer import modules as st_models
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, BertTokenizerFast,
                          ModernBertForSequenceClassification, ModernBertModel)
from transformers import ModernBertConfig as HFModernBertConfig

from support.tiny_encoders import VOCAB

EAGER = {"attn_implementation": "eager"}
HALF_WINDOW = 4
LAYER_TYPES = ["full_attention", "sliding_attention", "full_attention"]


def modernbert_config(**changes) -> HFModernBertConfig:
    """The tiny checkpoints' transformers config, with ``changes`` to its fields."""
    fields = dict(
        vocab_size=len(VOCAB), hidden_size=32, intermediate_size=48, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, max_position_embeddings=128, local_attention=2 * HALF_WINDOW,
        layer_types=list(LAYER_TYPES), pad_token_id=0, cls_token_id=2, bos_token_id=2, sep_token_id=3,
        eos_token_id=3, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 160_000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}})
    return HFModernBertConfig(**{**fields, **changes})


def _tokenizer() -> BertTokenizerFast:
    # ModernBERT takes no token types: the tokenizer gives none (as ModernBERT's own does).
    return BertTokenizerFast(vocab={w: i for i, w in enumerate(VOCAB)}, do_lower_case=True,
                             model_input_names=["input_ids", "attention_mask"])


def _randomize(model: torch.nn.Module) -> None:
    """Wider than the default init, with random norm weights and biases, so activations reach
    GELU's curved part and every weight matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif p.dim() == 2:
                p.normal_(0, 0.2)


def build_modernbert_st(out_dir: str, seed: int = 4) -> str:
    """A sentence-transformers folder (MEAN pooling + Normalize) around a tiny random ``ModernBertModel``."""
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(seed)
    model = ModernBertModel(modernbert_config()).eval()
    _randomize(model)
    hf_dir = out_dir.rstrip("/") + "_hf"
    model.save_pretrained(hf_dir)
    _tokenizer().save_pretrained(hf_dir)
    transformer = st_models.Transformer(hf_dir, max_seq_length=128, model_kwargs=EAGER)
    pool = st_models.Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
    SentenceTransformer(modules=[transformer, pool, st_models.Normalize()], device="cpu").save(out_dir)
    return out_dir


def st_encode_eager(path: str, texts: list[str]):
    """``SentenceTransformer.encode`` with transformers' eager attention, float32, [N, D] numpy."""
    model = SentenceTransformer(path, device="cpu", model_kwargs=EAGER)
    return model.encode(texts, convert_to_numpy=True, batch_size=len(texts))


def build_modernbert_classifier(out_dir: str, seed: int = 5) -> str:
    """A tiny random ``ModernBertForSequenceClassification`` with one label (a reranker) as an HF
    folder: mean classifier pooling, and every optional bias on (norms, attention, MLP, head)."""
    torch.manual_seed(seed)
    cfg = modernbert_config(num_labels=1, classifier_pooling="mean", classifier_bias=True, norm_bias=True,
                  attention_bias=True, mlp_bias=True)
    model = ModernBertForSequenceClassification(cfg).eval()
    _randomize(model)
    model.save_pretrained(out_dir)
    _tokenizer().save_pretrained(out_dir)
    return out_dir


def cross_encoder_scores_eager(path: str, pairs: list[tuple[str, str]]):
    """``CrossEncoder.predict`` (the sigmoid of the one logit) with eager attention, float32 numpy."""
    return CrossEncoder(path, device="cpu", model_kwargs=EAGER).predict(pairs, batch_size=len(pairs),
                                                                          convert_to_numpy=True)


def classifier_logits(path: str, pairs: list[tuple[str, str]]):
    """transformers' logits [N, num_labels] for text pairs (padded batch, eager attention), numpy."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, **EAGER).eval()
    enc = tok([a for a, _ in pairs], [b for _, b in pairs], padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).logits.float().numpy()
