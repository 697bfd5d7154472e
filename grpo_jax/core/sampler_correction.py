"""The sampler correction: importance weights pi_old / pi_sampler for tokens that one policy sampled
and another trains on (truncated / masked importance sampling, TIS / MIS), and their metrics.

Shapes: N answers (rows), T token columns; `mask` is nonzero on real answer tokens. The weights are
constants to the loss (`grpo_loss(..., is_weights=w)` multiplies the clipped term by them).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from grpo_jax.core.token_stats import token_max, token_mean, token_min

CorrectionMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def sampler_correction(
    trainer_logp: jax.Array,
    sampler_logp: jax.Array,
    mask: jax.Array,
    mode: CorrectionMode = "sequence_mask",
    *,
    clip_max: float | None = 3.0,
    clip_min: float | None = None,
    axis_name: str | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Importance weights for tokens sampled from pi_sampler but trained as if from pi_old.

    The sampler's log-probs differ from the trainer's: other kernels, bf16 caches, or an older
    policy (asynchronous rollouts). The clipped objective's expectation is over pi_old, the
    trainer's policy, so each token's term is weighted by w = pi_old / pi_sampler (TIS / MIS,
    Yao et al. 2025; TRL's `vllm_importance_sampling_*`):

      "token_truncate":    w_{i,t} = clip(exp(d_{i,t}), lo, hi)
      "token_mask":        w_{i,t} = exp(d_{i,t}) where it lies in [lo, hi], else 0
      "sequence_truncate": w_i = clip(exp(sum_t d_{i,t}), lo, hi) on every token of answer i
      "sequence_mask":     w_i = exp(sum_t d_{i,t}) where it lies in [lo, hi], else 0 (the answer drops)

    with d = trainer_logp - sampler_logp on real tokens. Sequence modes use the product of the
    token ratios (the answer's own likelihood ratio, as TRL), not GSPO's geometric mean.
    Bounds: hi = clip_max (None: no upper bound); lo = clip_min, and when clip_min is None
    1 / clip_max in the mask modes (a band [1/C, C]) and no lower bound in the truncate modes.
    (TRL's clip_min=None puts no lower bound on the mask modes either: pass clip_min=0 for that.)

    Seed-style example: d = (0.1, -0.2, 0.3) on one answer, C = 2. token_truncate gives
    (e^0.1, e^-0.2, e^0.3) = (1.105, 0.819, 1.350); sequence_mask gives e^0.2 = 1.221 on all
    three (inside [0.5, 2]); with d = (0.5, 0.5, 0.5), e^1.5 = 4.48 > 2 and the answer is masked.

    Args:
      trainer_logp: [N, T] log pi_old from the trainer (no gradient is taken through it).
      sampler_logp: [N, T] log-probs the sampler reported for the same tokens.
      mask: [N, T], nonzero on real tokens.
      mode: one of the four above.
      clip_max, clip_min: the bounds, see above.
      axis_name: mapped batch axis (shard_map/pmap) for global metrics.

    Returns:
      (w_NxT, metrics): w float32 [N, T], exactly 1 on padding and exactly 1 where the two
      log-probs are equal (within the bounds); metrics float32 scalars over real tokens:
        "sampling/importance_sampling_ratio/mean", ".../min", ".../max": of w (after the bounds);
        "sampling/sampling_logp_difference/mean", ".../max": of |trainer_logp - sampler_logp|;
        "sampling/importance_sampling_masked_fraction": real tokens with w = 0 by the mask;
        "sampling/importance_sampling_truncated_fraction": real tokens whose ratio was clipped.
    """
    if mode not in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        raise ValueError("mode must be 'token_truncate', 'token_mask', 'sequence_truncate' or 'sequence_mask', "
                         f"got {mode!r}")
    real_NxT = jnp.asarray(mask) != 0
    d_NxT, raw_NxT = _log_ratio_and_raw_weights(trainer_logp, sampler_logp, real_NxT, mode)
    masking = mode.endswith("mask")
    lo, hi = _bounds(masking, clip_max, clip_min)
    outside_NxT = real_NxT & ((raw_NxT < lo) | (raw_NxT > hi))
    if masking:
        w_NxT = jnp.where(outside_NxT, 0.0, raw_NxT)
    else:
        w_NxT = jnp.clip(raw_NxT, lo, hi)
    metrics = _correction_metrics(w_NxT, d_NxT, outside_NxT, real_NxT, masking, axis_name)
    return jax.lax.stop_gradient(w_NxT), jax.lax.stop_gradient(metrics)


def _log_ratio_and_raw_weights(
    trainer_logp: jax.Array, sampler_logp: jax.Array, real_NxT: jax.Array, mode: CorrectionMode
) -> tuple[jax.Array, jax.Array]:
    """(d_NxT, raw_NxT): d = trainer_logp - sampler_logp on real tokens (0 on padding and where the
    sampler gave NaN), and the unbounded weight exp(d) per token or exp(sum_t d) per answer, 1 on
    padding."""
    trainer = jax.lax.stop_gradient(jnp.asarray(trainer_logp, jnp.float32))
    sampler = jnp.asarray(sampler_logp, jnp.float32)
    # Zeroed on padding first (it may hold garbage); a sampler that could not score a token (NaN)
    # gives it d = 0, weight 1, rather than a NaN loss.
    d_NxT = jnp.where(real_NxT, trainer, 0.0) - jnp.where(real_NxT, sampler, 0.0)
    d_NxT = jnp.where(jnp.isnan(d_NxT), 0.0, d_NxT)
    if mode.startswith("sequence"):
        log_w_NxT = jnp.broadcast_to(d_NxT.sum(axis=1, keepdims=True), d_NxT.shape)
    else:
        log_w_NxT = d_NxT
    raw_NxT = jnp.where(real_NxT, jnp.exp(log_w_NxT), 1.0)  # exp(0) == 1 exactly: equal log-probs, w = 1
    return d_NxT, raw_NxT


def _bounds(masking: bool, clip_max: float | None, clip_min: float | None) -> tuple[float, float]:
    """(lo, hi) of the weights, as `sampler_correction` documents: the band [1/C, C] for the mask
    modes unless clip_min is given, no lower bound for the truncate modes."""
    hi = jnp.inf if clip_max is None else clip_max
    lo = clip_min if clip_min is not None else ((1.0 / clip_max if clip_max else 0.0) if masking else 0.0)
    return lo, hi


def _correction_metrics(
    w_NxT: jax.Array, d_NxT: jax.Array, outside_NxT: jax.Array, real_NxT: jax.Array, masking: bool,
    axis_name: str | None,
) -> dict[str, jax.Array]:
    """TRL-named float32 scalar metrics of the weights over real tokens; see `sampler_correction`."""
    abs_d_NxT = jnp.abs(d_NxT)
    outside = outside_NxT.astype(jnp.float32)
    return {
        "sampling/importance_sampling_ratio/mean": token_mean(w_NxT, real_NxT, axis_name),
        "sampling/importance_sampling_ratio/min": token_min(w_NxT, real_NxT, axis_name, 1.0),
        "sampling/importance_sampling_ratio/max": token_max(w_NxT, real_NxT, axis_name, 1.0),
        "sampling/sampling_logp_difference/mean": token_mean(abs_d_NxT, real_NxT, axis_name),
        "sampling/sampling_logp_difference/max": token_max(abs_d_NxT, real_NxT, axis_name, 0.0),
        "sampling/importance_sampling_masked_fraction":
            token_mean(outside, real_NxT, axis_name) if masking else jnp.float32(0.0),
        "sampling/importance_sampling_truncated_fraction":
            jnp.float32(0.0) if masking else token_mean(outside, real_NxT, axis_name),
    }
