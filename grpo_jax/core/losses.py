"""The GRPO loss (minus the seed's objective J), its KL estimators, and the entropy metric.

Shapes: N answers (rows), T token columns, V vocabulary. `mask` is nonzero on real answer tokens
and zero on padding (prompt tokens, tokens after EOS). Padding never contributes, an all-padding
row gives no NaN, and low-precision inputs (bf16) are accumulated in float32.

Functions whose value depends on the whole batch (token-count normalisers, answer counts, metrics)
take `axis_name`: inside `jax.shard_map` or `jax.pmap` over the batch axis they then return the
global value, the same number as one device computing the whole batch. Under `jax.jit` with
sharded global arrays no `axis_name` is needed. Gradients: under `jax.jit` and `jax.shard_map`,
`jax.grad` of the loss is the global gradient. Under `jax.pmap` it comes out multiplied by the
number of devices (pmap transposes psum into psum); divide by `jax.lax.axis_size(axis_name)`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

KLKind = Literal["k1", "k2", "k3"]
Aggregation = Literal["sequence", "token", "constant", "sequence_sum"]
RatioMode = Literal["token", "sequence"]
CorrectionMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def _psum(x: jax.Array, axis_name: str | None) -> jax.Array:
    return x if axis_name is None else jax.lax.psum(x, axis_name)


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, kind: KLKind = "k3") -> jax.Array:
    """Per-token estimate of KL(pi_theta || pi_ref) from the sampled tokens' log-probs.

    With log_r = ref_logp - logp (Schulman's "Approximating KL divergence" names):
      "k1": -log_r, unbiased but can be negative per token;
      "k2": log_r**2 / 2, >= 0, low variance, biased;
      "k3": exp(log_r) - log_r - 1, the seed's (and DeepSeekMath's) estimator: >= 0, unbiased,
            and 0 exactly when the two log-probs agree.

    Args:
      logp: [...] log pi_theta of the sampled tokens.
      ref_logp: [...] log pi_ref of the same tokens (same shape).
      kind: "k1", "k2" or "k3".

    Returns:
      float32 [...], per token; mask it yourself (or use `grpo_loss`).
    """
    log_r = jnp.asarray(ref_logp, jnp.float32) - jnp.asarray(logp, jnp.float32)
    match kind:
        case "k1":
            return -log_r
        case "k2":
            return 0.5 * log_r**2
        case "k3":
            # expm1 keeps k3 accurate (and >= 0) when log_r is tiny: exp(x) - 1 - x loses every
            # digit to cancellation in float32 below |x| ~ 1e-4.
            return jnp.expm1(log_r) - log_r
        case _:
            raise ValueError(f"kl kind must be 'k1', 'k2' or 'k3', got {kind!r}")


def importance_ratio(
    logp: jax.Array, old_logp: jax.Array, mask: jax.Array, ratio: RatioMode = "token"
) -> jax.Array:
    """rho: pi_theta / pi_theta_old per token ("token") or GSPO's per answer ("sequence").

    "token": rho_{i,t} = exp(logp_{i,t} - old_logp_{i,t}) (seed, "The Ratio").
    "sequence": GSPO's length-normalised s_i = exp(mean over real tokens of (logp - old_logp)),
    the geometric mean of the token ratios, broadcast to every token of answer i. (The raw
    product of token ratios explodes with length: seed, "Why Per Token and Not Per Answer?".)

    Args:
      logp: [N, T] log pi_theta of the sampled tokens (differentiate through this one).
      old_logp: [N, T] log pi_theta_old at sampling time.
      mask: [N, T], nonzero on real tokens.
      ratio: "token" or "sequence".

    Returns:
      rho_NxT: float32 [N, T]; exactly 1 on padding.
    """
    real_NxT = jnp.asarray(mask) != 0
    # Zero the log-probs on padding *before* exp: padding may hold -inf or garbage, and a NaN in
    # the branch jnp.where discards still poisons the gradient.
    log_rho_NxT = jnp.where(real_NxT, jnp.asarray(logp, jnp.float32), 0.0) - jnp.where(
        real_NxT, jnp.asarray(old_logp, jnp.float32), 0.0
    )
    match ratio:
        case "token":
            return jnp.exp(log_rho_NxT)
        case "sequence":
            length_N = real_NxT.sum(axis=1).astype(jnp.float32)
            log_s_N = log_rho_NxT.sum(axis=1) / jnp.maximum(length_N, 1.0)
            return jnp.broadcast_to(jnp.exp(log_s_N)[:, None], log_rho_NxT.shape)
        case _:
            raise ValueError(f"ratio must be 'token' or 'sequence', got {ratio!r}")


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
    masking = mode.endswith("mask")
    hi = jnp.inf if clip_max is None else clip_max
    lo = clip_min if clip_min is not None else ((1.0 / clip_max if clip_max else 0.0) if masking else 0.0)
    outside_NxT = real_NxT & ((raw_NxT < lo) | (raw_NxT > hi))
    if masking:
        w_NxT = jnp.where(outside_NxT, 0.0, raw_NxT)
    else:
        w_NxT = jnp.clip(raw_NxT, lo, hi)

    num_tokens = jnp.maximum(_psum(real_NxT.sum().astype(jnp.float32), axis_name), 1.0)
    any_real = _psum(real_NxT.sum(), axis_name) > 0

    def token_mean(x_NxT):
        return _psum(jnp.where(real_NxT, x_NxT, 0.0).sum(), axis_name) / num_tokens

    def token_max(x_NxT, empty):
        value = jnp.where(real_NxT, x_NxT, -jnp.inf).max()
        value = value if axis_name is None else jax.lax.pmax(value, axis_name)
        return jnp.where(any_real, value, empty)

    w_min = jnp.where(real_NxT, w_NxT, jnp.inf).min()
    if axis_name is not None:
        w_min = jax.lax.pmin(w_min, axis_name)
    abs_d_NxT = jnp.abs(d_NxT)
    outside = outside_NxT.astype(jnp.float32)
    metrics = {
        "sampling/importance_sampling_ratio/mean": token_mean(w_NxT),
        "sampling/importance_sampling_ratio/min": jnp.where(any_real, w_min, 1.0),
        "sampling/importance_sampling_ratio/max": token_max(w_NxT, 1.0),
        "sampling/sampling_logp_difference/mean": token_mean(abs_d_NxT),
        "sampling/sampling_logp_difference/max": token_max(abs_d_NxT, 0.0),
        "sampling/importance_sampling_masked_fraction": token_mean(outside) if masking else jnp.float32(0.0),
        "sampling/importance_sampling_truncated_fraction": jnp.float32(0.0) if masking else token_mean(outside),
    }
    return jax.lax.stop_gradient(w_NxT), jax.lax.stop_gradient(metrics)


def clipped_surrogate(
    rho: jax.Array, advantages: jax.Array, eps_low: float = 0.2, eps_high: float | None = None
) -> jax.Array:
    """PPO's clipped term min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A), per token.

    Seed, "Clipping": rho = 1.8, A = +0.87, eps = 0.2 gives min(1.57, 1.04) = 1.04. Its gradient
    with respect to rho is 0 exactly where the clipped branch wins ("No (clipped)" in the seed's
    four-cases table). eps_high > eps_low is DAPO's clip-higher; None means eps_high = eps_low.

    Args:
      rho: [N, T] ratios.
      advantages: [N, T] (or broadcastable, e.g. [N, 1]).
      eps_low, eps_high: clip range [1 - eps_low, 1 + eps_high].

    Returns:
      float32 [N, T].
    """
    eps_high = eps_low if eps_high is None else eps_high
    a = jnp.asarray(advantages, jnp.float32)
    rho = jnp.asarray(rho, jnp.float32)
    unclipped = rho * a
    clipped = clip_passing_gradient(rho, 1.0 - eps_low, 1.0 + eps_high) * a
    # Ties go to the unclipped term with its whole gradient. jnp.minimum splits the gradient of a
    # tie in halves, which at rho = 1 (pi_old read in the loss) with eps_low = 0 or eps_high = 0
    # left 0.5 + 0.5 * 0.5 = 0.75 of the policy gradient. Same values as jnp.minimum.
    return jnp.where(unclipped <= clipped, unclipped, clipped)


def clip_passing_gradient(x: jax.Array, low: float | jax.Array, high: float | jax.Array) -> jax.Array:
    """clip(x, low, high) whose derivative is 1 on the closed band [low, high] and 0 outside.

    jnp.clip (a max then a min) gives 1/2 at a bound, where x ties with it: with eps_low = 0 and
    rho = 1 exactly, the bound is where every token sits. Values equal jnp.clip's.
    """
    return jnp.where(x < low, low, jnp.where(x > high, high, x))


def loss_normalizer(
    mask: jax.Array,
    aggregation: Aggregation = "sequence",
    *,
    max_len: int | None = None,
    axis_name: str | None = None,
) -> jax.Array:
    """The denominator of `aggregate`: what one batch's loss is divided by.

    "sequence": the number of answers N (an all-padding row counts, as in TRL's "grpo" loss);
    "token": the number of real tokens (at least 1); "constant": N * max_len (max_len defaults to T);
    "sequence_sum": N, as "sequence" (LUSPO's sum over an answer's tokens, then mean over answers).

    Gradient accumulation and sharding are exact when every piece of a batch divides by the whole
    batch's normaliser: the normaliser of the concatenated pieces is the sum of theirs, so
    `sum_k aggregate(x_k, m_k, normalizer=sum_k loss_normalizer(m_k))` is the full-batch value
    (not the mean of per-piece means, which over-weights the tokens of short pieces under "token").

    Args:
      mask: [N, T], nonzero on real tokens.
      aggregation: "sequence", "token", "constant" or "sequence_sum".
      max_len: the constant of "constant"; None uses T.
      axis_name: mapped batch axis (shard_map/pmap): the global normaliser.

    Returns:
      float32 scalar, > 0.
    """
    _check_aggregation(aggregation)
    real_NxT = jnp.asarray(mask) != 0
    num_rows = jnp.float32(real_NxT.shape[0])
    match aggregation:
        case "sequence" | "sequence_sum":
            return _psum(num_rows, axis_name)
        case "token":
            return jnp.maximum(_psum(real_NxT.sum().astype(jnp.float32), axis_name), 1.0)
        case "constant":
            length = real_NxT.shape[1] if max_len is None else max_len
            return _psum(num_rows, axis_name) * length


def _check_aggregation(aggregation) -> None:
    if aggregation not in ("sequence", "token", "constant", "sequence_sum"):
        raise ValueError(f"aggregation must be 'sequence', 'token', 'constant' or 'sequence_sum', got {aggregation!r}")


def aggregate(
    per_token: jax.Array,
    mask: jax.Array,
    aggregation: Aggregation = "sequence",
    *,
    max_len: int | None = None,
    normalizer: jax.Array | float | None = None,
    axis_name: str | None = None,
) -> jax.Array:
    """Reduces a per-token quantity over real tokens to the scalar `grpo_loss` documents.

      "sequence": sum_i (1/|o_i|) sum_t x_{i,t} / N   (the seed's per-answer mean, then over answers)
      "token":    sum_{i,t} x_{i,t} / (real tokens)   (DAPO)
      "constant": sum_{i,t} x_{i,t} / (N * max_len)   (Dr. GRPO)
      "sequence_sum": sum_{i,t} x_{i,t} / N           (LUSPO: each answer weighted by its length)

    The numerator is a plain sum over this batch's rows; the denominator is `normalizer`, by
    default this batch's own `loss_normalizer`. To accumulate micro-batches (or shard rows) exactly,
    pass each piece the normaliser of the whole batch and add the results.

    Args:
      per_token: [N, T] values (padding may hold anything, even NaN: it is zeroed first).
      mask: [N, T], nonzero on real tokens.
      aggregation: "sequence", "token", "constant" or "sequence_sum".
      max_len: the constant of "constant"; None uses T.
      normalizer: the denominator; None: `loss_normalizer(mask, aggregation, max_len=...)`.
      axis_name: mapped batch axis (shard_map/pmap): the numerator (and default normaliser) global.

    Returns:
      float32 scalar.
    """
    _check_aggregation(aggregation)
    real_NxT = jnp.asarray(mask) != 0
    zeroed_NxT = jnp.where(real_NxT, jnp.asarray(per_token, jnp.float32), 0.0)
    if normalizer is None:
        normalizer = loss_normalizer(real_NxT, aggregation, max_len=max_len, axis_name=axis_name)
    if aggregation == "sequence":
        length_N = real_NxT.sum(axis=1).astype(jnp.float32)
        numerator = (zeroed_NxT.sum(axis=1) / jnp.maximum(length_N, 1.0)).sum()
    else:
        numerator = zeroed_NxT.sum()
    return _psum(numerator, axis_name) / normalizer


def grpo_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    ref_logp: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    beta: float = 0.04,
    kl: KLKind = "k3",
    aggregation: Aggregation = "sequence",
    max_len: int | None = None,
    ratio: RatioMode = "token",
    normalizer: jax.Array | float | None = None,
    axis_name: str | None = None,
    is_weights: jax.Array | None = None,
    use_bias_correction_kl: bool = False,
    surrogate: Callable | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO loss, -J (seed, Step 4), with the DAPO / Dr. GRPO / GSPO variants.

    Per token: j_{i,t} = w_{i,t} min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) - beta * KL_{i,t},
    w the sampler-correction weights (`sampler_correction`; 1 without them). The KL term is not
    weighted (TRL's placement).
    Aggregation over real tokens:
      "sequence": the seed's (1/G) sum_i (1/|o_i|) sum_t j_{i,t}; every row counts in the
                  1/N, an all-padding row adds 0 (as TRL's "grpo" loss);
      "token":    DAPO, sum_{i,t} j_{i,t} / (number of real tokens);
      "constant": Dr. GRPO, sum_{i,t} j_{i,t} / (N * max_len), max_len defaulting to T;
      "sequence_sum": LUSPO, sum_{i,t} j_{i,t} / N.
    The loss is -J. With `axis_name`, N and the token count are global.

    Args:
      logp: [N, T] log pi_theta of the sampled tokens (the only argument with a gradient).
      old_logp: [N, T] log pi_theta_old, saved at sampling time.
      ref_logp: [N, T] log pi_ref, or None when beta == 0.
      advantages: [N] (one per answer) or [N, T] (per token, e.g. `process_advantages`).
      mask: [N, T], nonzero on real answer tokens.
      eps_low, eps_high: clip range; eps_high None means eps_low (DAPO's clip-higher otherwise).
      beta: KL weight; 0 skips the KL term.
      kl: KL estimator, see `kl_penalty`.
      aggregation: "sequence", "token", "constant" or "sequence_sum".
      max_len: the constant of "constant" (the generation budget); None uses T.
      ratio: "token" (GRPO) or "sequence" (GSPO), see `importance_ratio`.
      normalizer: the loss's denominator (see `aggregate`); None: this batch's own. Pass the whole
        batch's `loss_normalizer` to every micro-batch and add their losses (and gradients) for
        exact gradient accumulation under every aggregation.
      axis_name: mapped batch axis (shard_map/pmap) for global normalisers and metrics.
      is_weights: [N, T] (or [N, 1]) importance weights pi_old / pi_sampler from
        `sampler_correction`, or None (no correction). Treated as constants.
      use_bias_correction_kl: TRL's option (DeepSeek-V3.2, eq. 8): KL_{i,t} is multiplied by rho_{i,t}
        (differentiable; GSPO's per-answer rho with ratio="sequence"), so that the k3 estimate,
        taken on tokens sampled from pi_old, is unbiased for KL(pi_theta || pi_ref). Off (this
        function's default): the seed's k3. The trainer's default is on, as TRL 1.16's.
      surrogate: None (PPO's clipped term above), or another family's per-token objective
        `f(logp, old_logp, adv_NxT, mask, *, is_weights, axis_name) -> (j_NxT, metrics)` (CISPO,
        SAPO, ...: `grpo_jax.core.objectives`), which applies `is_weights` itself; its metrics replace
        the `clip_ratio/*` ones.

    Returns:
      (loss, metrics): loss a float32 scalar; metrics float32 scalars (no gradient):
        "policy_loss": -aggregate(weighted clipped term) over the same normaliser, so
          loss = policy_loss + beta * (aggregated KL);
        "kl": token mean of the KL estimator, times rho with use_bias_correction_kl (0 when
          ref_logp is None);
        "clip_ratio/low_mean": token fraction clipped below (rho < 1 - eps_low and A < 0);
        "clip_ratio/high_mean": token fraction clipped above (rho > 1 + eps_high and A > 0);
        "clip_ratio/region_mean": token fraction outside [1 - eps_low, 1 + eps_high] (the seed's
          clip frac, whatever the sign of A);
        "ratio/mean", "ratio/min", "ratio/max": of rho over real tokens (1 if there are none).
    """
    logp = jnp.asarray(logp)
    if logp.ndim != 2:
        raise ValueError(f"logp must be [N, T], got shape {logp.shape}")
    shape = logp.shape
    for name, arr in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp)):
        if arr is not None and jnp.shape(arr) != shape:
            raise ValueError(f"{name} has shape {jnp.shape(arr)}, expected {shape} (logp's)")
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.shape == shape[:1]:
        adv_NxT = jnp.broadcast_to(adv[:, None], shape)
    elif adv.shape == shape:
        adv_NxT = adv
    else:
        raise ValueError(
            f"advantages has shape {adv.shape}, expected [N]={shape[:1]} or [N, T]={shape}"
        )
    if ref_logp is None and not (isinstance(beta, (int, float)) and beta == 0):
        raise ValueError(f"ref_logp is None but beta={beta!r}; pass ref_logp or set beta=0")

    eps_high = eps_low if eps_high is None else eps_high
    real_NxT = jnp.asarray(mask) != 0
    rho_NxT = importance_ratio(logp, old_logp, mask, ratio)
    if surrogate is None:
        surrogate_NxT = clipped_surrogate(rho_NxT, adv_NxT, eps_low, eps_high)
        if is_weights is not None:
            surrogate_NxT = surrogate_NxT * jax.lax.stop_gradient(jnp.asarray(is_weights, jnp.float32))
    else:
        surrogate_NxT, surrogate_metrics = surrogate(logp, old_logp, adv_NxT, mask, is_weights=is_weights,
                                                     axis_name=axis_name)

    if ref_logp is None:
        kl_NxT = jnp.zeros(shape, jnp.float32)
    else:
        # Same padding guard as in importance_ratio: exp of garbage on padding must not reach
        # the gradient.
        kl_NxT = kl_penalty(
            jnp.where(real_NxT, logp.astype(jnp.float32), 0.0),
            jnp.where(real_NxT, jnp.asarray(ref_logp, jnp.float32), 0.0),
            kl,
        )
        if use_bias_correction_kl:
            kl_NxT = kl_NxT * rho_NxT
    objective_NxT = surrogate_NxT - beta * kl_NxT
    if normalizer is None:
        normalizer = loss_normalizer(real_NxT, aggregation, max_len=max_len, axis_name=axis_name)
    loss = -aggregate(
        objective_NxT, real_NxT, aggregation, max_len=max_len, normalizer=normalizer, axis_name=axis_name
    )
    policy_loss = -aggregate(
        jax.lax.stop_gradient(surrogate_NxT), real_NxT, aggregation, max_len=max_len,
        normalizer=normalizer, axis_name=axis_name,
    )
    metrics = {
        "policy_loss": policy_loss,
        **_loss_metrics(kl_NxT, rho_NxT, adv_NxT, real_NxT, eps_low, eps_high, axis_name),
    }
    if surrogate is not None:  # the clip fractions describe PPO's clip only
        metrics = {k: v for k, v in metrics.items() if not k.startswith("clip_ratio/")}
        metrics.update(jax.lax.stop_gradient(surrogate_metrics))
    return loss, metrics


def _loss_metrics(
    kl_NxT, rho_NxT, adv_NxT, real_NxT, eps_low, eps_high, axis_name
) -> dict[str, jax.Array]:
    """TRL-named float32 scalar metrics of one loss evaluation; see `grpo_loss`."""
    sg = jax.lax.stop_gradient
    kl_NxT, rho_NxT = sg(kl_NxT), sg(rho_NxT)
    num_tokens = jnp.maximum(_psum(real_NxT.sum().astype(jnp.float32), axis_name), 1.0)

    def token_mean(x_NxT):
        return _psum(jnp.where(real_NxT, x_NxT, 0.0).sum(), axis_name) / num_tokens

    below_NxT = rho_NxT < 1.0 - eps_low
    above_NxT = rho_NxT > 1.0 + eps_high
    any_real = _psum(real_NxT.sum(), axis_name) > 0
    rho_min = jnp.where(real_NxT, rho_NxT, jnp.inf).min()
    rho_max = jnp.where(real_NxT, rho_NxT, -jnp.inf).max()
    if axis_name is not None:
        rho_min = jax.lax.pmin(rho_min, axis_name)
        rho_max = jax.lax.pmax(rho_max, axis_name)
    f32 = lambda b: b.astype(jnp.float32)  # noqa: E731
    return {
        "kl": token_mean(kl_NxT),
        "clip_ratio/low_mean": token_mean(f32(below_NxT & (adv_NxT < 0))),
        "clip_ratio/high_mean": token_mean(f32(above_NxT & (adv_NxT > 0))),
        "clip_ratio/region_mean": token_mean(f32(below_NxT | above_NxT)),
        "ratio/mean": token_mean(rho_NxT),
        "ratio/min": jnp.where(any_real, rho_min, 1.0),
        "ratio/max": jnp.where(any_real, rho_max, 1.0),
    }


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
    total = _psum(jnp.where(real_NxT, h_NxT, 0.0).sum(), axis_name)
    count = _psum(real_NxT.sum().astype(jnp.float32), axis_name)
    return total / jnp.maximum(count, 1.0)
