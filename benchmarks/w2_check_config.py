"""python -m grpo_jax check --config benchmarks/w2_check_config.py --devices 1

W2 (benchmarks/bench_w2_gpu.py) as a config file, so `check` compiles exactly the run W2 measures:
its update-phase figure is then held against W2's `device_peak_bytes` (benchmarks/gpu_check.sh).
"""

import dataclasses

from grpo_jax.cli import bench
from grpo_jax.config import Config


def get_config() -> Config:
    config = bench.w1_config("/tmp/grpo_w2_check", steps=6, prompts_per_step=16, num_generations=8,
                             max_new_tokens=512, model=bench.W2_MODEL)
    return dataclasses.replace(config, grpo=dataclasses.replace(config.grpo, ref_dtype="bfloat16"))
