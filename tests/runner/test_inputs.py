"""The step's M-RoPE positions (jaxllm/runner/inputs.py ``rope_positions``) on the host: a prefill
chunk of a request with images takes its slice of the prompt's precomputed [3, P] positions, a
token past the prompt (a decode) its index + the request's delta in all three streams, a
text-only request and padding the index.  Through the engine: tests/engine/test_qwen_images_end_to_end.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from jaxllm.request import MRope
from jaxllm.runner.inputs import rope_positions


def test_rope_positions_slice_the_prompt_then_add_the_delta():
    P = 6
    prompt = np.stack([np.arange(P), np.arange(P) + 10, np.arange(P) + 20]).astype(np.int32)   # [3, P]
    states = {"img": SimpleNamespace(mrope=MRope(prompt, -3)), "txt": SimpleNamespace(mrope=None)}
    # the image request's chunk 4..7 (two prompt tokens, then two past it), a text decode at 9, one padding token
    positions = np.array([4, 5, 6, 7, 9, 0], np.int32)
    got = rope_positions([("img", 4), ("txt", 1)], states, positions)
    want = np.array([[4, 5, 3, 4, 9, 0], [14, 15, 3, 4, 9, 0], [24, 25, 3, 4, 9, 0]], np.int32)
    np.testing.assert_array_equal(got, want)
    # a decode step alone: index + delta on all three streams
    np.testing.assert_array_equal(rope_positions([("img", 1)], states, np.array([8], np.int32)), [[5], [5], [5]])
