"""Gradient accumulation and data parallelism give the full-batch gradient, for every aggregation.

Run by tests/test_update_exactness.py, once in a plain process (one device) and once with 8 fake
CPU devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/update_exactness_check.py OUT.json

One GRPO update (`step.make_update_fn`) of a fixed 16-row batch whose answers have very different
lengths (sorted, so micro-batches hold 1-2 tokens per answer at one end and 8 at the other): the
case where a mean of per-micro-batch token means is furthest from the token mean. The optimizer is
plain SGD with learning rate 1, so params_before - params_after is the gradient the update used
(after the same global-norm clipping, which is off here). Each cut of the batch - A micro-batches,
rows over a mesh, both - is compared with the uncut batch on one device; the old mean of means is
computed beside it to show the comparison can fail. The compiled update and log-prob programs'
per-device row counts are read from their HLO.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from compiled_programs import per_device_parameter_shapes  # noqa: E402
from flax import nnx  # noqa: E402
from tolerances import GRAD_REL_ERR, normwise_violation  # noqa: E402

from grpo_jax import config as config_lib
from grpo_jax.core import losses
from grpo_jax import model as model_lib
from grpo_jax.distributed import sharding
from grpo_jax.training import step as step_lib

MODEL = model_lib.ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=1,
                              num_heads=4, num_kv_heads=2, head_dim=8)
B, P, C, G = 16, 5, 8, 4
AGGREGATIONS = ("sequence", "token", "constant")


def synthetic_rows() -> dict[str, np.ndarray]:
    """16 rows: left-padded prompts, answers of 1..8 tokens sorted short to long, log-probs near
    the policy's (ratios around 1), standardised advantages per group of 4."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, MODEL.vocab_size, (B, P + C)).astype(np.int32)
    prompt_len = rng.integers(2, P + 1, B)
    answer_len = np.sort(rng.integers(1, C + 1, B))
    answer_len[:4], answer_len[-4:] = 1, C  # the first micro-batch short, the last full
    attention = np.zeros((B, P + C), np.int32)
    for i in range(B):
        attention[i, P - prompt_len[i] : P + answer_len[i]] = 1
    rewards = rng.random(B).astype(np.float32).reshape(-1, G)
    adv = ((rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-4)).reshape(B)
    old = (-3.0 + 0.1 * rng.standard_normal((B, C))).astype(np.float32)
    return {"tokens": tokens, "attention": attention, "completion_mask": attention[:, P:].copy(),
            "advantages": adv.astype(np.float32), "old_logp": old, "sampler_logp": old,
            "ref_logp": (old + 0.05 * rng.standard_normal((B, C))).astype(np.float32)}


def as_batch(rows: dict[str, np.ndarray], num_micro: int) -> step_lib.UpdateBatch:
    return step_lib.UpdateBatch(**{k: jnp.asarray(v.reshape((num_micro, -1) + v.shape[1:])) for k, v in rows.items()})


def grpo_section(aggregation: str, num_micro: int) -> config_lib.GRPOSection:
    return config_lib.GRPOSection(prompts_per_step=B // G, num_generations=G, beta=0.04, aggregation=aggregation,
                                  grad_accum_steps=num_micro, eps_high=0.28)


def gradient(graphdef, params, rows, aggregation, num_micro, mesh=None) -> tuple[dict, dict]:
    """(gradient as a host tree, metrics) of one update; mesh: rows over (data, fsdp)."""
    tx = optax.sgd(1.0)
    update = step_lib.make_update_fn(graphdef, tx, grpo_section(aggregation, num_micro), 1.0)
    before = jax.tree.map(np.asarray, params)
    batch = as_batch(rows, num_micro)
    opt_state = tx.init(params)
    if mesh is not None:
        update = sharding.shard_update_fn(update, mesh, params, opt_state)
        batch = jax.device_put(batch, sharding.batch_sharding(mesh, row_axis=1))
    after, _, metrics = update(jax.tree.map(jnp.copy, params), opt_state, batch)
    grads = jax.tree.map(lambda a, b: a - np.asarray(b), before, after)
    return grads, {k: float(v) for k, v in metrics.items()}


def mean_of_means_gradient(graphdef, params, rows, aggregation, num_micro):
    """What the update did before: each micro-batch normalised by its own tokens, then averaged."""
    batch = as_batch(rows, num_micro)

    def loss(p):
        total = 0.0
        for a in range(num_micro):
            mb = jax.tree.map(lambda x: x[a], batch)
            logp = model_lib.token_logprobs(graphdef, p, mb.tokens, mb.attention, num_targets=C)
            total += losses.grpo_loss(logp, mb.old_logp, mb.ref_logp, mb.advantages, mb.completion_mask,
                                      beta=0.04, aggregation=aggregation, max_len=C, eps_high=0.28,
                                      use_bias_correction_kl=grpo_section(aggregation, 1).use_bias_correction_kl)[0]
        return total / num_micro

    return jax.tree.map(np.asarray, jax.grad(loss)(params))


def worst(a_tree, b_tree) -> float:
    return max(normwise_violation(a, b, GRAD_REL_ERR) for a, b in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree)))


def relative_difference(a_tree, b_tree) -> float:
    num = np.sqrt(sum(np.sum((np.asarray(a) - np.asarray(b)) ** 2) for a, b in zip(jax.tree.leaves(a_tree),
                                                                                  jax.tree.leaves(b_tree))))
    den = np.sqrt(sum(np.sum(np.asarray(b) ** 2) for b in jax.tree.leaves(b_tree)))
    return float(num / den)


def per_device_rows(graphdef, params, rows, mesh, num_micro) -> dict:
    """Rows each device's compiled update and log-prob programs take, read from their HLO."""
    tx = optax.sgd(1.0)
    opt_state = tx.init(params)
    update = sharding.shard_update_fn(step_lib.make_update_fn(graphdef, tx, grpo_section("token", num_micro), 1.0),
                                      mesh, params, opt_state)
    batch = jax.device_put(as_batch(rows, num_micro), sharding.batch_sharding(mesh, row_axis=1))
    update_shapes = per_device_parameter_shapes(update.lower(params, opt_state, batch).compile())
    logprob_fn = step_lib.make_logprob_fn(graphdef, 1.0, mesh=mesh, params=params)
    tokens = jnp.asarray(rows["tokens"])
    lp_shapes = per_device_parameter_shapes(logprob_fn.jitted.lower(params, tokens, jnp.asarray(rows["attention"]),
                                                                     C).compile())
    return {
        "update_tokens": [shape for path, shape in update_shapes.items() if path.endswith("tokens")],
        "update_advantages": [shape for path, shape in update_shapes.items() if path.endswith("advantages")],
        "logprob_tokens": [shape for path, shape in lp_shapes.items() if path.endswith("tokens")],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    args = parser.parse_args(argv)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: model_lib.init_model(MODEL, 0)))
    params = jax.jit(lambda: nnx.split(model_lib.init_model(MODEL, 0))[1])()
    rows = synthetic_rows()
    result: dict = {"device_count": jax.device_count(), "aggregations": {}}
    for aggregation in AGGREGATIONS:
        full, full_metrics = gradient(graphdef, params, rows, aggregation, 1)
        entry = {"grad_norm_full": full_metrics["grad_norm"], "cuts": {}}
        cuts = [("A=4", 4, None), ("A=2", 2, None)]
        if jax.device_count() == 8:
            cuts += [("A=2 on data=8", 2, (8, 1, 1)), ("A=1 on data=8", 1, (8, 1, 1)),
                     ("A=2 on data=2 fsdp=4", 2, (2, 4, 1)), ("A=4 on data=2 fsdp=2 tensor=2", 4, (2, 2, 2))]
        for name, num_micro, shape in cuts:
            mesh = None if shape is None else sharding.make_mesh(*shape)
            p = params if mesh is None else sharding.put_sharded(params, sharding.param_shardings(mesh, params))
            grads, metrics = gradient(graphdef, p, rows, aggregation, num_micro, mesh)
            entry["cuts"][name] = {"violation": worst(grads, full), "relative_difference": relative_difference(grads, full),
                                   "grad_norm": metrics["grad_norm"], "loss": metrics["loss"],
                                   "loss_full": full_metrics["loss"], "kl": metrics["kl"], "kl_full": full_metrics["kl"],
                                   "num_tokens": metrics["num_tokens"], "num_tokens_full": full_metrics["num_tokens"]}
        old = mean_of_means_gradient(graphdef, params, rows, aggregation, 4)
        entry["mean_of_means_A=4_relative_difference"] = relative_difference(old, full)
        result["aggregations"][aggregation] = entry
    if jax.device_count() == 8:
        result["per_device_rows"] = {
            "data=8, A=2": per_device_rows(graphdef, params, rows, sharding.make_mesh(8, 1, 1), 2),
            "data=2 fsdp=4, A=1": per_device_rows(graphdef, params, rows, sharding.make_mesh(2, 4, 1), 1),
            "tensor=8, A=1": per_device_rows(graphdef, params, rows, sharding.make_mesh(1, 1, 8), 1),
        }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
