"""jaxllm's benchmarks: ``jaxllm bench serve|throughput|latency`` (see bench/cli.py) and the
standalone scripts beside them (throughput.py, sampler.py, compare.py, device_check.py);
harness.py is the timing harness they share."""
