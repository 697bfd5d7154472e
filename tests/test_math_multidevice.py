"""The GRPO math on a batch sharded over 8 fake CPU devices gives the single-device numbers.

The 8 devices exist only in a child process (XLA_FLAGS must be set before jax starts, and this
pytest process must keep its single device); tests/multidevice_math_check.py does the checking.
"""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("multidevice_math_check.py")


def test_sharded_batch_matches_single_device():
    # jit with shardings, shard_map and pmap with axis_name: advantages (3 scales), the zero-std
    # fraction, 3 loss variants with every metric and the gradient, and the entropy metric.
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        JAX_PLATFORMS="cpu",
    )
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("OK"), proc.stdout
