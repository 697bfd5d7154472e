"""python -m grpo_jax train --config configs/arith_cpu_lora.py

The CPU demo (configs/arith_cpu.py) with LoRA: the same SFT warm-up trains every weight (it
becomes the frozen base, and the reference), then GRPO trains rank-16 adapters on every linear
layer (q/k/v/o, gate/up/down) and nothing else. LoRA wants a larger learning rate than full
fine-tuning (the adapters start at 0 and move the weights through alpha / r * A @ B).
"""

import dataclasses
import os

from grpo_jax.config import load_config_file


def get_config():
    cfg = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "arith_cpu.py"))
    return dataclasses.replace(
        cfg,
        optim=dataclasses.replace(cfg.optim, learning_rate=1e-3),
        train=dataclasses.replace(cfg.train, run_dir="runs/arith_cpu_lora"),
        lora=dataclasses.replace(cfg.lora, r=16, alpha=32.0, target_modules=("all-linear",)),
    )
