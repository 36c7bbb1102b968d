"""A vision-language engine at tp=2 on two simulated CPU devices, one image: what it saw.

Run by tp_families_probe.py (its process has two devices, fixed before JAX starts; the tests:
tests/parallel/test_tp_families.py).  For a checkpoint (a tiny ``Gemma3ForConditionalGeneration`` or
``Qwen3_5ForConditionalGeneration``, named by its folder): ``LLM`` at tp=2 on the XLA path under
the strict compile guard (the encoder compiled at start-up, nothing compiled twice), ``PROMPTS``'
one image, 32 greedy tokens; the image's rows as the sharded encoder made them (``<name>/rows``)
and as a one-device encoder of the same class makes them from the same pixels (``<name>/rows1``);
the shard shapes of the encoder's and the text model's weights; the all-reduces and all-gathers
in the compiled encoder (``measure``).
"""

from __future__ import annotations

import os
import re

import jax
import numpy as np
from PIL import Image

from jaxllm.models.loader import load_model


STEPS = 32
PROMPTS = {"gemma3": "what is in this <start_of_image> picture ?",
           "qwen3_5": "what is in <|vision_start|><|image_pad|><|vision_end|> the picture ?"}
TOKENS = {"gemma3": 16, "qwen3_5": 1}
"""The step's token budget: Gemma's prompt in one step (an image is never cut); Qwen's one token a
step (its image tokens are causal: the image's rows cross steps), one step program fewer."""
QWEN_KWARGS = {"max_pixels": 16 * 16}
"""Qwen3.5's images capped at 16x16 px (4x4 patches of 4 px): one patch bucket, one encoder
program to compile at start-up; ``image()`` is that size, so the cap resizes nothing."""


def image() -> Image.Image:
    """The probe's image (16x16 px: 4 Gemma tokens after its resize to 56 px; 4 Qwen tokens)."""
    return Image.fromarray(np.random.default_rng(7).integers(0, 256, (16, 16, 3), np.uint8))


def measure(path: str) -> tuple[dict, dict]:
    """One checkpoint -> (arrays ``rows``, ``rows1`` [tokens, D], what else it saw)."""
    from jaxllm import LLM, SamplingParams
    name = os.path.basename(path)
    kw = {"mm_processor_kwargs": QWEN_KWARGS} if name == "qwen3_5" else {}
    llm = LLM(path, tensor_parallel_size=2, max_num_seqs=1, max_num_batched_tokens=TOKENS[name], max_model_len=64,
              dtype="float32", attention_backend="xla", strict_compile_guard=True, show_progress=False, **kw)
    runner = llm.llm_engine.core.runner
    vision = runner.vision
    seen = []                     # the pixels (and grid) the engine's encoder ran
    run = vision.run
    vision.run = lambda px, grid: (seen.append((px, grid)), run(px, grid))[1]
    out = llm.generate({"prompt": PROMPTS[name], "multi_modal_data": {"image": image()}},
                       SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    (rows,) = vision.cache.values()                                    # [tokens, D]: what the step took
    # the same pixels through a one-device encoder of the same class and weights
    one = type(vision)(vision.module, load_model(path).vision, jax.sharding.SingleDeviceSharding(jax.devices()[0]),
                       strict=False, **kw)
    rows1 = one.run(*seen[0])
    lp = vision.params["layers"][0]
    shards = {k: list(v.addressable_shards[0].data.shape) for k, v in lp.items()}
    shards.update({k: list(v.addressable_shards[0].data.shape) for k, v in vision.params.items() if k != "layers"})
    text = runner.params["layers"]
    text = text if isinstance(text, dict) else text[0]
    hlo = "".join(p.as_text() for p in vision._programs.values())
    gathered = sorted({m.group(1) for m in re.finditer(r"= \w+\[([\d,]*)\][^=]*? all-gather\(", hlo)})
    seen_meta = {"tokens": list(out.outputs[0].token_ids), "prompt_token_ids": out.prompt_token_ids,
                 "shards": shards, "programs": len(vision._programs), "encoded": len(seen),
                 "text_shards": {k: list(v.addressable_shards[0].data.shape) for k, v in text.items()},
                 "all_reduce": "all-reduce" in hlo,
                 "all_gathers": [[int(d) for d in g.split(",") if d] for g in gathered]}
    return {"rows": rows, "rows1": rows1}, seen_meta
