"""``--cpu-matmul native-int16`` (and ``auto`` where the CPU lacks AVX-512): Q4_1 blocks by
activations rounded to int16 per 32 values (``cpu/quant_dot.cc``'s ``jaxllm_dot_i16_q4_1``; on
AVX-512 VNNI the Q4_1 and Q8_0 weights in 16-row groups, ``jaxllm_dot16_i16_*``), the other
types as ``native``.

The kernel against its emulation and the float64 product: tests/kernels/test_cpu_quant_dot.py.
Here: that the flag reaches the model's linear maps, that the built-in model's
logits stay within a small distance of float32 activations' (int8's move by units: 1/258 of
its rounding should move them by hundredths), and that a token's logits are the same bits
whatever step shape computes them (chunked prefill and speculation rest on it).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.config import EngineConfig
from jaxllm.cpu import native
from jaxllm.engine.resolve import resolve_config

from support.tiny_models import paged_logits

pytestmark = pytest.mark.skipif(not native.quant_available(), reason="the native packed-block matmul did not build")

# The positions of tests/quant/test_builtin_int8.py: 8-15 one token per step in ONE, eight per
# step in EIGHT (EIGHT's float32 program is that module's too: a compile-cache hit in the suite).
IDS = [1] + list(range(300, 340))                    # 41 tokens
EIGHT = tuple(range(8, 41, 8))                       # 8 x 5, then 1
ONE = (*range(8, 16), *EIGHT[1:])                    # 8, 1 x 8, 8 x 4, then 1


@pytest.fixture(scope="module")
def builtin_model():
    from jaxllm.models.loader import load_model
    return load_model(None)


def test_the_flag_reaches_the_models_linear_maps(builtin_model):
    """native-int16 always; auto where the CPU lacks AVX-512 or has VNNI without AMX (where it
    was measured faster); native and native-int8 never."""
    avx512, vnni = native.cpu_avx512(), native.cpu_vnni_without_amx()
    for mode, int16 in (("native-int16", True), ("auto", not avx512 or vnni), ("native", False),
                        ("native-int8", False)):
        kernels = resolve_config(EngineConfig.from_kwargs(cpu_matmul=mode), builtin_model).step.kernels
        print(f"AVX-512: {avx512}, VNNI without AMX: {vnni}; {mode}: linear maps {kernels.linear}")
        assert kernels.matmul == "native" and kernels.int16_activations == int16, mode
        assert (kernels.linear == "native-int16") == int16, mode


@pytest.mark.slow
def test_builtin_logits_near_float32_activations_and_the_same_bits_in_any_step_shape(builtin_model):
    one = paged_logits(builtin_model, IDS, scan_layers=False, split=ONE, matmul="native-int16", attention="native")
    eight = paged_logits(builtin_model, IDS, scan_layers=False, split=EIGHT, matmul="native-int16",
                         attention="native")
    rows = np.nonzero(np.abs(one - eight).max(-1))[0].tolist()
    print(f"native-int16: positions whose logits differ between the two step shapes: {rows}")
    assert rows == []
    ref = paged_logits(builtin_model, IDS, scan_layers=False, split=EIGHT, matmul="native", attention="native")
    err = np.abs(eight - ref).max(-1)                                   # [T]
    agree = (eight.argmax(-1) == ref.argmax(-1)).mean()
    print(f"int16 vs float32 activations: max |logit difference| {err.max():.3f} (median over positions "
          f"{np.median(err):.3f}; logits up to {np.abs(ref).max():.1f}), argmax equal at {agree:.0%} of {len(IDS)}")
    assert 0 < err.max() < 0.01 * np.abs(ref).max()   # > 0: the rounding reached the kernel
    assert agree == 1.0
