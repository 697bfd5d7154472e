"""Batch-global statistics of per-token values over real tokens: the sum, count, mean, min and max.

Shapes: N answers (rows), T token columns; `real_NxT` is a boolean mask of the real (non-padding)
tokens. With `axis_name` (inside `jax.shard_map` or `jax.pmap` over the batch axis) each statistic
is the global one, the number one device computing the whole batch would get; without it, this
batch's own. The losses, the sampler correction and the entropy metric all report through these.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def psum(x: jax.Array, axis_name: str | None) -> jax.Array:
    """`x` summed over the mapped batch axis; `x` itself when there is none."""
    return x if axis_name is None else jax.lax.psum(x, axis_name)


def token_count(real_NxT: jax.Array, axis_name: str | None) -> jax.Array:
    """The number of real tokens as float32, at least 1 (a divisor that is never 0)."""
    return jnp.maximum(psum(real_NxT.sum().astype(jnp.float32), axis_name), 1.0)


def token_mean(x_NxT: jax.Array, real_NxT: jax.Array, axis_name: str | None) -> jax.Array:
    """Mean of x over real tokens (padding may hold anything, it is zeroed); 0 if there are none."""
    return psum(jnp.where(real_NxT, x_NxT, 0.0).sum(), axis_name) / token_count(real_NxT, axis_name)


def any_real(real_NxT: jax.Array, axis_name: str | None) -> jax.Array:
    """Whether the (global) batch has at least one real token: a boolean scalar."""
    return psum(real_NxT.sum(), axis_name) > 0


def token_min(x_NxT: jax.Array, real_NxT: jax.Array, axis_name: str | None, empty: float) -> jax.Array:
    """Min of x over real tokens; `empty` when there are none."""
    value = jnp.where(real_NxT, x_NxT, jnp.inf).min()
    if axis_name is not None:
        value = jax.lax.pmin(value, axis_name)
    return jnp.where(any_real(real_NxT, axis_name), value, empty)


def token_max(x_NxT: jax.Array, real_NxT: jax.Array, axis_name: str | None, empty: float) -> jax.Array:
    """Max of x over real tokens; `empty` when there are none."""
    value = jnp.where(real_NxT, x_NxT, -jnp.inf).max()
    if axis_name is not None:
        value = jax.lax.pmax(value, axis_name)
    return jnp.where(any_real(real_NxT, axis_name), value, empty)
