"""What the checkpoint fingerprints cost per save (grpo_jax.io.fingerprint, issue 30), on W1's run
state and on Qwen2.5-0.5B's shapes (`check --model-shape qwen2.5-0.5b`). Writes a JSON file.

    .venv/bin/python benchmarks/bench_fingerprint.py [--out benchmarks/results/fingerprint.json]

W1: the real run state (params, Adam state, bf16-or-fp32 reference as the trainer keeps them) built
by `run_context.build`; timed: the fingerprint, and a synchronous `CheckpointManager.save` of the
same tree (which includes the fingerprint). 0.5B: the params' shapes (fp32, 494M values, 1.98 GB)
filled with ones (the sums read every byte whatever the values); the whole run state is params +
Adam mu and nu + the reference, so its cost scales by bytes (the sums are one pass over memory).
Median of 5 calls after one warm-up call (which compiles).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.cli import bench, check as check_command
from grpo_jax.io import fingerprint, hf
from grpo_jax.training import run_context, run_state
from grpo_jax import model as model_lib
from grpo_jax.io.checkpoint import CheckpointManager


def _median_seconds(fn, repeats: int = 5) -> float:
    fn()  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def w1() -> dict:
    config = bench.w1_config(tempfile.mkdtemp(prefix="grpo_fp_"))
    ctx, fresh = run_context.build(config, task=bench.AdditionTask())
    state = run_state.initial_state(ctx, fresh, CheckpointManager(tempfile.mkdtemp()), resume=False)
    tree = run_state._checkpoint_state(ctx, state)
    fp = _median_seconds(lambda: fingerprint.tree_fingerprints(tree))
    saves = []
    for i in range(6):
        ckpt = CheckpointManager(tempfile.mkdtemp(prefix="grpo_fp_ckpt_"), async_save=False)
        t0 = time.perf_counter()
        ckpt.save(i, tree, {"data_position": 0}, force=True)
        ckpt.close()
        saves.append(time.perf_counter() - t0)
    return {"bytes": _nbytes(tree), "leaves": len(jax.tree.leaves(tree)), "fingerprint_s": fp,
            "save_s": statistics.median(saves[1:])}


def qwen05() -> dict:
    shape = check_command.MODEL_SHAPES["qwen2.5-0.5b"]
    model_config = hf.config_from_hf(shape)
    abstract = jax.eval_shape(lambda: nnx.split(model_lib.init_model(model_config, 0))[1])
    params = jax.tree.map(lambda a: jnp.ones(a.shape, a.dtype), abstract)
    fp = _median_seconds(lambda: fingerprint.tree_fingerprints(params))
    n = sum(x.size for x in jax.tree.leaves(params))
    return {"params": n, "bytes": _nbytes(params), "leaves": len(jax.tree.leaves(params)), "fingerprint_s": fp,
            "gb_per_s": _nbytes(params) / fp / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/fingerprint.json")
    args = parser.parse_args()
    result = {"device": jax.devices()[0].device_kind, "w1": w1(), "qwen2.5-0.5b_params": qwen05()}
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
