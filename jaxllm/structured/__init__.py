"""Constrained decoding (structured outputs) with llguidance.

``grammar.py`` turns a request's ``StructuredOutputsParams`` into an llguidance grammar and
compiles it once per distinct grammar (a cache shared by every request); ``matchers.py``
keeps one matcher per request id in the runner, advances it with each accepted token and
fills the allowed-token bitmask rows of a step, which the compiled sampler applies before
the draw (``sample/sampler.py``); ``config.py`` is ``--structured-outputs-config``.
"""
