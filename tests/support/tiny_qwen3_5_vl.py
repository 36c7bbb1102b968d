"""A tiny random ``Qwen3_5ForConditionalGeneration`` (float32) built with transformers: a vision
tower of hidden 32, 2 blocks, 2 heads (head dim 16), 4 px patches, 2x2 patch merger into the
text hidden 64, a 4x4 learned position grid (interpolated to each image's grid); the text side is
tests/support/tiny_hybrid.py's hybrid Qwen3.5 with M-RoPE sections."""

from __future__ import annotations

import numpy as np
import torch
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from support.tiny_hybrid import COMMON, widen

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 250, 251, 252, 253

# the image processor the engine tests save with the checkpoint: 4 px patches, images resized
# to 256..1024 px (16..64 patches: the encoder's patch buckets 16, 32, 64)
PROCESSOR = dict(patch_size=4, merge_size=2, temporal_patch_size=2,
                 size={"shortest_edge": 16 * 16, "longest_edge": 32 * 32})

VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
              hidden_act="gelu_pytorch_tanh")


def tiny_config(text_layers: int = 5) -> Qwen3_5Config:
    """``text_layers``: 5 (tiny_hybrid's), or 2 (one GDN and one full-attention layer: fewer to
    compile where the text model is not what a test is about)."""
    # head_dim 16, partial rotary 0.5 -> 8 rotary dims = 4 frequencies, split t/h/w as 2/1/1
    layers = {} if text_layers == 5 else dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    text = dict(COMMON, **layers, intermediate_size=48, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    cfg = Qwen3_5Config(text_config=text, vision_config=dict(VISION), image_token_id=IMAGE_TOKEN,
                        video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                        vision_end_token_id=VISION_END)
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    return cfg


def tiny_model(seed: int = 0, text_layers: int = 5) -> Qwen3_5ForConditionalGeneration:
    """Random weights: the text model's as tiny_hybrid draws them (clear greedy winners); the
    vision norms, biases and learned position grid too (transformers inits them flat)."""
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(tiny_config(text_layers)).eval().float()
    widen(model, tied=False, prefix="model.language_model.")
    widen(model, tied=False, prefix="lm_head.")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name and ("norm" in name or "pos_embed" in name or name.endswith("bias")):
                p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.2)
    return model


def hf_processor():
    """transformers' torch-free Qwen image processor (the oracle's pixels and grids)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(**PROCESSOR)


WORDS = ["user", "assistant", "system", "what", "is", "in", "this", "image", "describe", "the", "picture", "a",
         "cat", "dog", "and", "of", "?", "."]
SPECIAL = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_start|>", "<|im_end|>")
# Qwen's chat template's shape: an image part is "<|vision_start|><|image_pad|><|vision_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %} "
    "{% endfor %}{% endif %}<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def save_tokenizer(out_dir: str) -> None:
    """A word-level tokenizer over the tiny vocabulary (320) with Qwen's vision tokens at the
    config's ids (250-253) and a chat template that puts them where an image part is."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<|endoftext|>": 1}
    for i in range(2, 320):
        vocab[WORDS[i - 2] if i - 2 < len(WORDS) else f"w{i}"] = i
    for i, t in enumerate(SPECIAL):
        del vocab[f"w{250 + i}"]
        vocab[t] = 250 + i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.ByteLevel()   # a decoder llguidance knows (the server's structured outputs)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>",
                                   additional_special_tokens=list(SPECIAL))
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def save_vl_checkpoint(model: Qwen3_5ForConditionalGeneration, out_dir: str) -> str:
    """The whole checkpoint as jaxllm serves it: weights, tokenizer, ``hf_processor``'s
    ``preprocessor_config.json``."""
    model.save_pretrained(out_dir)
    save_tokenizer(out_dir)
    hf_processor().save_pretrained(out_dir)
    return out_dir


class PagedQwen3_5VL:
    """The jaxllm text model (models/qwen3_next, with image rows and M-RoPE positions) + the
    vision tower (models/qwen3_5_vl) on one sequence through a paged cache, two compiled
    programs (the prompt, one decode token), greedy; ``backend``: "xla", "native" (the CPU
    kernels' matmul and attention) or "pallas" (the attention kernel, interpret mode on CPU)."""

    def __init__(self, path: str, hf_model, block: int = 8, num_blocks: int = 16, backend: str = "xla"):
        """``path``: the whole checkpoint (the loader takes its text half); the tower's weights
        from ``hf_model``."""
        import jax
        import jax.numpy as jnp
        from jaxllm.models import qwen3_next
        from jaxllm.models.kernels import Kernels
        from jaxllm.models.loader import load_model
        from jaxllm.models.qwen3_5_vl import VisionConfig, encode, load_params
        from jaxllm.runner.weights import to_device_params
        model = load_model(path)
        assert model.vision.cfg == VisionConfig.from_hf(hf_model.config)   # the engine's image side
        self.arch = model.arch
        self.params = to_device_params(model, jnp.float32, False, native=backend == "native")
        kernels = Kernels(matmul="native" if backend == "native" else "xla", attention=backend)
        self.vcfg = VisionConfig.from_hf(hf_model.config)
        vparams = load_params(self.vcfg, {k: v.numpy() for k, v in hf_model.state_dict().items()})
        self.encode = jax.jit(lambda px, gi: encode(self.vcfg, vparams, px, gi))
        self.block, self.num_blocks = block, num_blocks
        self.new_cache = lambda: qwen3_next.allocate_cache(self.arch, num_blocks, block, jnp.float32, stacked=False)

        def step(p, kv, ids, md, rows, rope):
            h, kv = qwen3_next.forward(self.arch, p, kv, ids, md, kernels, image_rows=rows, rope_positions=rope)
            return qwen3_next.compute_logits(self.arch, p, h, kernels), kv
        self.fwd = jax.jit(step)

    def _md(self, pos):
        from jaxllm.layers.attention import AttentionMetadata
        table = np.random.default_rng(0).permutation(self.num_blocks).astype(np.int32)
        return AttentionMetadata(positions=pos, slot_mapping=(table[pos // self.block] * self.block
                                                                 + pos % self.block).astype(np.int32),
                                 token_seq=np.zeros(len(pos), np.int32), block_tables=table[None, :],
                                 seq_lens=np.array([pos[-1] + 1], np.int32),
                                 query_start_loc=np.array([0, len(pos)], np.int32))

    def greedy(self, ids: list[int], patches: np.ndarray, grids, n: int = 32) -> tuple[np.ndarray, list[int]]:
        """ids: the expanded prompt; patches [N, C*Tp*P*P] of the images (grid_thw ``grids``)
        -> (the prompt's logits [T, V], n greedy tokens)."""
        from jaxllm.models.qwen3_5_vl import grid_inputs, mrope_positions
        emb = self.encode(patches, grid_inputs(self.vcfg, grids))               # [N / 4, D]
        is_img = np.asarray(ids) == self.vcfg.image_token_id
        row = np.where(is_img, np.cumsum(is_img) - 1, -1).astype(np.int32)      # [T]
        rope, delta = mrope_positions(self.vcfg, ids, grids)                    # [3, T]
        T = len(ids)
        logits, kv = self.fwd(self.params, self.new_cache(), np.asarray(ids, np.int32),
                              self._md(np.arange(T, dtype=np.int32)), (row, emb), rope)
        prompt_logits = np.asarray(logits)
        out = [int(prompt_logits[-1].argmax())]
        no_rows = (np.full(1, -1, np.int32), emb[:1])
        for i in range(n - 1):
            p = np.array([T + i], np.int32)
            logits, kv = self.fwd(self.params, kv, np.array(out[-1:], np.int32), self._md(p), no_rows,
                                  np.repeat(p[None] + delta, 3, axis=0))
            out.append(int(np.asarray(logits)[-1].argmax()))
        return prompt_logits, out


def hf_greedy_vl(hf_model, ids: list[int], patches: np.ndarray, grids, n: int = 32) -> tuple[np.ndarray, list[int]]:
    """transformers' prompt logits and ``generate`` (greedy) with the processor's mm_token_type_ids."""
    x = torch.tensor([ids])
    kw = dict(pixel_values=torch.from_numpy(np.asarray(patches)), image_grid_thw=torch.tensor(grids),
              mm_token_type_ids=(x == IMAGE_TOKEN).int())
    with torch.no_grad():
        logits = hf_model(input_ids=x, **kw).logits[0].numpy()
        gen = hf_model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, **kw)
    return logits, gen[0, len(ids):].tolist()
