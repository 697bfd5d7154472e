"""One GRPO step on one device and on device meshes; the numbers go to a JSON file for the test.

Run by tests/test_sharding.py in its own process with 8 fake CPU devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_check.py OUT.json \
        --meshes 2,2,2 8,1,1

The step is the trainer's: Sampler rollout (fixed key, G answers per prompt), a deterministic reward,
group advantages, reference log-probs, then two AdamW updates of step_lib.make_update_fn over A=2
micro-batches (the second update sees ratios != 1 and non-zero Adam moments). The single-device run
is the reference; each mesh's run reports how far it lands from it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax

jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tolerances import (ADAM_EPS_FOR_COMPARISONS, FORWARD_REL_ERR, GRAD_REL_ERR,  # noqa: E402
                        adam_weight_atol, normwise_violation)

from grpo_jax.core import advantages as adv_lib
from grpo_jax import config as config_lib
from grpo_jax import model as model_lib
from grpo_jax.distributed import sharding
from grpo_jax.training import optim
from grpo_jax.training import step as step_lib
from grpo_jax.sampling.sampler import Sampler, SamplingConfig  # noqa: E402

# Tiny, but every sharded dimension is exercised: D=32 and F=64 split over fsdp up to 8; N=8 heads
# split over tensor up to 8; K=2 kv heads and V=44 do not divide by tensor=8 (or V by 8 at all), so
# the replication fallback is taken for those weights.
MODEL = model_lib.ModelConfig(vocab_size=44, hidden_size=32, intermediate_size=64, num_layers=2,
                              num_heads=8, num_kv_heads=2, head_dim=8)
EOS, PAD = 1, 0
G = 4  # answers per prompt
# 4 prompts of different lengths (left padding in the sampler); 16 rows = 2 micro-batches of 8.
PROMPTS = [[5, 9, 12], [7, 3, 22, 30, 4], [11, 2], [40, 41, 17, 8]]
SAMPLING = SamplingConfig(max_new_tokens=6, temperature=1.0)
GRPO = config_lib.GRPOSection(prompts_per_step=len(PROMPTS), num_generations=G, beta=0.04,
                              grad_accum_steps=2, eps_low=0.2, eps_high=0.28)
# Adam eps 1e-4 (not 1e-8): the weight comparison below needs it (tests/tolerances.py).
OPTIM = config_lib.OptimSection(learning_rate=1e-2, eps=ADAM_EPS_FOR_COMPARISONS, weight_decay=0.01,
                                max_grad_norm=1.0)
SEED = 3
# Two Adam updates of gradients that agree up to float32 summation order: tests/tolerances.py.
PARAM_ATOL = adam_weight_atol(OPTIM.learning_rate, updates=2)


def reward_fn(tokens_NxC: np.ndarray, mask_NxC: np.ndarray) -> np.ndarray:
    """Fraction of an answer's tokens divisible by 3: deterministic, and differs within groups."""
    hits = ((tokens_NxC % 3 == 0) & (mask_NxC > 0)).sum(axis=1)
    return (hits / np.maximum(mask_NxC.sum(axis=1), 1)).astype(np.float32)


def grpo_step(graphdef, params, opt_state, tx, mesh, rollout_params=None):
    """Rollout, rewards, advantages, reference log-probs, two updates. mesh None: one device."""
    sampler = Sampler(graphdef, MODEL, eos_id=EOS, pad_id=PAD)
    sample = sampler(params if rollout_params is None else rollout_params, PROMPTS, num_samples=G,
                     sampling=SAMPLING, rng=jax.random.key(SEED))
    host = {name: np.asarray(getattr(sample, name)) for name in
            ("prompt_tokens_BxP", "prompt_mask_BxP", "tokens_BxC", "mask_BxC", "logprobs_BxC")}
    rewards = reward_fn(host["tokens_BxC"], host["mask_BxC"])
    advantages = np.asarray(adv_lib.group_advantages(jnp.asarray(rewards), G))
    n, c = host["tokens_BxC"].shape
    rows = {
        "tokens": np.concatenate([host["prompt_tokens_BxP"], host["tokens_BxC"]], axis=1).astype(np.int32),
        "attention": np.concatenate([host["prompt_mask_BxP"], host["mask_BxC"]], axis=1).astype(np.int32),
        "completion_mask": host["mask_BxC"].astype(np.int32),
        "advantages": advantages.astype(np.float32),
        "sampler_logp": host["logprobs_BxC"].astype(np.float32),
    }
    if mesh is not None:  # the rows as global arrays split over ("data", "fsdp")
        rows = sharding.global_batch(mesh, rows, n)
    a = GRPO.grad_accum_steps
    # Meshes take the trainer's choice (each prompt once per group where the groups split evenly
    # over the devices); the one-device reference runs every row with its own prompt copy.
    groups = (1, 1) if mesh is None else step_lib.prompt_groups(GRPO, n // a, sharding.batch_size_multiple(mesh))
    logprob_fn = step_lib.make_logprob_fn(graphdef, SAMPLING.temperature, mesh=mesh, params=params,
                                          group_size=groups[1])
    # Reference = the initial policy (a separate tree; the update donates `params`).
    ref_params = jax.tree.map(jnp.copy, params)
    ref_logp = logprob_fn(ref_params, rows["tokens"], rows["attention"], num_targets=c)
    batch = step_lib.UpdateBatch(
        tokens=rows["tokens"], attention=rows["attention"], completion_mask=rows["completion_mask"],
        advantages=rows["advantages"], old_logp=rows["sampler_logp"], sampler_logp=rows["sampler_logp"],
        ref_logp=ref_logp)
    batch = jax.tree.map(lambda x: jnp.reshape(x, (a, n // a) + x.shape[1:]), batch)
    if mesh is not None:  # [A, M, ...]: rows of each micro-batch over ("data", "fsdp")
        batch = jax.device_put(batch, sharding.batch_sharding(mesh, row_axis=1))
    update = step_lib.make_update_fn(graphdef, tx, GRPO, SAMPLING.temperature, group_size=groups[0])
    if mesh is not None:
        update = sharding.shard_update_fn(update, mesh, params, opt_state)
    metrics = []
    for _ in range(2):
        params, opt_state, m = update(params, opt_state, batch)
        metrics.append({k: float(v) for k, v in m.items()})
    out = {"tokens": host["tokens_BxC"], "mask": host["mask_BxC"], "logprobs": host["logprobs_BxC"],
           "rewards": rewards, "ref_logp": np.asarray(sharding.process_rows(ref_logp)), "prompt_groups": groups}
    return params, opt_state, metrics, out


def _max_violation(a_tree, b_tree, rtol, atol) -> float:
    """max over elements of |a - b| - (atol + rtol |b|): <= 0 iff np.allclose(a, b, rtol, atol)."""
    worst = -np.inf
    for (path, a), b in zip(jax.tree.leaves_with_path(a_tree), jax.tree.leaves(b_tree)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        v = float(np.max(np.abs(a - b) - (atol + rtol * np.abs(b))))
        if v > 0:
            i = np.unravel_index(np.argmax(np.abs(a - b) - (atol + rtol * np.abs(b))), a.shape)
            print("VIOLATION", jax.tree_util.keystr(path), i, a[i], b[i], file=sys.stderr)
        worst = max(worst, v)
    return worst


def _specs_ok(tree, shardings) -> bool:
    return all(x.sharding.is_equivalent_to(s, x.ndim)
               for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--meshes", nargs="*", default=[])
    parser.add_argument("--decode-variant", default="", help="mesh on which to roll out with "
                        "decode_param_shardings too")
    parser.add_argument("--memory", action="store_true", help="also measure bytes per device vs fsdp")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    result: dict = {"device_count": jax.device_count(), "meshes": {}}
    tx, _ = optim.make_optimizer(OPTIM, total_updates=10)

    # Single device: plain arrays on jax.devices()[0].
    # One jitted init (not eager: dozens of tiny compiles); its values are the eager init's.
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: model_lib.init_model(MODEL, 0)))
    params1 = jax.jit(lambda: nnx.split(model_lib.init_model(MODEL, 0))[1])()
    init1 = jax.tree.map(np.asarray, params1)
    p_ref, o_ref, m_ref, out_ref = grpo_step(graphdef, params1, tx.init(params1), tx, None)
    result["reference"] = {"metrics": m_ref, "rewards": out_ref["rewards"].tolist(),
                           "tokens": out_ref["tokens"].tolist(), "seconds": time.perf_counter() - t0}

    for text in args.meshes:
        t1 = time.perf_counter()
        shape = tuple(int(v) for v in text.split(","))
        mesh = sharding.make_mesh(*shape)
        g2, params = sharding.init_params_sharded(mesh, MODEL, 0)
        init_equal = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(init1), jax.tree.leaves(params)))
        init_sharded_ok = _specs_ok(params, sharding.param_shardings(mesh, params))
        opt_state = sharding.init_opt_state_sharded(mesh, tx, params)
        decode = None
        if text == args.decode_variant:
            decode_params = sharding.decode_params(mesh, params)
            decode = grpo_step(g2, jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, opt_state), tx,
                               mesh, rollout_params=decode_params)
        p, o, m, out = grpo_step(g2, params, opt_state, tx, mesh)
        entry = {
            "init_equal": init_equal,
            "init_sharded": init_sharded_ok,
            "tokens_equal": bool(np.array_equal(out["tokens"], out_ref["tokens"])
                                 and np.array_equal(out["mask"], out_ref["mask"])),
            "rollout_logp_violation": _max_violation(out["logprobs"], out_ref["logprobs"], FORWARD_REL_ERR, 1e-6),
            "ref_logp_violation": _max_violation(out["ref_logp"], out_ref["ref_logp"], FORWARD_REL_ERR, 1e-6),
            "rewards": out["rewards"].tolist(),
            "prompt_groups": list(out["prompt_groups"]),
            "metrics": m,
            "params_violation": _max_violation(p, p_ref, 0.0, PARAM_ATOL),
            # Adam's moments: gradient sums, equal to GRAD_REL_ERR norm-wise per leaf.
            "opt_state_violation": max(normwise_violation(a, b, GRAD_REL_ERR)
                                       for a, b in zip(jax.tree.leaves(o), jax.tree.leaves(o_ref))),
            "params_max_abs_change": max(float(np.max(np.abs(np.asarray(a) - b)))
                                         for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(init1))),
            "params_sharded_after": _specs_ok(p, sharding.param_shardings(mesh, p)),
            "opt_state_sharded_after": _specs_ok(o, sharding.opt_state_shardings(mesh, o, p)),
            "seconds": time.perf_counter() - t1,
        }
        if decode is not None:
            entry["decode_specs_ok"] = _specs_ok(decode_params, sharding.decode_param_shardings(mesh, params))
            entry["decode_tokens_equal"] = bool(np.array_equal(decode[3]["tokens"], out_ref["tokens"]))
            entry["decode_params_violation"] = _max_violation(decode[0], p_ref, 0.0, PARAM_ATOL)
        result["meshes"][text] = entry
        print(f"mesh {text}: {entry['seconds']:.1f}s", file=sys.stderr, flush=True)

    if args.memory:
        result["memory"] = measure_memory(params1, tx)
    result["seconds"] = time.perf_counter() - t0
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


def measure_memory(params_host, tx) -> dict:
    """Per-device bytes of params + Adam state for fsdp = 1, 2, 4, 8 (data fills the rest)."""
    rows = {}
    for fsdp in (1, 2, 4, 8):
        mesh = sharding.make_mesh(data=-1, fsdp=fsdp, tensor=1)
        params = sharding.put_sharded(params_host, sharding.param_shardings(mesh, params_host))
        opt_state = sharding.init_opt_state_sharded(mesh, tx, params)
        per_device = sharding.bytes_per_device((params, opt_state))
        # What the table promises: a weight whose spec names fsdp on a dim costs nbytes / fsdp;
        # the others (RMSNorm scales, Adam's step count) are whole on every device.
        expected, whole = 0, sum(x.nbytes for x in jax.tree.leaves(opt_state) if x.ndim == 0)
        for leaf, spec in zip(jax.tree.leaves(params), jax.tree.leaves(
                sharding.param_specs(mesh, params), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))):
            if any(e == "fsdp" for e in tuple(spec)):
                expected += 3 * leaf.nbytes // fsdp  # param + mu + nu
            else:
                whole += 3 * leaf.nbytes
        rows[str(fsdp)] = {"max": max(per_device.values()), "min": min(per_device.values()),
                           "expected": expected + whole, "whole": whole, "num_devices": len(per_device)}
    return rows


if __name__ == "__main__":
    sys.exit(main())
