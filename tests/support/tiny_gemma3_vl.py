"""A tiny random ``Gemma3ForConditionalGeneration`` (float32) built with transformers: SigLIP
vision hidden 32, 2 layers, 56 px images in 14 px patches (4x4) pooled 2x2 to 4 tokens per
image; a 2-layer Gemma 3 text model with a sliding window."""

from __future__ import annotations

import numpy as np
import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

IMAGE_TOKEN, BOI, EOI = 250, 251, 252


def tiny_config(image_size: int = 56, tokens_per_image: int = 4) -> Gemma3Config:
    """A tiny config: 56 px images -> 4x4 patches of 14 px, pooled 2x2 -> 4 tokens per image."""
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                sliding_window=8, layer_types=["sliding_attention", "full_attention"], rms_norm_eps=1e-6,
                query_pre_attn_scalar=16, pad_token_id=0, bos_token_id=2, eos_token_id=1)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=image_size, patch_size=14, layer_norm_eps=1e-6, vision_use_head=False)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=tokens_per_image,
                       image_token_index=IMAGE_TOKEN, boi_token_index=BOI, eoi_token_index=EOI)
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    return cfg


def tiny_model(seed: int = 0, **kw) -> Gemma3ForConditionalGeneration:
    """Random weights (norm weights and the projector included, which transformers inits to zeros)."""
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(tiny_config(**kw)).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "mm_input_projection" in name or "embedding" in name:
                p.normal_(0.0, 0.3 if "norm" in name else 0.2)
    return model


def save_text_part(model: Gemma3ForConditionalGeneration, out_dir: str) -> str:
    """The text model as a ``Gemma3ForCausalLM`` checkpoint (the loader's text family reads it)."""
    from transformers import Gemma3ForCausalLM
    text = Gemma3ForCausalLM(model.config.text_config).eval().float()
    sd = {k.replace("model.language_model.", "model."): v for k, v in model.state_dict().items()
          if k.startswith("model.language_model.") or k.startswith("lm_head.")}
    text.load_state_dict(sd)
    text.config.architectures = ["Gemma3ForCausalLM"]
    text.save_pretrained(out_dir)
    return out_dir


class PagedGemma3VL:
    """The jaxllm text model (models/gemma) + vision encoder on one sequence through a paged
    cache, two compiled programs (the prompt, one decode token), greedy; ``attention``: the
    paged attention's backend ("xla", "native" or "pallas" in interpret mode)."""

    def __init__(self, text_dir: str, hf_model, block: int = 8, num_blocks: int = 16, attention: str = "xla"):
        import jax
        from jaxllm.models import gemma
        from jaxllm.models.gemma3_vl import VisionConfig, encode, load_params
        from jaxllm.models.kernels import Kernels
        from jaxllm.models.loader import load_model
        from jaxllm.runner.weights import allocate_kv_cache, to_device_params
        import jax.numpy as jnp
        model = load_model(text_dir)
        self.arch = model.arch
        self.params = to_device_params(model, jnp.float32, False)
        self.vcfg = VisionConfig.from_hf(hf_model.config)
        vparams = load_params(self.vcfg, {k: v.numpy() for k, v in hf_model.state_dict().items()})
        self.encode = jax.jit(lambda px: encode(self.vcfg, vparams, px))
        self.block, self.num_blocks = block, num_blocks
        self.new_cache = lambda: allocate_kv_cache(self.arch.num_layers, num_blocks, block, self.arch.num_kv_heads,
                                                   self.arch.head_dim, jnp.float32, stacked=False)
        kernels = Kernels(attention=attention)
        fwd = lambda p, kv, ids, md, rows: gemma.forward(self.arch, p, kv, ids, md, kernels, image_rows=rows)
        self.fwd = jax.jit(lambda p, kv, ids, md, rows: (lambda h, kv: (gemma.compute_logits(self.arch, p, h), kv))(
            *fwd(p, kv, ids, md, rows)))

    def _md(self, pos, vis):
        from jaxllm.layers.attention import AttentionMetadata
        table = np.random.default_rng(0).permutation(self.num_blocks).astype(np.int32)
        return AttentionMetadata(positions=pos, slot_mapping=(table[pos // self.block] * self.block
                                                                 + pos % self.block).astype(np.int32),
                                 token_seq=np.zeros(len(pos), np.int32), block_tables=table[None, :],
                                 seq_lens=np.array([pos[-1] + 1], np.int32),
                                 query_start_loc=np.array([0, len(pos)], np.int32), visible_upto=vis)

    def greedy(self, ids: list[int], pixels: np.ndarray, n: int = 32) -> tuple[np.ndarray, list[int]]:
        """ids: the expanded prompt; pixels [N, 3, S, S] -> (the prompt's logits [T, V], n greedy tokens)."""
        from jaxllm.models.gemma3_vl import visible_upto
        emb = self.encode(pixels).reshape(-1, self.arch.hidden_size)          # [N * T_img, D]
        is_img = np.asarray(ids) == self.vcfg.image_token_id
        row = np.where(is_img, np.cumsum(is_img) - 1, -1).astype(np.int32)     # [T]
        T = len(ids)
        pos = np.arange(T, dtype=np.int32)
        logits, kv = self.fwd(self.params, self.new_cache(), np.asarray(ids, np.int32),
                              self._md(pos, visible_upto(self.vcfg, ids)), (row, emb))
        prompt_logits = np.asarray(logits)
        out = [int(prompt_logits[-1].argmax())]
        no_rows = (np.full(1, -1, np.int32), emb[:1])
        for i in range(n - 1):
            p = np.array([T + i], np.int32)
            logits, kv = self.fwd(self.params, kv, np.array(out[-1:], np.int32), self._md(p, p), no_rows)
            out.append(int(np.asarray(logits)[-1].argmax()))
        return prompt_logits, out


def hf_greedy_vl(hf_model, ids: list[int], pixels: np.ndarray, n: int = 32) -> tuple[np.ndarray, list[int]]:
    """transformers' prompt logits and ``generate`` (greedy) with the processor's token_type_ids."""
    x = torch.tensor([ids])
    tt = (x == IMAGE_TOKEN).long()
    px = torch.from_numpy(np.asarray(pixels))
    with torch.no_grad():
        logits = hf_model(input_ids=x, pixel_values=px, token_type_ids=tt).logits[0].numpy()
        gen = hf_model.generate(input_ids=x, pixel_values=px, token_type_ids=tt, attention_mask=torch.ones_like(x),
                                max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return logits, gen[0, len(ids):].tolist()


WORDS = ["user", "model", "assistant", "system", "what", "is", "in", "this", "image", "describe", "the",
         "picture", "a", "cat", "dog", "and", "of", "see", "you", "do", "?", ".", ","]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] }}{% endif %} {% endfor %}{% endif %}"
    "<end_of_turn> {% endfor %}{% if add_generation_prompt %}<start_of_turn>model {% endif %}")


NEWLINES = {"\n" * k: 25 + k for k in range(1, 9)}   # runs of 1..8 newlines, one token each (as Gemma 3's)


def save_tokenizer(out_dir: str) -> None:
    """A word-level tokenizer over the tiny vocabulary (256) with Gemma 3's image tokens at
    their ids (250-252), named as Gemma 3's tokenizer names them (``boi_token`` ...) so that
    transformers' ``Gemma3Processor`` takes it, each run of 1-8 newlines one token (26-33: the
    processor puts "\\n\\n" around each image, and a run it meets merges as in Gemma 3's vocab),
    and a chat template that puts ``<start_of_image>`` where an image part is."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    for i in range(3, 250):
        vocab[WORDS[i - 3] if i - 3 < len(WORDS) else f"w{i}"] = i
    for run, i in NEWLINES.items():
        del vocab[f"w{i}"]
        vocab[run] = i
    for i, t in enumerate(("<image_soft_token>", "<start_of_image>", "<end_of_image>", "<start_of_turn>",
                           "<end_of_turn>", "<unk>")):
        vocab[t] = 250 + i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # words split at spaces (dropped) and at runs of newlines (kept, each run one piece)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"[^\S\n]+"), "removed"),
                                                 pre_tokenizers.Split(Regex(r"\n+"), "isolated")])
    tok.decoder = decoders.ByteLevel()   # a decoder llguidance knows (the server's structured outputs)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", extra_special_tokens={
                                       "image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                                       "eoi_token": "<end_of_image>"}, additional_special_tokens=[
                                       "<image_soft_token>", "<start_of_image>", "<end_of_image>",
                                       "<start_of_turn>", "<end_of_turn>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def hf_processor(path: str, tokens_per_image: int = 4):
    """transformers' ``Gemma3Processor`` over a saved checkpoint's tokenizer and image processor:
    the oracle of the expanded prompt ids and the pixels."""
    from transformers import AutoTokenizer, Gemma3ImageProcessor, Gemma3Processor
    return Gemma3Processor(image_processor=Gemma3ImageProcessor.from_pretrained(path),
                           tokenizer=AutoTokenizer.from_pretrained(path), image_seq_length=tokens_per_image)


def save_vl_checkpoint(model: Gemma3ForConditionalGeneration, out_dir: str) -> str:
    """The whole checkpoint as jaxllm serves it: weights, tokenizer, the image processor's config."""
    from transformers import Gemma3ImageProcessor
    model.save_pretrained(out_dir)
    save_tokenizer(out_dir)
    size = model.config.vision_config.image_size
    Gemma3ImageProcessor(size={"height": size, "width": size}).save_pretrained(out_dir)
    return out_dir
