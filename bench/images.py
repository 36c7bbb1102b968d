"""Image requests through the engine: requests per second and time to first token at
concurrency 1 and 8, the encoder cache on and off, and the vision encoder's share of TTFT.

    python bench/images.py [--shape real|toy] [--requests 16] [--images 4] [--output-len 8]
                           [--repeats 3] [--output-json F]
    python bench/images.py --pack-cost 2560    # host cost of sending [T, D] image rows every step

No model hub is reachable here, so the model is a random-weight ``Gemma3ForConditionalGeneration``
built with transformers and saved with the test suite's tokenizer and image-processor config
(tests/support/tiny_gemma3_vl.py, imported by path as bench/device_check.py does).  ``--shape real``:
Gemma 3's layer shapes, few layers -- the vision tower SigLIP-so400m's (hidden 1152, FFN 4304,
16 heads, 14 px patches) with 2 layers (27 in the checkpoints) on 224 px images (896 there):
16x16 patches pooled 4x4 (as Gemma 3 pools 64x64) to 16 tokens per image (256 there); the text
model Gemma 3 1B's layer (hidden 1152, FFN 6912, 4 heads, 1 KV head, head_dim 256) with 2 layers
(4B, the smallest with images, has hidden 2560 and 34 layers); a 256-token vocabulary (the tests'
tokenizer).  ``--shape toy``: the tests' tiny config (the cheap test's).  float32.

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


def _support():
    """tests/support/tiny_gemma3_vl.py, imported by path under a private name."""
    name = "_bench_images_tiny_gemma3_vl"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tests", "support", "tiny_gemma3_vl.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def build_checkpoint(out_dir: str, shape: str) -> str:
    """A random-weight Gemma 3 VLM of ``shape`` ("real" or "toy", the module's docstring), saved."""
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
        size = self.vision.cfg.image_size
        rng = np.random.default_rng(0)
        pics = [Image.fromarray(rng.integers(0, 256, (size + 13 * i, size, 3), np.uint8)) for i in range(images)]
        words = ["what", "is", "in", "this", "picture", "describe", "the", "cat", "dog", "and", "a", "of"]
        # distinct text per request (no two prompts alike), the image in turn
        self.reqs = [{"prompt": f"<start_of_image> {words[i % 12]} {words[(i // 12) % 12]} {words[(i * 7) % 12]} ?",
                      "multi_modal_data": {"image": pics[i % images]}} for i in range(requests)]
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
        import jax
        v = self.vision
        S = v.cfg.image_size
        prog = v._program((S, S))
        px = np.random.default_rng(1).standard_normal((1, 3, S, S)).astype(np.float32)
        jax.block_until_ready(prog(v.params, px))
        ts = []
        for _ in range(max(5, repeats * 3)):
            t0 = time.perf_counter()
            jax.block_until_ready(prog(v.params, px))
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=("real", "toy"), default="real")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--folder", default=None, help="where the checkpoint is built (default: under the temp dir)")
    ap.add_argument("--pack-cost", type=int, default=None, metavar="D",
                    help="instead: the host cost of packing [T, D] image rows into a step's inputs")
    a = ap.parse_args(argv)
    if a.pack_cost:
        pack_cost(a.pack_cost, max(a.repeats, 3))
        return 0
    if a.requests < 8 + a.images * -(-8 // a.images):
        raise SystemExit("--requests too few: the c=8 TTFT needs 8 requests after a batch that covers every image")
    folder = a.folder or os.path.join(tempfile.gettempdir(), f"jaxllm-bench-images-{a.shape}")
    if not os.path.exists(os.path.join(folder, "config.json")):
        build_checkpoint(folder, a.shape)
    arms = Arms(folder, a.requests, a.images, a.output_len)
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
    cfg = arms.vision.cfg
    print(f"shape {a.shape}: vision hidden {cfg.hidden_size}, {cfg.image_size} px -> {cfg.mm_tokens_per_image} "
          f"tokens/image, text hidden {cfg.text_hidden_size}; {a.requests} requests over {a.images} images, "
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
