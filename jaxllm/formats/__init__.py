"""The bottom of the package: array formats and bit-exact recipes that the kernels (``pallas/``,
``cpu/``) and the layers above them must agree on.

* ``storage.py``      bf16 kept as its uint16 bit pattern on CPU
* ``kv_pages.py``     the quantized KV cache's pages (``QuantPages``) and quantize / dequantize
* ``int_weights.py``  weight-only quantized linear weights (``QuantizedLinear``)
* ``gdn_inputs.py``   the gated delta rule's input preparation (every implementation's front end)
* ``numerics.py``     exactly rounded float operations, identical in jnp and numpy
* ``gumbel.py``       the counter-based Gumbel noise of the draw

Every module here imports only jax, numpy (ml_dtypes), the standard library and each other
(``tests/test_layering.py`` checks it), so a kernel can import them without reaching upward.
"""
