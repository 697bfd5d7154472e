"""The GRPO loss (minus the seed's objective J): the ratio, the clipped term, the KL estimators and
the aggregation over tokens. (The sampler correction's weights and the entropy metric live in
`core.sampler_correction` and `core.entropy`; their names are importable from here too.)

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
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

# Kept importable from here (research code's `grpo_jax.losses` path): the sampler correction and the
# entropy metric live in their own modules; `_psum` is what `objectives` reduces with.
from grpo_jax.core.entropy import per_token_entropy, token_entropy  # noqa: F401
from grpo_jax.core.sampler_correction import CorrectionMode, sampler_correction  # noqa: F401
from grpo_jax.core.token_stats import psum as _psum
from grpo_jax.core.token_stats import token_max, token_mean, token_min

KLKind = Literal["k1", "k2", "k3"]
Aggregation = Literal["sequence", "token", "constant", "sequence_sum"]
RatioMode = Literal["token", "sequence"]


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
    logp: jax.Array, old_logp: jax.Array, ref_logp: jax.Array | None, advantages: jax.Array, mask: jax.Array,
    *, eps_low: float = 0.2, eps_high: float | None = None, beta: float = 0.04, kl: KLKind = "k3",
    aggregation: Aggregation = "sequence", max_len: int | None = None, ratio: RatioMode = "token",
    normalizer: jax.Array | float | None = None, axis_name: str | None = None, is_weights: jax.Array | None = None,
    use_bias_correction_kl: bool = False, surrogate: Callable | None = None,
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
    adv_NxT = _advantages_NxT(logp, old_logp, ref_logp, advantages, mask, beta)
    eps_high = eps_low if eps_high is None else eps_high
    real_NxT = jnp.asarray(mask) != 0
    rho_NxT = importance_ratio(logp, old_logp, mask, ratio)
    surrogate_NxT, surrogate_metrics = _policy_term(logp, old_logp, adv_NxT, mask, rho_NxT, eps_low, eps_high,
                                                    is_weights, surrogate, axis_name)
    kl_NxT = _kl_term(logp, ref_logp, real_NxT, rho_NxT, kl, use_bias_correction_kl)
    if normalizer is None:
        normalizer = loss_normalizer(real_NxT, aggregation, max_len=max_len, axis_name=axis_name)
    total = functools.partial(aggregate, mask=real_NxT, aggregation=aggregation, max_len=max_len,
                              normalizer=normalizer, axis_name=axis_name)
    loss = -total(surrogate_NxT - beta * kl_NxT)
    metrics = {"policy_loss": -total(jax.lax.stop_gradient(surrogate_NxT)),
               **_loss_metrics(kl_NxT, rho_NxT, adv_NxT, real_NxT, eps_low, eps_high, axis_name)}
    if surrogate is not None:  # the clip fractions describe PPO's clip only
        metrics = {k: v for k, v in metrics.items() if not k.startswith("clip_ratio/")}
        metrics.update(jax.lax.stop_gradient(surrogate_metrics))
    return loss, metrics


def _advantages_NxT(logp, old_logp, ref_logp, advantages, mask, beta) -> jax.Array:
    """Checks `grpo_loss`'s input shapes (logp [N, T] sets them) and returns the advantages as
    float32 [N, T], an [N] vector broadcast along the tokens."""
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
    return adv_NxT


def _policy_term(
    logp, old_logp, adv_NxT, mask, rho_NxT, eps_low, eps_high, is_weights, surrogate, axis_name
) -> tuple[jax.Array, dict[str, jax.Array] | None]:
    """(j_NxT, surrogate metrics): the per-token policy objective before the KL term, weighted by
    the sampler correction; PPO's clipped term (metrics None) or the `surrogate` family's."""
    if surrogate is not None:
        return surrogate(logp, old_logp, adv_NxT, mask, is_weights=is_weights, axis_name=axis_name)
    surrogate_NxT = clipped_surrogate(rho_NxT, adv_NxT, eps_low, eps_high)
    if is_weights is not None:
        surrogate_NxT = surrogate_NxT * jax.lax.stop_gradient(jnp.asarray(is_weights, jnp.float32))
    return surrogate_NxT, None


def _kl_term(logp, ref_logp, real_NxT, rho_NxT, kind: KLKind, use_bias_correction_kl: bool) -> jax.Array:
    """KL_NxT, the per-token KL estimate of `grpo_loss` (zeros without ref_logp), times rho with
    TRL's use_bias_correction_kl."""
    if ref_logp is None:
        return jnp.zeros(logp.shape, jnp.float32)
    # Same padding guard as in importance_ratio: exp of garbage on padding must not reach
    # the gradient.
    kl_NxT = kl_penalty(
        jnp.where(real_NxT, logp.astype(jnp.float32), 0.0),
        jnp.where(real_NxT, jnp.asarray(ref_logp, jnp.float32), 0.0),
        kind,
    )
    if use_bias_correction_kl:
        kl_NxT = kl_NxT * rho_NxT
    return kl_NxT


def _loss_metrics(
    kl_NxT, rho_NxT, adv_NxT, real_NxT, eps_low, eps_high, axis_name
) -> dict[str, jax.Array]:
    """TRL-named float32 scalar metrics of one loss evaluation; see `grpo_loss`."""
    sg = jax.lax.stop_gradient
    kl_NxT, rho_NxT = sg(kl_NxT), sg(rho_NxT)
    below_NxT = rho_NxT < 1.0 - eps_low
    above_NxT = rho_NxT > 1.0 + eps_high
    f32 = lambda b: b.astype(jnp.float32)  # noqa: E731
    mean = functools.partial(token_mean, real_NxT=real_NxT, axis_name=axis_name)
    return {
        "kl": mean(kl_NxT),
        "clip_ratio/low_mean": mean(f32(below_NxT & (adv_NxT < 0))),
        "clip_ratio/high_mean": mean(f32(above_NxT & (adv_NxT > 0))),
        "clip_ratio/region_mean": mean(f32(below_NxT | above_NxT)),
        "ratio/mean": mean(rho_NxT),
        "ratio/min": token_min(rho_NxT, real_NxT, axis_name, 1.0),
        "ratio/max": token_max(rho_NxT, real_NxT, axis_name, 1.0),
    }
