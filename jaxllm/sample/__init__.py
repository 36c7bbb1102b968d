"""On-device sampling inside the compiled step: per-request parameters as arrays.

* ``sampler.py``    the device sampler (processing, truncation, the Gumbel-argmax draw,
                    logprobs) and its per-request state (penalty counts, bias rows)
* ``gumbel.py``     counter-based noise: (seed, output position, vocabulary index) -> noise
* ``numerics.py``   exactly rounded log / exp / fixed-point masses, identical in jnp and numpy
* ``metadata.py``   host side: a request's parameters as the per-row arrays of a step
* ``reference.py``  the serial numpy reference the device draw must equal bit for bit
"""
