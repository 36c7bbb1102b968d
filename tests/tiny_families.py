"""Tiny random-weight checkpoints of Gemma 2, Gemma 3 (text) and GPT-OSS, every option that
sets each apart switched on, built with transformers (``tiny_models.build_tiny``).

Windows of 8 positions, so that the test prompts (40 tokens, 32 more generated) cross them;
soft caps low enough to bend the random model's scores; a ``query_pre_attn_scalar`` that is
not the head dim; Gemma 3's two RoPE bases with linear scaling on the global layers.
"""

from __future__ import annotations

from tiny_models import BASE

FAMILY_VARIANTS = {
    # Alternating sliding/full layers (transformers' default pattern for 3 layers).
    "gemma2": ("Gemma2Config", dict(
        head_dim=16, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=10.0, tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh")),
    # Gemma3TextConfig: q/k norm, layer_types, local base and scaled global rope.
    "gemma3": ("Gemma3TextConfig", dict(
        head_dim=32, num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}},
        final_logit_softcapping=15.0, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh")),
}

def build_family(variant: str, out_dir: str, tokenizer_dir: str | None = None, seed: int = 0) -> str:
    from tiny_models import build_tiny
    return build_tiny(variant, out_dir, tokenizer_dir, seed, variants=FAMILY_VARIANTS)


__all__ = ["BASE", "FAMILY_VARIANTS", "build_family"]
