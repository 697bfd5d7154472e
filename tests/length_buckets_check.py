"""The length-bucketed update phase against the unbucketed one, on one mesh, for every aggregation.

Used by tests/test_length_buckets.py in its own process (one device) and in a child process with 8
fake CPU devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/length_buckets_check.py OUT.json

The batch: 8 prompts x G=4 = 32 rows, left-padded prompts of 2-5 tokens (shared within a group, so
the unbucketed passes run each prompt once per group, as the trainer does), answers of 0 to 16
tokens from a long tail (one fully masked row, two at the full budget), budget C = 16. Both sides
run the trainer's own code: `trainable.step_functions` builds the programs, `phases.logprobs`
(reference and recomputed pi_old) and `phases.update` run them. The optimizer is plain SGD with
learning rate 1, so params_before - params_after is the gradient the update used. Beside the exact
normaliser, the same chunks run with each chunk's own normaliser (a mean of means, what a
careless split does) to show the comparison can fail.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from compiled_programs import per_device_parameter_shapes  # noqa: E402
from flax import nnx  # noqa: E402
from tolerances import ADAM_EPS_FOR_COMPARISONS, GRAD_REL_ERR, normwise_violation  # noqa: E402

from grpo_jax import config as config_lib
from grpo_jax.training import length_buckets, phases, trainable
from grpo_jax.core import losses
from grpo_jax.distributed import sharding
from grpo_jax import model as model_lib
from grpo_jax.training import step as step_lib
from grpo_jax.training.policy import Policy  # noqa: E402
from grpo_jax.training.run_context import RunState  # noqa: E402

MODEL = model_lib.ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=1,
                              num_heads=4, num_kv_heads=2, head_dim=8)
N, G, P, C = 8, 4, 5, 16
B = N * G
AGGREGATIONS = ("token", "sequence", "constant")
LEARNING_RATE = 1e-3  # AdamW runs (compare_minibatches): each step moves a weight by ~1e-3
# Answer lengths, row by row: a long tail (most short, a few at the budget), one row with no token
# the loss reads (e.g. truncated under mask_truncated_completions).
LENGTHS = np.array([3, 1, 16, 2, 5, 4, 2, 9, 1, 3, 0, 6, 2, 12, 3, 1,
                    4, 2, 7, 16, 1, 3, 2, 5, 10, 2, 1, 4, 3, 2, 6, 1])


def grpo_section(aggregation: str, bucket: str, **kw) -> config_lib.GRPOSection:
    return config_lib.GRPOSection(prompts_per_step=N, num_generations=G, beta=0.04, aggregation=aggregation,
                                  eps_high=0.28, bucket_by_length=bucket, **kw)


def model():
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: model_lib.init_model(MODEL, 0)))
    params = jax.jit(lambda: nnx.split(model_lib.init_model(MODEL, 0))[1])()
    return graphdef, params


def host_rows() -> dict[str, np.ndarray]:
    """The step's rows as `phases.device_rows` gets them (host numpy)."""
    rng = np.random.default_rng(0)
    prompt = np.repeat(rng.integers(2, MODEL.vocab_size, (N, P)), G, axis=0)
    prompt_len = np.repeat(rng.integers(2, P + 1, N), G)
    answers = rng.integers(2, MODEL.vocab_size, (B, C))
    mask = (np.arange(C)[None] < LENGTHS[:, None]).astype(np.int32)
    prompt_mask = (np.arange(P)[None] >= P - prompt_len[:, None]).astype(np.int32)
    rewards = rng.random((N, G))
    adv = ((rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-4)).reshape(B)
    return {"tokens": np.concatenate([prompt * prompt_mask, answers * mask], axis=1).astype(np.int32),
            "attention": np.concatenate([prompt_mask, mask], axis=1),
            "completion_mask": mask, "advantages": adv.astype(np.float32),
            "sampler_logp": (-np.log(MODEL.vocab_size) + 0.1 * rng.standard_normal((B, C))).astype(np.float32)}


def context(grpo, mesh, graphdef, params, tx, opt_state):
    """The parts of a RunContext the log-prob and update phases read, built as `run_context.build` does."""
    update_fn, logprob_fn, bucketing = trainable.step_functions(grpo, 1.0, graphdef, tx, mesh=mesh,
                                                                  params=params, opt_state=opt_state)
    # pi_old recomputed by a pass of its own, so the log-prob phase runs it (bucketed or not).
    config = config_lib.Config(grpo=grpo, train=config_lib.TrainSection(seed=0),
                               off_policy=config_lib.OffPolicySection(old_logprobs="recompute"))
    return types.SimpleNamespace(config=config, mesh=mesh, update_fn=update_fn, logprob_fn=logprob_fn,
                                 bucketing=bucketing, uses_reference=True, processes=None, policy=Policy(),
                                 policy_params=lambda state: state.params,
                                 reference_params=lambda state: state.ref_params)


def device_rows(mesh, host: dict) -> dict:
    rows = jax.device_put(host, sharding.batch_sharding(mesh))
    rows["completion_lengths"] = length_buckets.needed_lengths(host["completion_mask"])
    return rows


def update_phase(grpo, mesh, graphdef, params, tx, host) -> dict:
    """phases.logprobs then phases.update of the batch: (params after, per-update metrics, log-probs)."""
    params = sharding.put_sharded(params, sharding.param_shardings(mesh, params))
    opt_state = tx.init(params)
    ctx = context(grpo, mesh, graphdef, params, tx, opt_state)
    ref = step_lib.frozen_copy(params, jnp.float32)
    state = RunState(step=0, data_position=0, params=jax.tree.map(jnp.copy, params), opt_state=opt_state,
                     ref_params=ref)
    rows = device_rows(mesh, host)
    ref_logp, old_logp, logprobs_ready = phases.logprobs(ctx, state, rows)
    ref_np, old_np = np.asarray(ref_logp), np.asarray(old_logp)
    state, metrics, update_ready = phases.update(ctx, state, rows, ref_logp, old_logp, 1)
    logprobs_ready.time(), update_ready.time()
    return {"params": jax.tree.map(np.asarray, state.params), "ref_logp": ref_np, "old_logp": old_np,
            "metrics": [{k: float(v) for k, v in m.items()} for m in metrics], "ctx": ctx}


def chunked_gradient(ctx, params, host, mesh, *, own_normalizer: bool):
    """The gradient summed over the bucketed chunks: each chunk over the batch's normaliser (the
    driver's, right), or over its own (`own_normalizer`: the mean of means the split must not do)."""
    fns, rows = ctx.bucketing.update, device_rows(mesh, host)
    aggregation = ctx.config.grpo.resolved_aggregation()
    params = sharding.put_sharded(params, sharding.param_shardings(mesh, params))
    full = step_lib.UpdateBatch(tokens=rows["tokens"], attention=rows["attention"],
                                completion_mask=rows["completion_mask"], advantages=rows["advantages"],
                                old_logp=rows["sampler_logp"], sampler_logp=rows["sampler_logp"],
                                ref_logp=rows["sampler_logp"])
    chunks = ctx.bucketing.update_chunks(rows["completion_lengths"], np.arange(B), prompt_len=P, max_len=C)
    batch_normalizer = losses.loss_normalizer(jnp.asarray(host["completion_mask"]), aggregation, max_len=C)
    grads = fns.zeros(params)
    for chunk in chunks:
        mb = length_buckets.take(full, chunk, C, mesh)
        normalizer = losses.loss_normalizer(mb.completion_mask, aggregation, max_len=C) if own_normalizer \
            else batch_normalizer
        grads, _, _ = fns.accumulate(params, grads, mb, normalizer, 1.0)  # router_tokens: dense model, unused
    return jax.tree.map(np.asarray, grads), chunks


def relative_difference(a_tree, b_tree) -> float:
    num = sum(np.sum((np.asarray(a, np.float64) - b) ** 2) for a, b in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree)))
    den = sum(np.sum(np.asarray(b, np.float64) ** 2) for b in jax.tree.leaves(b_tree))
    return float(np.sqrt(num / den))


def worst(a_tree, b_tree, rel) -> float:
    return max(normwise_violation(a, b, rel) for a, b in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree)))


def compare(mesh, aggregation: str, graphdef, params) -> dict:
    """Bucketed ("on") against unbucketed ("off") on `mesh`, one SGD update of the whole batch:
    the gradient (violation of the GRAD_REL_ERR norm-wise bound, <= 0 passes), every metric, the
    log-probs where the loss reads them, and the mean of means beside them."""
    host, tx = host_rows(), optax.sgd(1.0)
    before = jax.tree.map(np.asarray, params)
    off = update_phase(grpo_section(aggregation, "off"), mesh, graphdef, params, tx, host)
    on = update_phase(grpo_section(aggregation, "on"), mesh, graphdef, params, tx, host)
    grad_off = jax.tree.map(lambda a, b: a - b, before, off["params"])
    grad_on = jax.tree.map(lambda a, b: a - b, before, on["params"])
    real = host["completion_mask"] != 0
    wrong, chunks = chunked_gradient(on["ctx"], params, host, mesh, own_normalizer=True)
    right, _ = chunked_gradient(on["ctx"], params, host, mesh, own_normalizer=False)
    # The bucketed log-prob pass computes each row's first L columns (L: its chunk's rung) and
    # writes nothing beyond them.
    chunk_length = np.zeros(B, int)
    for chunk in on["ctx"].bucketing.logprob_chunks(length_buckets.needed_lengths(host["completion_mask"]),
                                                    prompt_len=P, max_len=C):
        chunk_length[chunk.rows] = chunk.length
    beyond = np.arange(C)[None] >= chunk_length[:, None]
    return {
        "grad_violation": worst(grad_on, grad_off, GRAD_REL_ERR),
        "grad_relative_difference": relative_difference(grad_on, grad_off),
        "metrics_on": on["metrics"], "metrics_off": off["metrics"],
        "ref_logp_on": on["ref_logp"][real].tolist(), "ref_logp_off": off["ref_logp"][real].tolist(),
        "old_logp_on": on["old_logp"][real].tolist(), "old_logp_off": off["old_logp"][real].tolist(),
        "logp_beyond_lengths_on": np.abs(on["ref_logp"][beyond]).max(initial=0.0).item(),
        # What the unbucketed passes ran: each prompt once per group (update, log-probs).
        "groups_off": list(step_lib.prompt_groups(grpo_section(aggregation, "off"), B, sharding.batch_size_multiple(mesh))),
        "chunk_shapes": [[len(c.rows), c.length] for c in chunks],
        "mean_of_means_relative_difference": relative_difference(wrong, right),
    }


def compare_minibatches(mesh, aggregation: str, graphdef, params) -> dict:
    """mu = 2 passes x 2 minibatches (rows in TRL's random order) x 2 micro-batches, AdamW: 4
    updates each way; the bucketed side cuts each minibatch's 16 rows into its own chunks."""
    host = host_rows()
    tx = optax.adam(LEARNING_RATE, eps=ADAM_EPS_FOR_COMPARISONS)
    kw = dict(num_minibatches=2, num_iterations=2, grad_accum_steps=2)
    off = update_phase(grpo_section(aggregation, "off", **kw), mesh, graphdef, params, tx, host)
    on = update_phase(grpo_section(aggregation, "on", **kw), mesh, graphdef, params, tx, host)
    return {"params_max_abs_difference": max(float(np.max(np.abs(a - b))) for a, b in
                                             zip(jax.tree.leaves(on["params"]), jax.tree.leaves(off["params"]))),
            "params_moved": max(float(np.max(np.abs(a - np.asarray(b)))) for a, b in
                                zip(jax.tree.leaves(on["params"]), jax.tree.leaves(params))),
            "metrics_on": on["metrics"], "metrics_off": off["metrics"],
            "bucketed": [on["ctx"].bucketing.rows, on["ctx"].bucketing.mode]}


def per_device_chunk_shapes(mesh, graphdef, params) -> dict:
    """Rows each device's compiled bucketed programs take (first chunk), read from their HLO."""
    host, tx = host_rows(), optax.sgd(1.0)
    params = sharding.put_sharded(params, sharding.param_shardings(mesh, params))
    ctx = context(grpo_section("token", "on"), mesh, graphdef, params, tx, tx.init(params))
    rows = device_rows(mesh, host)
    full = step_lib.UpdateBatch(tokens=rows["tokens"], attention=rows["attention"],
                                completion_mask=rows["completion_mask"], advantages=rows["advantages"],
                                old_logp=rows["sampler_logp"], sampler_logp=rows["sampler_logp"],
                                ref_logp=rows["sampler_logp"])
    chunk = ctx.bucketing.update_chunks(rows["completion_lengths"], np.arange(B), prompt_len=P, max_len=C)[-1]
    mb = length_buckets.take(full, chunk, C, mesh)
    update = ctx.bucketing.update.accumulate.lower(params, ctx.bucketing.update.zeros(params), mb,
                                                   jnp.float32(1.0), jnp.float32(1.0)).compile()  # normaliser, router tokens
    lp = ctx.bucketing.logprob_fn.jitted.lower(params, mb.tokens, mb.attention, chunk.length).compile()
    u, l = per_device_parameter_shapes(update), per_device_parameter_shapes(lp)
    return {"chunk": [len(chunk.rows), chunk.length],
            "update_tokens": [s for p, s in u.items() if p.endswith("tokens")],
            "update_advantages": [s for p, s in u.items() if p.endswith("advantages")],
            "logprob_tokens": [s for p, s in l.items() if p.endswith("tokens")]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    args = parser.parse_args(argv)
    graphdef, params = model()
    result = {"device_count": jax.device_count(), "meshes": {}}
    shapes = [("1", (1, 1, 1))] if jax.device_count() == 1 else [("data=8", (8, 1, 1)), ("data=2 fsdp=4", (2, 4, 1))]
    for name, shape in shapes:
        mesh = sharding.make_mesh(*shape)
        result["meshes"][name] = {agg: compare(mesh, agg, graphdef, params) for agg in AGGREGATIONS}
        result["meshes"][name]["minibatches"] = {agg: compare_minibatches(mesh, agg, graphdef, params)
                                                 for agg in AGGREGATIONS}
        if jax.device_count() > 1:
            result["meshes"][name]["per_device"] = per_device_chunk_shapes(mesh, graphdef, params)
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
