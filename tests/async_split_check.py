"""An asynchronous run (off_policy.max_staleness=1) of tests/test_train.py's tiny config, for
tests/test_off_policy.py:

    python tests/async_split_check.py OUT.json RUN_DIR ROLLOUT_DEVICES

With ROLLOUT_DEVICES > 0 the last that-many devices sample and the rest train (mesh.data over
them). Writes the metrics rows and where the arrays lived: the trainer's weights, the sampler's
snapshot, and the per-device rows of the sampler's output and of the update's micro-batches.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from grpo_jax.training import async_rollouts, rollout, train
from grpo_jax.training import step as step_lib
from test_train import SevensTask, tiny_config  # noqa: E402


def _devices(x) -> list[int]:
    return sorted(d.id for d in x.sharding.device_set)


def main(out: str, run_dir: str, rollout_devices: int) -> None:
    cfg = tiny_config(run_dir)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=4),
                              off_policy=dataclasses.replace(cfg.off_policy, max_staleness=1, rollout_devices=rollout_devices))
    seen: dict = {}

    dispatch = rollout.dispatch_rollout

    def recording_dispatch(*args, **kwargs):
        pending = dispatch(*args, **kwargs)
        tokens = pending.sample.tokens_BxC
        seen.update(sampler_rows=tokens.shape[0], sampler_rows_per_device=tokens.addressable_shards[0].data.shape[0],
                    sampler_devices=_devices(tokens))
        return pending

    minibatch = step_lib.minibatch

    def recording_minibatch(*args, **kwargs):
        batch = minibatch(*args, **kwargs)
        seen.update(update_rows=batch.tokens.shape[1],
                    update_rows_per_device=batch.tokens.addressable_shards[0].data.shape[1])
        return batch

    published = async_rollouts.AsyncBatches.published

    def recording_published(self, state, update_metrics):
        state = published(self, state, update_metrics)
        seen.update(param_devices=_devices(jax.tree.leaves(state.params)[0]),
                    snapshot_devices=_devices(jax.tree.leaves(state.rollout_params[0])[0]))
        return state

    rollout.dispatch_rollout = recording_dispatch
    step_lib.minibatch = recording_minibatch
    async_rollouts.AsyncBatches.published = recording_published
    result = train.run(cfg, task=SevensTask())
    with open(out, "w") as f:
        json.dump({"history": result.history, "device_count": jax.device_count(), **seen}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
