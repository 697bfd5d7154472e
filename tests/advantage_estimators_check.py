"""Sharded-batch check of the advantage estimators and the entropy-control math on 8 fake CPU
devices (run by test_advantage_estimators.py and test_entropy_control.py).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python tests/advantage_estimators_check.py

N = 32 answers in groups of 4, 4 rows per device. Every output must equal the one-device value
(1) under jax.jit on global arrays sharded over the batch axis (no axis_name) and (2) inside
jax.shard_map with axis_name. The per-device shapes of the shard_map program's inputs are checked
too (a number equal on 1 and 8 devices proves the math, not the split). Prints "OK" on success.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from grpo_jax.core import advantage_estimators as est
from grpo_jax.core import entropy_control as ec
from grpo_jax.core.losses import grpo_loss  # noqa: E402

NUM_DEV, N, G, T, K = 8, 32, 4, 6, 3
AXIS = "data"


def make_batch():
    ks = jax.random.split(jax.random.key(0), 7)
    rewards = jax.random.normal(ks[0], (N,)).at[5].set(jnp.nan)
    per_func = jax.random.normal(ks[1], (N, K)).at[7, 1].set(jnp.nan).at[9].set(jnp.nan)
    lengths = jax.random.randint(ks[2], (N,), 0, T + 1)
    mask = jnp.arange(T)[None, :] < lengths[:, None]
    entropy = jax.random.uniform(ks[3], (N, T), minval=0.0, maxval=3.0)
    old = jax.random.uniform(ks[4], (N, T), minval=-3.0, maxval=-0.05)
    logp = old + 0.3 * jax.random.normal(ks[5], (N, T))
    ref = old + 0.2 * jax.random.normal(ks[6], (N, T))
    return dict(rewards=rewards, per_func=per_func, lengths=lengths, mask=mask, entropy=entropy, old=old,
                logp=logp, ref=ref)


def all_outputs(b, axis_name=None):
    out = {
        "rloo": est.rloo_advantages(b["rewards"], G),
        "opo": est.opo_advantages(b["rewards"], b["lengths"], G),
        "rpp": est.reinforce_plus_plus_advantages(b["rewards"], b["lengths"], G, axis_name=axis_name),
        "rpp_baseline": est.reinforce_plus_plus_advantages(b["rewards"], b["lengths"], G, baseline=True,
                                                           axis_name=axis_name),
        "gdpo": est.gdpo_advantages(b["per_func"], G, weights=jnp.array([1.0, 0.5, 2.0]), axis_name=axis_name),
        "passk": est.passk_advantages(b["rewards"], G),
        "threshold": ec.entropy_quantile(b["entropy"], b["mask"], 0.8, axis_name=axis_name),
        "entropy_mask": ec.high_entropy_mask(b["entropy"], b["mask"], 0.2, axis_name=axis_name),
    }
    keep = out["entropy_mask"].astype(jnp.float32)

    def loss_fn(lp, h):
        loss, _ = grpo_loss(lp, b["old"], b["ref"], out["rpp"], b["mask"], beta=0.04, aggregation="token",
                            is_weights=keep, use_bias_correction_kl=True, axis_name=axis_name)
        bonus = ec.entropy_bonus(h, b["mask"], "token", entropy_mask=out["entropy_mask"], axis_name=axis_name)
        return loss - 0.01 * bonus

    out["loss"], (out["grad_logp"], out["grad_entropy"]) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
        b["logp"], b["entropy"])
    return out


def is_per_row(name):
    return name not in ("threshold", "loss")


def compare(name, got, want):
    for key, w in want.items():
        g = np.asarray(got[key]).reshape(np.shape(w))
        if w.dtype == bool:
            np.testing.assert_array_equal(g, w, err_msg=f"{name}: {key}")
        else:
            # Sums of <= 192 float32 terms in another order: 192 u ~ 1e-5 relative.
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6, err_msg=f"{name}: {key}")


def main():
    assert jax.device_count() == NUM_DEV, f"expected {NUM_DEV} devices, got {jax.devices()}"
    batch = make_batch()
    want = jax.tree.map(np.asarray, jax.jit(all_outputs)(batch))
    assert 0 < want["entropy_mask"].sum() < np.asarray(batch["mask"]).sum()  # some kept, some not
    for key in ("rpp", "rpp_baseline", "gdpo"):
        assert np.abs(want[key]).max() > 0.5, key

    # Auto axes, as the trainer's mesh (sharding.make_mesh): XLA places the collectives.
    mesh = jax.make_mesh((NUM_DEV,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = jax.device_put(batch, NamedSharding(mesh, P(AXIS)))
    compare("jit+shardings", jax.jit(all_outputs)(sharded), want)

    out_specs = {k: P(AXIS) if is_per_row(k) else P() for k in want}
    per_device = jax.jit(jax.shard_map(lambda b: all_outputs(b, AXIS), mesh=mesh, in_specs=(P(AXIS),),
                                       out_specs=out_specs))
    compiled = per_device.lower(sharded).compile()
    # Each device holds N / 8 rows of every input: the statistics really are taken across devices.
    for leaf, sh in zip(jax.tree.leaves(sharded), jax.tree.leaves(compiled.input_shardings[0][0])):
        assert sh.shard_shape(leaf.shape)[0] == N // NUM_DEV, (leaf.shape, sh)
    compare("shard_map", per_device(sharded), want)
    print("OK", len(want), "outputs equal on 1 device, jit+shardings and shard_map")


if __name__ == "__main__":
    sys.exit(main())
