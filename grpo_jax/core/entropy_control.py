"""Entropy control, with TRL's names: the entropy bonus (`entropy_coef`), Skywork-OR1's adaptive
coefficient (`use_adaptive_entropy`) and training on the high-entropy tokens only
(`top_entropy_quantile`, "Beyond the 80/20 Rule", arXiv 2506.01939).

Pure functions of per-token entropies H [N, T] (`model.token_logprobs(..., return_entropy=True)`,
differentiable) and the answer mask; plus the controller's state, kept in the optimizer state
(`controller`) so it is checkpointed and restored with it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from grpo_jax.core import losses


def entropy_quantile(entropy: jax.Array, mask: jax.Array, q: float, *, axis_name: str | None = None) -> jax.Array:
    """The q-quantile of the entropies of the real tokens (linear interpolation, as torch.quantile).

    With sorted values v_0 <= ... <= v_{n-1}: position p = q (n - 1), value
    v_lo + (p - lo) (v_{lo+1} - v_lo), lo = floor(p). Example: (0.1, 0.4, 0.2, 0.3), q = 0.8:
    p = 2.4, 0.3 + 0.4 * 0.1 = 0.34.

    Args:
      entropy: [N, T] per-token entropies.
      mask: [N, T], nonzero on real tokens.
      q: in [0, 1].
      axis_name: mapped batch axis (shard_map/pmap): the quantile of every device's tokens.

    Returns:
      float32 scalar; +inf when there are no real tokens.
    """
    real = (jnp.asarray(mask) != 0).reshape(-1)
    values = jnp.where(real, jax.lax.stop_gradient(jnp.asarray(entropy, jnp.float32)).reshape(-1), jnp.inf)
    if axis_name is not None:
        values = jax.lax.all_gather(values, axis_name, tiled=True)
        real = jax.lax.all_gather(real, axis_name, tiled=True)
    n = real.sum()
    sorted_v = jnp.sort(values)  # the real values first, padding (+inf) last
    pos = jnp.float32(q) * jnp.maximum(n - 1, 0).astype(jnp.float32)
    lo = jnp.floor(pos).astype(jnp.int32)
    hi = jnp.minimum(lo + 1, jnp.maximum(n - 1, 0))
    v_lo, v_hi = sorted_v[lo], sorted_v[hi]
    value = jnp.where(n > 0, v_lo + (pos - lo) * (v_hi - v_lo), jnp.inf)
    # Every device computed the same number from the same gathered values; pmax says so to
    # shard_map (all_gather's result counts as per-device).
    return value if axis_name is None else jax.lax.pmax(value, axis_name)


def high_entropy_mask(entropy: jax.Array, mask: jax.Array, top_quantile: float, *,
                      axis_name: str | None = None) -> jax.Array:
    """TRL's `top_entropy_quantile`: True on the real tokens whose entropy is at least the
    (1 - top_quantile)-quantile of all real tokens' (80/20 paper: rho = 0.2 keeps the "forking"
    tokens). top_quantile = 1 keeps every real token; 0 only the highest-entropy one(s).
    Example: H = (0.1, 0.4, 0.2, 0.3), top_quantile 0.2: threshold 0.34, only 0.4 is kept.

    Args:
      entropy: [N, T] per-token entropies (no gradient is taken through the mask).
      mask: [N, T], nonzero on real tokens.
      top_quantile: rho in [0, 1].
      axis_name: mapped batch axis: one threshold for the global batch.

    Returns:
      bool [N, T]; False on padding.
    """
    threshold = entropy_quantile(entropy, mask, 1.0 - top_quantile, axis_name=axis_name)
    return (jax.lax.stop_gradient(jnp.asarray(entropy, jnp.float32)) >= threshold) & (jnp.asarray(mask) != 0)


def entropy_bonus(
    entropy: jax.Array,
    mask: jax.Array,
    aggregation: losses.Aggregation = "token",
    *,
    entropy_mask: jax.Array | None = None,
    max_len: int | None = None,
    normalizer: jax.Array | float | None = None,
    axis_name: str | None = None,
) -> jax.Array:
    """H_agg, the entropy the loss subtracts entropy_coef times: loss = policy loss - coef * H_agg.

    The per-token entropies (times `entropy_mask`, the top_entropy_quantile selection, where given)
    are aggregated like the policy loss (`losses.aggregate`, same normaliser), so gradient
    accumulation and devices stay exact. With aggregation "token" this is TRL's bonus (the entropy
    summed over the selected tokens over the batch's real-token count); TRL's "grpo" loss type takes
    the token mean instead of "sequence"'s mean of per-answer means.
    Example: H = [[1, 3], [2, pad]], "token": (1 + 3 + 2) / 3 = 2; "sequence": (2 + 2) / 2 = 2.

    Args:
      entropy: [N, T] per-token entropies (differentiable: the bonus's gradient flows through it).
      mask: [N, T], nonzero on real tokens.
      aggregation, max_len, normalizer, axis_name: as `losses.aggregate`.
      entropy_mask: [N, T] bool or None (all tokens).

    Returns:
      float32 scalar.
    """
    h = jnp.asarray(entropy, jnp.float32)
    if entropy_mask is not None:
        h = jnp.where(entropy_mask, h, 0.0)
    return losses.aggregate(h, mask, aggregation, max_len=max_len, normalizer=normalizer, axis_name=axis_name)


class EntropyControlState(NamedTuple):
    """The adaptive controller's state: the coefficient, and the entropy measured at the last
    update (+inf before the first, so the first update applies no bonus, as TRL)."""

    entropy_coef: jax.Array
    last_entropy: jax.Array


def controller(initial_coef: float) -> optax.GradientTransformation:
    """An Optax transformation that only carries `EntropyControlState` (gradients pass unchanged):
    chained after the optimizer, the state lives in opt_state, sharded, checkpointed and restored
    with it. The train step reads it (`applied_coef`) and writes it (`next_coef`)."""

    def init(params):
        del params
        return EntropyControlState(jnp.float32(initial_coef), jnp.float32(jnp.inf))

    def update(updates, state, params=None):
        del params
        return updates, state

    return optax.GradientTransformation(init, update)


def with_controller(tx: optax.GradientTransformation, grpo) -> optax.GradientTransformation:
    """The trainer's optimizer with the controller chained after it when `grpo.use_adaptive_entropy`
    (a `config.GRPOSection`), else `tx` itself (so the optimizer state is unchanged by default)."""
    return optax.chain(tx, controller(grpo.entropy_coef)) if grpo.use_adaptive_entropy else tx


def applied_coef(state: EntropyControlState, target: float) -> jax.Array:
    """The coefficient this update applies: the state's while the last measured entropy is
    <= target, else 0 (TRL: the bonus engages only near collapse)."""
    return jnp.where(state.last_entropy <= target, state.entropy_coef, 0.0)


def next_coef(coef: jax.Array, entropy: jax.Array, *, target: float, delta: float, coef_min: float,
              coef_max: float) -> jax.Array:
    """Skywork-OR1's rule (TRL `use_adaptive_entropy`): coef + delta (at most coef_max) when the
    update's entropy is <= target, else coef - delta (at least coef_min). Example: coef 0.01,
    delta 0.005, target 0.2: entropy 0.1 -> 0.015, entropy 0.3 -> 0.005."""
    return jnp.where(entropy <= target, jnp.minimum(coef + delta, coef_max), jnp.maximum(coef - delta, coef_min))
