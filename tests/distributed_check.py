"""One process of a two-process GRPO update on the CPU backend, joined by jax.distributed.

Run by tests/test_sharding.py, twice at once (process ids 0 and 1), each with 2 fake CPU devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/distributed_check.py \
        --process-id 0 --num-processes 2 --port 12345 OUT0.json

Together the processes form a 4-device mesh (data=2 across the processes, fsdp=2 within each).
Each process builds only its own rows of the batch (sharding.host_slice), the global batch is
assembled with sharding.global_batch, and two sharded AdamW updates run. Every process also runs
the same two updates on the whole batch on one of its own devices; the gathered sharded params
must match that, and both processes must report the same numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

T0 = time.perf_counter()


def _log(what: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {what}", file=sys.stderr, flush=True)

import jax

jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tolerances import adam_weight_atol  # noqa: E402

from grpo_jax import config as config_lib
from grpo_jax import model as model_lib
from grpo_jax.distributed import sharding

MODEL = model_lib.ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=1,
                              num_heads=4, num_kv_heads=2, head_dim=8)
GRPO = config_lib.GRPOSection(prompts_per_step=4, num_generations=4, beta=0.04, grad_accum_steps=2)
OPTIM = config_lib.OptimSection(learning_rate=1e-2, eps=1e-4, max_grad_norm=1.0)
A, M, P, C = 2, 8, 5, 6  # micro-batches, rows per micro-batch, prompt width, completion width
# Two Adam updates (eps 1e-4) of gradients equal up to float32 summation order: tests/tolerances.py.
PARAM_ATOL = adam_weight_atol(OPTIM.learning_rate, updates=2)


def synthetic_batch() -> dict[str, np.ndarray]:
    """A fixed [A, M, ...] batch: left-padded prompts, answers of 2..6 tokens, log-probs near the
    policy's (ratios around 1, some clipped)."""
    rng = np.random.default_rng(0)
    n = A * M
    tokens = rng.integers(2, MODEL.vocab_size, (n, P + C)).astype(np.int32)
    prompt_len = rng.integers(2, P + 1, n)
    answer_len = rng.integers(2, C + 1, n)
    attention = np.zeros((n, P + C), np.int32)
    for i in range(n):
        attention[i, P - prompt_len[i]:P + answer_len[i]] = 1
    rewards = rng.random(n).astype(np.float32)
    adv = (rewards.reshape(-1, 4) - rewards.reshape(-1, 4).mean(1, keepdims=True)).reshape(n)
    old = (-3.0 + 0.1 * rng.standard_normal((n, C))).astype(np.float32)
    batch = {"tokens": tokens, "attention": attention, "completion_mask": attention[:, P:].copy(),
             "advantages": adv.astype(np.float32), "old_logp": old, "sampler_logp": old,
             "ref_logp": (old + 0.05 * rng.standard_normal((n, C))).astype(np.float32)}
    return {k: v.reshape((A, M) + v.shape[1:]) for k, v in batch.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)

    joined = sharding.initialize_distributed(f"localhost:{args.port}", args.num_processes, args.process_id)
    _log("joined")
    from grpo_jax.training import optim
    from grpo_jax.training import step as step_lib

    result = {"joined": joined, "process_index": jax.process_index(), "process_count": jax.process_count(),
              "device_count": jax.device_count(), "local_device_count": jax.local_device_count()}
    tx, _ = optim.make_optimizer(OPTIM, total_updates=10)
    update = step_lib.make_update_fn
    full = synthetic_batch()

    # Sharded: the global mesh, this process's rows only.
    mesh = sharding.make_mesh(data=-1, fsdp=2, tensor=1)
    rows = sharding.host_slice(M, mesh)
    result["rows"] = [rows.start, rows.stop]
    graphdef, params = sharding.init_params_sharded(mesh, MODEL, 0)
    from jax.experimental import multihost_utils

    init_gathered = jax.tree.map(np.asarray, multihost_utils.process_allgather(params, tiled=True))
    opt_state = sharding.init_opt_state_sharded(mesh, tx, params)
    local = {k: v[:, rows] for k, v in full.items()}
    batch = step_lib.UpdateBatch(**sharding.global_batch(mesh, local, M, row_axis=1))
    # The inverse: this process's rows back out of the global (not fully addressable) array.
    result["process_rows_ok"] = bool(np.array_equal(sharding.process_rows(batch.tokens, row_axis=1),
                                                    local["tokens"]))
    step = sharding.shard_update_fn(update(graphdef, tx, GRPO, 1.0), mesh, params, opt_state)
    metrics = []
    for _ in range(2):
        params, opt_state, m = step(params, opt_state, batch)
        metrics.append({k: float(v) for k, v in m.items()})  # replicated: readable on every host

    _log("sharded updates done")

    gathered = jax.tree.map(np.asarray, multihost_utils.process_allgather(params, tiled=True))
    # Every host's per-row values gathered (how host-side metrics such as rewards are reduced),
    # and bytes per device, before this process's share of the work ends.
    gathered_rows = sharding.allgather_rows(np.arange(rows.start, rows.stop)).tolist()
    local_bytes = sorted(sharding.bytes_per_device((params, opt_state)).values())
    # Reference (process 0): the whole batch on one of its own devices. Process 1 is compared with
    # process 0 through the checksum of the gathered params.
    ref_metrics, worst = None, None
    if jax.process_index() == 0:
        params1 = jax.jit(lambda: nnx.split(model_lib.init_model(MODEL, 0))[1])()
        result["init_equal"] = all(np.array_equal(np.asarray(a), b) for a, b in
                                   zip(jax.tree.leaves(params1), jax.tree.leaves(init_gathered)))
        opt1 = tx.init(params1)
        ref_update = update(graphdef, tx, GRPO, 1.0)
        batch1 = step_lib.UpdateBatch(**{k: jnp.asarray(v) for k, v in full.items()})
        ref_metrics = []
        for _ in range(2):
            params1, opt1, m = ref_update(params1, opt1, batch1)
            ref_metrics.append({k: float(v) for k, v in m.items()})
        worst = -np.inf
        for a, b in zip(jax.tree.leaves(gathered), jax.tree.leaves(params1)):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            worst = max(worst, float(np.max(np.abs(a - b) - PARAM_ATOL)))
        _log("one-device reference done")
    result.update(
        metrics=metrics, ref_metrics=ref_metrics, params_violation=worst,
        params_checksum=float(sum(np.sum(np.asarray(x, np.float64)) for x in jax.tree.leaves(gathered))),
        params_changed=max(float(np.max(np.abs(a - b)))
                           for a, b in zip(jax.tree.leaves(gathered), jax.tree.leaves(init_gathered))),
        gathered_rows=gathered_rows, bytes_per_local_device=local_bytes,
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
