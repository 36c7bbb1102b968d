"""The pooling runner: encoders (``Family.pooling``) and converted causal decoders turned into one
vector (or a classifier's logits) per prompt.

``config.py`` (the pooler's and the engine's frozen configs), ``st_folder.py`` (the pooler a
sentence-transformers folder declares), ``pool.py`` (CLS / MEAN / LAST pooling inside the
compiled step), ``runner.py`` (whole prompts packed into ragged buckets, compiled ahead of
time), ``decoder.py`` (which causal decoders convert, ``--hf-overrides``, their weights),
``decoder_runner.py`` (a decoder's prompts as prefill-only requests of a generation engine
core), ``engine.py`` (tokenize, check, embed), ``async_engine.py`` (the server's batching thread), ``heads.py`` (Matryoshka cuts and classifier probabilities on the host), ``params.py``
(vLLM's ``PoolingParams``), ``outputs.py`` (vLLM-shaped outputs).
"""
