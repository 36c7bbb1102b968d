"""Speculative decoding: the configuration, the proposers and the per-request controller."""
