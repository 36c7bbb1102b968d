"""A tiny random ``XLMRobertaForSequenceClassification`` with one label (bge-reranker's
architecture: ``RobertaClassificationHead`` over ``<s>``, positions offset past the padding id 1,
one token type) and an XLM-R tokenizer (a small Unigram vocabulary) that encodes a pair as
``<s> A </s></s> B </s>`` with no token types; its oracle is ``CrossEncoder.predict``
(``support.tiny_encoders.cross_encoder_scores``)."""

from __future__ import annotations

import torch
from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification, XLMRobertaTokenizer

from support.tiny_encoders import WORDS

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")   # ids 0-4, as XLM-R has them
# Whole words are likelier than their letters, so a word is one token; "▁" and single characters
# spell anything else.
PIECES = ([(s, 0.0) for s in SPECIALS] + [("▁" + w, -2.0) for w in dict.fromkeys(WORDS)] + [("▁", -4.0)]
          + [(c, -6.0) for c in "abcdefghijklmnopqrstuvwxyz.,!?"])


def xlmr_tokenizer() -> XLMRobertaTokenizer:
    return XLMRobertaTokenizer(vocab=list(PIECES))


def build_xlmr_cross_encoder(out_dir: str, seed: int = 6) -> str:
    """Writes the checkpoint and its tokenizer as an HF folder."""
    torch.manual_seed(seed)
    cfg = XLMRobertaConfig(vocab_size=len(PIECES), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1,
                           bos_token_id=0, eos_token_id=2, num_labels=1)
    model = XLMRobertaForSequenceClassification(cfg).eval()
    with torch.no_grad():   # wider than the default init, so scores differ by document (and order them)
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif p.dim() == 2:
                p.normal_(0, 0.3)
    model.save_pretrained(out_dir)
    xlmr_tokenizer().save_pretrained(out_dir)
    return out_dir
