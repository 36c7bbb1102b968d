"""Image requests through the engine: requests per second and time to first token at
concurrency 1 and 8, the encoder cache on and off, and the vision encoder's share of TTFT.

    python bench/images.py [--family gemma3|qwen3_5] [--shape real|toy] [--requests 16] [--images 4]
                           [--output-len 8] [--repeats 3] [--output-json F]
    python bench/images.py --pack-cost 2560    # host cost of sending [T, D] image rows every step
    python bench/images.py --family qwen3_5 --text-prefill 500 --max-num-seqs 64 --max-num-batched-tokens 512
                                               # one text prompt's prefill through the text model
    python bench/images.py --family qwen3_5 --text-prefill 960 --beside 16 --max-num-seqs 64 \
                           --max-num-batched-tokens 256   # ... while 16 requests decode beside it

No model hub is reachable here, so the model is a random-weight ``Gemma3ForConditionalGeneration``
built with transformers and saved with the test suite's tokenizer and image-processor config
(tests/support/tiny_gemma3_vl.py, imported by path as bench/device_check.py does).  ``--shape real``:
Gemma 3's layer shapes, few layers -- the vision tower SigLIP-so400m's (hidden 1152, FFN 4304,
16 heads, 14 px patches) with 2 layers (27 in the checkpoints) on 224 px images (896 there):
16x16 patches pooled 4x4 (as Gemma 3 pools 64x64) to 16 tokens per image (256 there); the text
model Gemma 3 1B's layer (hidden 1152, FFN 6912, 4 heads, 1 KV head, head_dim 256) with 2 layers
(4B, the smallest with images, has hidden 2560 and 34 layers); a 256-token vocabulary (the tests'
tokenizer).  ``--shape toy``: the tests' tiny config (the cheap test's).  float32.

``--family qwen3_5``: a random-weight ``Qwen3_5ForConditionalGeneration`` (tests/support/
tiny_qwen3_5_vl.py's tokenizer, vision token ids and processor kind).  ``--shape real``: the
vision tower transformers' ``Qwen3_5VisionConfig`` defaults (the Qwen3.5 checkpoints' tower:
hidden 1152, FFN 4304, 16 heads, 16 px patches x 2 frames, 2x2 merger, a 48x48 learned position
grid) with 2 blocks (27 there) on 256x256 px images: 16x16 patches merged to 64 tokens an image
(the processor's pixels 128^2..256^2: encoder buckets 64, 128, 256 patches); the text model
``Qwen3_5TextConfig``'s head layout (full attention 16 heads x 256, 4 KV heads, gated output,
partial rotary 0.25 with M-RoPE sections 11/11/10 interleaved; Gated DeltaNet 16 key heads x 128,
32 value heads x 128, conv 4) at hidden 1024, FFN 3072 (the default's 3x), 2 layers (one GDN, one
full attention; the checkpoints repeat 3 GDN + 1 full); the tests' 320-token vocabulary.
``--shape toy``: the tests' tiny Qwen3.5 checkpoint.  Each request is ``<|vision_start|>
<|image_pad|><|vision_end|>`` and a few word ids distinct per request (``prompt_token_ids``).

One engine (``max_num_seqs`` 8, prefix caching off so every request prefills its image tokens and
only the encoder cache can save work).  Each request is ``<start_of_image>`` and a few words
distinct per request; its image is one of ``--images`` random images, in turn, so with the cache
on (its default budget, 64 images) every image after the first ``--images`` requests is a hit.
The arms, alternated call by call (the order flips every repeat), medians reported:

* ``cache on`` / ``cache off``: the same engine, its encoder cache budget set to its default or 0
  (``--mm-encoder-cache-tokens 0``) and emptied before the arm's calls;
* ``c=1``: the requests one ``generate`` at a time; ``c=8``: in one ``generate`` of 8 (the engine
  runs them as one batch).  Requests/s: ``--requests`` / the arm's seconds, each ``--output-len``
  tokens (``ignore_eos``).  TTFT: the seconds of a ``generate`` of ``max_tokens=1`` (c=1: one
  request; c=8: 8 requests, the last one's first token).
* the encoder's share of TTFT: the seconds the engine spent in the encoder during the TTFT call
  (``VisionEncoder.seconds``: each miss's program call until its rows are on the host) over the
  call's; and the encoder alone: its compiled program on one image, timed to ``block_until_ready``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)          # python bench/images.py from anywhere


def _support(module: str = "tiny_gemma3_vl"):
    """tests/support/<module>.py, imported by path under a private name (its own ``support.``
    imports resolve through tests/ on sys.path)."""
    name = f"_bench_images_{module}"
    if name not in sys.modules:
        tests = os.path.join(REPO, "tests")
        if tests not in sys.path:
            sys.path.append(tests)
        spec = importlib.util.spec_from_file_location(name, os.path.join(tests, "support", f"{module}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


# Qwen3.5 --shape real's image processor: 16 px patches, images of 128^2..256^2 px (64..256 patches)
QWEN_PROCESSOR = dict(patch_size=16, merge_size=2, temporal_patch_size=2,
                      size={"shortest_edge": 128 * 128, "longest_edge": 256 * 256})


def build_qwen_checkpoint(out_dir: str, shape: str) -> str:
    """A random-weight Qwen3.5 VLM of ``shape`` (the module's docstring), saved with the tests'
    tokenizer and the processor's config."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    sup = _support("tiny_qwen3_5_vl")
    if shape == "toy":
        return sup.save_vl_checkpoint(sup.tiny_model(), out_dir)
    text = dict(vocab_size=320, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
                layer_types=["linear_attention", "full_attention"], num_attention_heads=16, num_key_value_heads=4,
                head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=1024,
                tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=1024, num_position_embeddings=2304,
                  hidden_act="gelu_pytorch_tanh")
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=sup.IMAGE_TOKEN,
                        video_token_id=sup.VIDEO_TOKEN, vision_start_token_id=sup.VISION_START,
                        vision_end_token_id=sup.VISION_END)
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(cfg).eval().float()
    model.save_pretrained(out_dir)
    sup.save_tokenizer(out_dir)
    Qwen2VLImageProcessorPil(**QWEN_PROCESSOR).save_pretrained(out_dir)
    return out_dir


def build_checkpoint(out_dir: str, shape: str, family: str = "gemma3") -> str:
    """A random-weight Gemma 3 (or Qwen3.5: ``family``) VLM of ``shape`` ("real" or "toy", the
    module's docstring), saved."""
    if family == "qwen3_5":
        return build_qwen_checkpoint(out_dir, shape)
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    sup = _support()
    if shape == "toy":
        return sup.save_vl_checkpoint(sup.tiny_model(), out_dir)
    text = dict(vocab_size=256, hidden_size=1152, intermediate_size=6912, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=512,
                sliding_window=512, layer_types=["sliding_attention", "full_attention"], rms_norm_eps=1e-6,
                query_pre_attn_scalar=256, pad_token_id=0, bos_token_id=2, eos_token_id=1)
    vision = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=2, num_attention_heads=16,
                  image_size=224, patch_size=14, layer_norm_eps=1e-6, vision_use_head=False)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16,
                       image_token_index=sup.IMAGE_TOKEN, boi_token_index=sup.BOI, eoi_token_index=sup.EOI)
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).eval().float()
    return sup.save_vl_checkpoint(model, out_dir)


def _load() -> str:
    """The load average (1, 5, 15 min): the machine may be shared."""
    return "average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


class Arms:
    """The engine and its workload: ``time(arm, c, n)`` -> seconds of the arm's calls."""

    def __init__(self, path: str, requests: int, images: int, output_len: int):
        from PIL import Image
        from jaxllm import LLM, SamplingParams
        self.llm = LLM(path, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128, dtype="float32",
                       enable_prefix_caching=False, show_progress=False)
        self.vision = self.llm.llm_engine.core.runner.vision
        self.default_budget = self.vision.cache_tokens
        self.qwen = hasattr(self.vision, "buckets")          # runner/qwen_vision.py's encoder
        # Gemma 3: its one image size (each image resized to it); Qwen3.5: the processor's largest
        # square (max_pixels), so each image's grid is about the largest bucket's
        size = (int(self.llm.llm_engine.input_processor.images.processor.max_pixels ** 0.5) if self.qwen
                else self.vision.cfg.image_size)
        rng = np.random.default_rng(0)
        pics = [Image.fromarray(rng.integers(0, 256, (size + 13 * i, size, 3), np.uint8)) for i in range(images)]
        # distinct text per request (no two prompts alike), the image in turn
        if self.qwen:
            c = self.vision.cfg
            self.reqs = [{"prompt_token_ids": [c.vision_start_token_id, c.image_token_id, c.vision_end_token_id,
                                               10 + i % 12, 10 + (i // 12) % 12, 10 + (i * 7) % 12, 18],
                          "multi_modal_data": {"image": pics[i % images]}} for i in range(requests)]
        else:
            words = ["what", "is", "in", "this", "picture", "describe", "the", "cat", "dog", "and", "a", "of"]
            self.reqs = [{"prompt": f"<start_of_image> {words[i % 12]} {words[(i // 12) % 12]} "
                                    f"{words[(i * 7) % 12]} ?", "multi_modal_data": {"image": pics[i % images]}}
                         for i in range(requests)]
        self.params = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)   # noqa: E731
        self.output_len = output_len
        self.images = images

    def set_cache(self, on: bool) -> None:
        v = self.vision
        v.cache_tokens = self.default_budget if on else 0
        v.cache.clear()
        v.cached_tokens = 0

    def _run(self, reqs, c: int, n: int) -> float:
        t0 = time.perf_counter()
        for i in range(0, len(reqs), c):
            outs = self.llm.generate(reqs[i:i + c], self.params(n), use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == n for o in outs)
        return time.perf_counter() - t0

    def rate(self, on: bool, c: int) -> float:
        self.set_cache(on)
        misses = self.vision.misses
        t = self._run(self.reqs, c, self.output_len)
        self.encoded = self.vision.misses - misses     # images the encoder ran on in the call
        return len(self.reqs) / t

    def ttft(self, on: bool, c: int) -> float:
        """One ``generate`` of ``max_tokens=1`` over c requests, after the arm's cache is warm
        with their images (cache on: all hits; off: every image encoded)."""
        self.set_cache(on)
        self._run(self.reqs[:c], c, 1)
        m = self.images * -(-c // self.images)          # the same images again, other texts
        enc = self.vision.seconds
        t = self._run(self.reqs[m:m + c], c, 1)
        self.encoder_share = (self.vision.seconds - enc) / t   # of this call, in the encoder
        return t

    def encoder_seconds(self, repeats: int) -> float:
        """The encoder on one image (Qwen3.5: of the largest bucket's patches, its grid's host
        arrays included), timed to its rows."""
        import jax
        v = self.vision
        if self.qwen:
            n, m = v.buckets[-1], v.cfg.spatial_merge_size
            side = int(n ** 0.5) // m * m
            px = np.random.default_rng(1).standard_normal((side * side, v.cfg.patch_dim)).astype(np.float32)

            def call():
                return v.run(px, (1, side, side))
        else:
            S = v.cfg.image_size
            prog = v._program((S, S))
            px = np.random.default_rng(1).standard_normal((1, 3, S, S)).astype(np.float32)

            def call():
                return prog(v.params, px)
        jax.block_until_ready(call())
        ts = []
        for _ in range(max(5, repeats * 3)):
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    def describe(self) -> str:
        cfg = self.vision.cfg
        if self.qwen:
            n = self.vision.buckets[-1]
            return (f"Qwen3.5: vision hidden {cfg.hidden_size} x {cfg.depth} blocks, up to {n} patches -> "
                    f"{n // cfg.merge_unit} tokens/image, text hidden {cfg.out_hidden_size}")
        return (f"Gemma 3: vision hidden {cfg.hidden_size}, {cfg.image_size} px -> {cfg.mm_tokens_per_image} "
                f"tokens/image, text hidden {cfg.text_hidden_size}")


def pack_cost(D: int, repeats: int) -> None:
    """What a step's image rows [T, D] float32 cost on the host when they travel packed with the
    step's inputs (runner/packing.py), as every vision-language step's did before a text-only step
    passed a zero buffer kept on the device: ``pack`` of 26 small int32 arrays with and without
    the rows (and their [T] row indices), the median of 50-call means."""
    from jaxllm.runner import packing
    print("| T | D | rows (MiB) | pack with rows (ms) | pack without (ms) |")
    print("|---|---|---|---|---|")
    for T in (8, 64, 512, 2048):
        small = [np.zeros(T, np.int32) for _ in range(8)] + [np.zeros(64, np.int32) for _ in range(18)]

        def run(rows: bool) -> float:
            t0 = time.perf_counter()
            for _ in range(50):
                packing.pack(small + ([np.full(T, -1, np.int32), np.zeros((T, D), np.float32)] if rows else []))
            return (time.perf_counter() - t0) / 50
        w = statistics.median(run(True) for _ in range(repeats))
        wo = statistics.median(run(False) for _ in range(repeats))
        print(f"| {T} | {D} | {T * D * 4 / 2**20:.1f} | {w * 1e3:.3f} | {wo * 1e3:.3f} |")
    print(f"load {_load()}")


def text_prefill(folder: str, tokens: int, max_num_seqs: int, budget: int, repeats: int,
                 beside: int = 0) -> list[float]:
    """Seconds of ``generate`` of one text prompt of ``tokens`` ids, one output token, after a
    warm-up call: the prefill through the text model (in chunks of ``budget`` tokens, in the
    step buckets ``max_num_seqs`` sets: a hybrid model's GDN prefill work grows with both).
    ``beside``: that many requests of 8 prompt ids and 32 output tokens in the same call,
    decoding while the prompt's later chunks prefill (steps that mix both); the seconds are
    the whole call's."""
    from jaxllm import LLM, SamplingParams
    llm = LLM(folder, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=tokens + 40,
              dtype="float32", enable_prefix_caching=False, show_progress=False)
    one, streams = SamplingParams(max_tokens=1, temperature=0), SamplingParams(max_tokens=32, temperature=0,
                                                                               ignore_eos=True)
    out = []
    for r in range(repeats + 1):
        ids = [10 + (r * 7 + j) % 200 for j in range(tokens)]   # distinct per call, in the tests' 320 ids
        short = [{"prompt_token_ids": [10 + (r + i * 11 + j) % 200 for j in range(8)]} for i in range(beside)]
        t = time.perf_counter()
        llm.generate(short + [{"prompt_token_ids": ids}], [streams] * beside + [one])
        out.append(time.perf_counter() - t)
    return out[1:]


def _checkpoint(a) -> str:
    """The folder of the arguments' checkpoint, built there first if missing."""
    tag = a.shape if a.family == "gemma3" else f"{a.family}-{a.shape}"
    folder = a.folder or os.path.join(tempfile.gettempdir(), f"jaxllm-bench-images-{tag}")
    if not os.path.exists(os.path.join(folder, "config.json")):
        build_checkpoint(folder, a.shape, a.family)
    return folder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=("gemma3", "qwen3_5"), default="gemma3")
    ap.add_argument("--shape", choices=("real", "toy"), default="real")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--folder", default=None, help="where the checkpoint is built (default: under the temp dir)")
    ap.add_argument("--pack-cost", type=int, default=None, metavar="D",
                    help="instead: the host cost of packing [T, D] image rows into a step's inputs")
    ap.add_argument("--text-prefill", type=int, default=None, metavar="N",
                    help="instead: the seconds of one N-token text prompt's prefill (one output token)")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="with --text-prefill (default 8)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=256, help="with --text-prefill (default 256)")
    ap.add_argument("--beside", type=int, default=0, metavar="K",
                    help="with --text-prefill: K requests decoding 32 tokens in the same call (default 0)")
    a = ap.parse_args(argv)
    if a.text_prefill:
        secs = text_prefill(_checkpoint(a), a.text_prefill, a.max_num_seqs, a.max_num_batched_tokens, a.repeats,
                            a.beside)
        beside = f" and {a.beside} requests of 32 output tokens" if a.beside else ""
        print(f"{a.family} {a.shape}: one {a.text_prefill}-token text prompt{beside}, max_num_seqs {a.max_num_seqs}, "
              f"max_num_batched_tokens {a.max_num_batched_tokens}: median {statistics.median(secs) * 1e3:.0f} ms "
              f"({', '.join(f'{x * 1e3:.0f}' for x in secs)}); load {_load()}")
        return 0
    if a.pack_cost:
        pack_cost(a.pack_cost, max(a.repeats, 3))
        return 0
    if a.requests < 8 + a.images * -(-8 // a.images):
        raise SystemExit("--requests too few: the c=8 TTFT needs 8 requests after a batch that covers every image")
    arms = Arms(_checkpoint(a), a.requests, a.images, a.output_len)
    names = [(on, c) for c in (1, 8) for on in (True, False)]
    for on, c in names:               # warm: every program of every arm, outside the timing
        arms.rate(on, c)
        arms.ttft(on, c)
    rates = {k: [] for k in names}
    ttfts = {k: [] for k in names}
    encoded, shares = {}, {}
    for r in range(a.repeats):
        order = names if r % 2 == 0 else names[::-1]
        for k in order:
            rates[k].append(arms.rate(*k))
            encoded[k] = arms.encoded
            ttfts[k].append(arms.ttft(*k))
            shares.setdefault(k, []).append(arms.encoder_share)
    enc = arms.encoder_seconds(a.repeats)
    print(f"shape {a.shape}, {arms.describe()}; {a.requests} requests over {a.images} images, "
          f"{a.output_len} tokens each; medians of {a.repeats}; load {_load()}")
    print("| concurrency | encoder cache | requests/s | TTFT (ms) | encoder's share of TTFT | images encoded per run |")
    print("|---|---|---|---|---|---|")
    out = {}
    for on, c in names:
        rate, ttft, share = (statistics.median(x[on, c]) for x in (rates, ttfts, shares))
        out[f"c{c}_{'on' if on else 'off'}"] = {"rates": rates[on, c], "ttfts": ttfts[on, c],
                                                 "encoded": encoded[on, c], "shares": shares[on, c]}
        print(f"| {c} | {'on' if on else 'off'} | {rate:.2f} | {ttft * 1e3:.1f} | {share:.0%} "
              f"| {encoded[on, c]} of {a.requests} |")
    print(f"encoder alone, one image: {enc * 1e3:.1f} ms")
    out["encoder_s"] = enc
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
