"""Parallelism flags: bad values are refused with a message naming the flag."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxllm.config import EngineConfig, ParallelConfig


@pytest.mark.parametrize("kwargs,match", [
    (dict(tensor_parallel_size=0), "--tensor-parallel-size must be a positive integer"),
    (dict(data_parallel_size=-1), "--data-parallel-size must be a positive integer"),
    (dict(num_hosts=0), "--num-hosts must be a positive integer"),
    (dict(num_hosts=2, host_index=2), r"--host-index must be an integer in \[0, --num-hosts=2\)"),
    (dict(num_hosts=2, data_parallel_size=2), "--data-parallel-size > 1 with --num-hosts > 1"),
    (dict(distributed_coordinator="nohost"), "--distributed-coordinator must be host:port"),
    (dict(enable_expert_parallel="yes"), "--enable-expert-parallel must be true or false"),
])
def test_bad_values_name_the_flag(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(**kwargs)


def test_more_devices_than_exist_says_how_to_simulate_them():
    from jaxllm.parallel.mesh import replica_devices
    import jax
    n = len(jax.devices())
    with pytest.raises(ValueError, match=rf"needs {2 * (n + 1)} devices, {n} found .*xla_force_host_platform_device_count"):
        replica_devices(n + 1, 2)


def test_cli_refuses_heads_that_do_not_split(tiny_llama):
    """4 attention heads over 3 devices: one line naming the flag, exit status 2."""
    r = subprocess.run([sys.executable, "-m", "jaxllm.cli", "generate", "--model", tiny_llama, "-tp", "3",
                        "--max-model-len", "64", "hi"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "error: --tensor-parallel-size 3 must divide the number of attention heads (4)" in r.stderr
    assert "Traceback" not in r.stderr
