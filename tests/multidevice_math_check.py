"""Sharded-batch check of the GRPO math on 8 fake CPU devices (run by test_math_multidevice.py).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python tests/multidevice_math_check.py

The batch axis (N = 32 answers, groups of 4, so one group per device) is split over 8 devices.
Every function must give the single-device numbers (1) through `jax.jit` with shardings (no
axis_name: global arrays), (2) inside `jax.shard_map` with axis_name, (3) inside `jax.pmap` with
axis_name. Prints "OK" and exits 0 on success; raises on the first mismatch.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from grpo_jax.core.advantages import group_advantages, zero_std_fraction  # noqa: E402
from grpo_jax.core.losses import grpo_loss, token_entropy  # noqa: E402
from grpo_jax.core.objectives import policy_loss  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

NUM_DEV, N, G, T, V = 8, 32, 4, 6, 8
AXIS = "data"
LOSS_OPTIONS = [
    dict(aggregation="sequence"),
    dict(aggregation="token", eps_high=0.28, ratio="sequence"),
    dict(aggregation="constant", max_len=10),
]
# The other loss families (grpo_jax.core.objectives), with the sampler weights (their own placement).
# Clip-Cov and KL-Cov draw from each call's rows, so they are per device by design: not here.
OBJECTIVES = ["cispo", "sapo", "vespo", "geo_mean", "dppo_kl", "luspo", "gpg"]


def make_batch():
    ks = jax.random.split(jax.random.key(0), 6)
    old = jax.random.uniform(ks[0], (N, T), minval=-3.0, maxval=-0.05)
    logp = old + 0.3 * jax.random.normal(ks[1], (N, T))
    ref = old + 0.2 * jax.random.normal(ks[2], (N, T))
    lengths = jax.random.randint(ks[3], (N,), 0, T + 1)  # some rows all padding
    mask = jnp.arange(T)[None, :] < lengths[:, None]
    rewards = jax.random.bernoulli(ks[4], 0.5, (N,)).astype(jnp.float32)
    rewards = rewards.at[:G].set(1.0).at[5].set(jnp.nan)  # a constant group and a NaN reward
    logits = 3 * jax.random.normal(ks[5], (N, T, V))
    is_w = jax.random.uniform(jax.random.key(1), (N, T), minval=0.5, maxval=1.5)
    return dict(logp=logp, old=old, ref=ref, mask=mask, rewards=rewards, logits=logits, is_w=is_w)


def all_outputs(b, axis_name=None):
    """Every batch-dependent output, as a flat dict; `b` holds one device's rows or all of them."""
    out = {}
    for scale in ("group", "batch", "none"):
        out[f"adv/{scale}"] = group_advantages(b["rewards"], G, scale=scale, axis_name=axis_name)
    out["zero_std_fraction"] = zero_std_fraction(b["rewards"], G, axis_name=axis_name)
    adv = out["adv/group"]
    for i, opts in enumerate(LOSS_OPTIONS):

        def loss_fn(lp, opts=opts):
            return grpo_loss(lp, b["old"], b["ref"], adv, b["mask"], axis_name=axis_name, **opts)

        (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(b["logp"])
        out[f"loss{i}"] = loss
        out[f"grad{i}"] = grad
        out.update({f"loss{i}/{k}": v for k, v in metrics.items()})
    for loss_type in OBJECTIVES:

        def objective_fn(lp, loss_type=loss_type):
            return policy_loss(lp, b["old"], b["ref"], adv, b["mask"], loss_type=loss_type, max_len=10,
                               is_weights=b["is_w"], axis_name=axis_name)

        (loss, metrics), grad = jax.value_and_grad(objective_fn, has_aux=True)(b["logp"])
        out[f"loss_{loss_type}"] = loss
        out[f"grad_{loss_type}"] = grad
        out.update({f"loss_{loss_type}/{k}": v for k, v in metrics.items()})
    out["entropy"] = token_entropy(b["logits"], b["mask"], axis_name=axis_name)
    return out


def is_per_row(name):
    return name.startswith("adv/") or name.startswith("grad")


def compare(name, got, want):
    for key, w in want.items():
        g = np.asarray(got[key]).reshape(np.shape(w))
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6, err_msg=f"{name}: {key}")


def main():
    assert jax.device_count() == NUM_DEV, f"expected {NUM_DEV} devices, got {jax.devices()}"
    batch = make_batch()
    want = jax.tree.map(np.asarray, jax.jit(all_outputs)(batch))
    assert np.isfinite(want["loss0"]) and 0 < want["zero_std_fraction"] < 1

    # (1) jit over global arrays sharded along the batch axis: XLA inserts the collectives.
    mesh = jax.make_mesh((NUM_DEV,), (AXIS,))
    sharded = jax.device_put(batch, NamedSharding(mesh, P(AXIS)))
    got = jax.jit(all_outputs)(sharded)
    assert len(got["adv/group"].sharding.device_set) == NUM_DEV
    compare("jit+shardings", got, want)

    # (2) shard_map: per-device code, global values through axis_name.
    out_specs = {k: P(AXIS) if is_per_row(k) else P() for k in want}
    per_device = jax.shard_map(
        lambda b: all_outputs(b, AXIS), mesh=mesh, in_specs=(P(AXIS),), out_specs=out_specs
    )
    compare("shard_map", jax.jit(per_device)(sharded), want)

    # (3) pmap (research code still uses it): leading device axis, then the per-device rows.
    stacked = jax.tree.map(lambda x: x.reshape((NUM_DEV, N // NUM_DEV) + x.shape[1:]), batch)
    got = jax.pmap(lambda b: all_outputs(b, AXIS), axis_name=AXIS)(stacked)
    got = {k: (v if is_per_row(k) else v[0]) for k, v in got.items()}
    # pmap transposes psum to psum, so jax.grad of a psum-normalised loss comes out multiplied by
    # the number of devices (shard_map tracks replication and does not): documented in losses.py.
    got = {k: (v / NUM_DEV if k.startswith("grad") else v) for k, v in got.items()}
    compare("pmap", got, want)
    print("OK", len(want), "outputs equal on 1 device, jit+shardings, shard_map and pmap")


if __name__ == "__main__":
    sys.exit(main())
