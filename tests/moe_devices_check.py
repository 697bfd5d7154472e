"""A GRPO run of the tiny Qwen3-MoE fixture (8 experts, top-2) on every device, for
tests/test_qwen3_moe.py:

    python tests/moe_devices_check.py OUT.json RUN_DIR

Mesh fsdp=2 x expert=2 x tensor=2 on 8 devices (everything on data otherwise): each device holds 4
of the 8 experts, half of each one's width and half of its hidden dimension. Writes the metrics
rows, the per-device shape of one expert weight, and how many all-gathers and reduce-scatters over
the expert groups the compiled update has.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from grpo_jax.config import ModelSection  # noqa: E402
from grpo_jax.training import train  # noqa: E402
from test_train import SevensTask, tiny_config  # noqa: E402

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "hf_qwen3_moe"


def main(out: str, run_dir: str) -> None:
    cfg = tiny_config(run_dir)
    mesh = dict(data=1, fsdp=2, expert=2, tensor=2) if jax.device_count() == 8 else dict(data=-1)
    cfg = dataclasses.replace(cfg, model=ModelSection(hf_path=str(FIXTURE), tokenizer="char:0123456789+="),
                              train=dataclasses.replace(cfg.train, steps=3),
                              # Adam's eps above the gradients' rounding noise (tests/tolerances.py, "Adam"): an
                              # expert no token chose has a gradient of ~0 that eps=1e-8 would turn into +-lr.
                              optim=dataclasses.replace(cfg.optim, eps=1e-4),
                              mesh=dataclasses.replace(cfg.mesh, **mesh))
    result = train.run(cfg, task=SevensTask())
    gate = result.params["layers"][0]["mlp"]["expert_gate"]
    with open(out, "w") as f:
        json.dump({"history": result.history, "mesh": mesh,
                   "expert_gate": list(gate.shape), "expert_gate_shard": list(gate.addressable_shards[0].data.shape)},
                  f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
