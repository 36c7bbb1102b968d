"""On-device sampling inside the compiled step: per-request parameters as arrays.

* ``sampler.py``     the device sampler's pipeline, one call per stage:
* ``processing.py``    bias / suppression / penalties, and the per-request state they read
* ``truncation.py``    temperature, min_p, top-k / top-p as one integer key per row
* ``draw.py``          greedy argmax and the Gumbel-argmax draw (XLA or the Pallas kernel)
* ``logprobs.py``      sampled-token and prompt logprobs (top-k, chosen, rank)
* ``blocked.py``     blocked argmax / top-k / candidate blocks (order-independent reductions)
* ``arrays.py``      the device-side dataclasses: SamplingMetadata, SamplerState, SamplerOutput
* ``metadata.py``    host side: a request's parameters as the per-row arrays of a step
* ``reference.py``   the serial numpy reference the device draw must equal bit for bit, and
                     the sort-based device baseline of the truncation

The noise recipe and the exact float operations they share with the Pallas kernel are
``formats/gumbel.py`` (counter-based noise: (seed, output position, vocabulary index) -> noise)
and ``formats/numerics.py`` (exactly rounded log / exp / fixed-point masses, identical in jnp
and numpy).
"""
