"""Trains the tiny distillation student of tests/test_distillation_train.py for 2 steps on this
process's (fake CPU) devices and writes its metrics rows to OUT.json (run by
tests/test_distillation_train.py::test_eight_devices_match_one_device_with_a_teacher).

    python tests/distillation_devices_check.py OUT.json RUN_DIR TOP_K
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def main(out: str, run_dir: str, top_k: int) -> None:
    from test_train import SevensTask, tiny_config

    from grpo_jax.io import hf
    from grpo_jax.training import train
    from grpo_jax import model as model_lib

    # A random teacher of another shape (width 48, one layer): the layouts are compared, not learning.
    teacher_dir = os.path.join(run_dir, "teacher")
    shape = model_lib.ModelConfig(vocab_size=14, hidden_size=48, intermediate_size=96, num_layers=1, num_heads=2,
                                  num_kv_heads=1, head_dim=16)
    hf.save_model(model_lib.init_model(shape, 7), teacher_dir)
    cfg = tiny_config(os.path.join(run_dir, "run"))
    cfg = dataclasses.replace(
        cfg, grpo=dataclasses.replace(cfg.grpo, beta=0.0, teacher_model_name_or_path=teacher_dir, loss_top_k=top_k),
        train=dataclasses.replace(cfg.train, steps=2, checkpoint_every=0))
    result = train.run(cfg, task=SevensTask())
    with open(out, "w") as f:
        json.dump({"device_count": jax.device_count(), "history": result.history}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
