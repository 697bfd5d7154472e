"""The entropy metric: the next-token distribution's entropy at each position, computed in chunks
so bf16 logits never get a whole float32 copy, and its mean over real answer tokens.

Shapes: N answers (rows), T token columns, V vocabulary; `mask` is nonzero on real answer tokens.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from grpo_jax.core.token_stats import token_mean


def _entropy_rows(logits_RxV: jax.Array) -> jax.Array:
    """Entropy of each row of logits; float32 [R]. See `per_token_entropy`."""
    # The barrier keeps XLA from hoisting the float32 upcast out of the chunk loop, which would
    # re-create the whole-array float32 copy the chunking exists to avoid.
    x = jax.lax.optimization_barrier(logits_RxV).astype(jnp.float32)
    z = x - jax.lax.stop_gradient(x.max(axis=-1, keepdims=True))
    e = jnp.exp(z)
    # H = log S - W / S with S = sum e^z, W = sum e^z z (z <= 0, so nothing overflows). e == 0
    # where a logit is -inf; zeroing z there keeps 0 * -inf out of the value and the gradient.
    s = e.sum(axis=-1)
    w = (e * jnp.where(e > 0, z, 0.0)).sum(axis=-1)
    return jnp.log(s) - w / s


@functools.partial(jax.jit, static_argnames="chunk_elements")
def per_token_entropy(logits: jax.Array, *, chunk_elements: int = 2**24) -> jax.Array:
    """Entropy -sum_v p_v log p_v of the next-token distribution at each position.

    Memory: positions are processed in chunks of about `chunk_elements` logits (`lax.map`), so
    the float32 temporaries (upcast, exp) are a few chunks, never a float32 copy of the whole
    [..., V] array. (XLA on CPU does not fuse the upcast, exp and two reductions into one pass:
    unchunked, it holds two full float32 [N, T, V] arrays.)

    Args:
      logits: [..., V] any float dtype.
      chunk_elements: static, logits per chunk (default 2**24: 64 MiB of float32 per temporary).

    Returns:
      entropy: float32 [...] in nats; 0 for a one-hot (others -inf) distribution, not NaN.
    """
    *lead, vocab = logits.shape
    rows = math.prod(lead)
    chunk = max(1, min(rows, chunk_elements // vocab))
    num_chunks = -(-rows // chunk)
    flat_RxV = logits.reshape(rows, vocab)
    if num_chunks * chunk != rows:  # pad with zero logits (uniform rows), dropped below
        flat_RxV = jnp.pad(flat_RxV, ((0, num_chunks * chunk - rows), (0, 0)))
    h_CxB = jax.lax.map(_entropy_rows, flat_RxV.reshape(num_chunks, chunk, vocab))
    return h_CxB.reshape(-1)[:rows].reshape(lead)


def token_entropy(
    logits: jax.Array,
    mask: jax.Array,
    *,
    axis_name: str | None = None,
    chunk_elements: int = 2**24,
) -> jax.Array:
    """The seed's entropy metric: mean over real tokens of the next-token entropy.

    H = mean_{i,t} [-sum_v pi(v | q, o_{i,<t}) log pi(v | q, o_{i,<t})] (seed, Part 1, Entropy).

    Args:
      logits: [N, T, V] logits at the answer positions (any float dtype; bf16 is upcast chunk
        by chunk, see `per_token_entropy`).
      mask: [N, T], nonzero on real tokens.
      axis_name: mapped batch axis, for the global mean.
      chunk_elements: see `per_token_entropy`.

    Returns:
      float32 scalar in nats; 0 if there are no real tokens.
    """
    real_NxT = jnp.asarray(mask) != 0
    h_NxT = per_token_entropy(logits, chunk_elements=chunk_elements)
    return token_mean(h_NxT, real_NxT, axis_name)
