"""A LoRA run (rank 4, all-linear) of tests/test_train.py's tiny config on every device, for
tests/test_lora.py:

    python tests/lora_devices_check.py OUT.json RUN_DIR

Mesh data=2 x fsdp=2 x tensor=2 on 8 devices (everything on data otherwise). Writes the metrics
rows and the per-device shape of one adapter pair.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from grpo_jax.training import train
from test_train import SevensTask, tiny_config  # noqa: E402


def main(out: str, run_dir: str) -> None:
    cfg = tiny_config(run_dir)
    mesh = dict(data=2, fsdp=2, tensor=2) if jax.device_count() == 8 else dict(data=-1, fsdp=1, tensor=1)
    cfg = dataclasses.replace(cfg,
                              train=dataclasses.replace(cfg.train, steps=3),
                              mesh=dataclasses.replace(cfg.mesh, **mesh),
                              lora=dataclasses.replace(cfg.lora, r=4))
    result = train.run(cfg, task=SevensTask())
    pair = result.params["layers"]["0"]["attn"]["q_proj"]
    shard = lambda x: list(x.addressable_shards[0].data.shape)  # noqa: E731
    mesh_shape = {k: v for k, v in zip(("data", "fsdp", "tensor"), (2, 2, 2))} if jax.device_count() == 8 else {}
    with open(out, "w") as f:
        json.dump({"history": result.history, "mesh": mesh_shape, "q_proj_lora_a_shard": shard(pair["lora_a"]),
                   "q_proj_lora_b_shard": shard(pair["lora_b"])}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
