"""Tiny random-weight Qwen3-Next / Qwen3.5 / Qwen3.5-MoE checkpoints, saved by transformers
(models/test_qwen3_next*.py, parallel/test_gdn_tp.py): 5 layers (GDN, full, GDN, GDN, full),
key and value head dims that differ, grouped value heads (2 key heads of 16, 4 value heads
of 8), partial rotary.  Qwen3-Next: MoE with a dense layer (mlp_only_layers), routing
weights not renormalised; Qwen3.5: dense, untied; Qwen3.5-MoE: MoE everywhere, tied."""

from __future__ import annotations

import torch
import transformers

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=256, rms_norm_eps=1e-6,
              layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                           "full_attention"],
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)


VARIANTS = {
    "Qwen3NextForCausalLM": ("Qwen3NextConfig", dict(COMMON, **MOE, intermediate_size=48, mlp_only_layers=[2],
                                                     norm_topk_prob=False, tie_word_embeddings=False)),
    "Qwen3_5ForCausalLM": ("Qwen3_5TextConfig", dict(COMMON, intermediate_size=48, tie_word_embeddings=False)),
    "Qwen3_5MoeForCausalLM": ("Qwen3_5MoeTextConfig", dict(COMMON, **MOE, tie_word_embeddings=True)),
}


OUT = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")


def build(arch: str, out_dir: str, seed: int = 0, **overrides) -> str:
    """Saves a tiny random-weight ``arch`` checkpoint to ``out_dir``.  Weights are drawn wider
    than transformers' init (norm weights too) so every parameter shows in the logits and
    greedy decoding has clear winners, yet tame enough that transformers' own float32 logits
    stay within ~1e-6 of its float64 ones (a 1e-4 bar then means something)."""
    cls, kw = VARIANTS[arch]
    cfg = getattr(transformers, cls)(**{**kw, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).eval()
    widen(model, cfg.tie_word_embeddings)
    model.save_pretrained(out_dir)
    return out_dir


def widen(model, tied: bool, prefix: str = "") -> None:
    """Redraws the parameters whose names start with ``prefix`` the way :func:`build` wants them
    (the docstring there says why); tiny_qwen3_5_vl.py applies it to its text model."""
    # A tied head scores each token by its own embedding: kept small and the blocks' outputs
    # larger, the residual stream is not the input token's embedding (greedy would repeat it).
    embed_std, out_std = (0.1, 1.2) if tied else (1.0, 0.5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(prefix):
                continue
            if name.endswith("A_log"):
                # Slow decays (transformers draws A from U(0.01, 16)): a state that forgets
                # within a few tokens would hide a wrongly carried one from the greedy tokens.
                p.copy_(torch.empty_like(p).uniform_(0.01, 0.3).log())
                continue
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.ndim == 1:
                p.copy_(0.2 * torch.randn_like(p))
            else:
                std = embed_std if "embed" in name else (out_std if name.endswith(OUT) else 0.5) / p.shape[-1] ** 0.5
                p.copy_(torch.randn_like(p) * std)
