"""Shared test set-up: CPU only, float32 matmuls at full precision so closed forms compare tightly.

Settings go through environment variables so subprocesses that tests start (multi-device checks,
kill -9 / resume runs) compute with exactly the same numerics as the test process. A persistent
compilation cache shared by all of them keeps repeated compiles of the same tiny programs cheap.
"""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "grpo_jax_test_xla_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
