"""What the tests share and are not tests themselves: tiny checkpoints, engine settings,
server and sampler harnesses, numeric bounds, and the probes that run in their own process.

Imported one way everywhere, as ``support.<module>``: tests/conftest.py puts tests/ (and the
repository root) on ``sys.path`` once; a probe runs as ``python -m support.<name>`` with the
same path (support/probes.py).
"""
