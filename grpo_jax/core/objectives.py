"""Policy objectives beyond PPO's clip, as pure per-token terms that `losses.grpo_loss` aggregates.

Each `*_terms(logp, old_logp, adv, mask, ...)` returns j_{i,t}, the per-token objective to
maximise (float32 [N, T], padding may hold anything), and its metrics. `policy_loss` passes them
to `grpo_loss` (its `surrogate=` hook), so every family shares grpo_loss's KL term, aggregation
and exact normaliser: micro-batches over the whole batch's `loss_normalizer` add up to the full
batch's loss and gradient, as for GRPO. Shapes: N answers, T token columns; `adv` [N, T].

The families, by their trainer names (TRL's `loss_type` where TRL has the family, verl's
`loss_mode` otherwise; r = pi_theta / pi_old per token, A the advantage, sg stop-gradient):

  grpo, bnpo, dapo, dr_grpo  PPO's min(r A, clip(r) A); aggregations "sequence", "token",
                             "token", "constant" (bnpo is dapo here: normalisers are global).
  gspo                       the same on GSPO's sequence ratio s_i (`importance_ratio`).
  luspo                      GSPO's term summed over an answer's tokens (length-unbiased).
  cispo   `cispo_terms`      sg(clip(r)) A log pi.
  sapo    `sapo_terms`       (4 / tau) sigmoid(tau (r - 1)) A.
  vespo   `vespo_terms`      sg(phi(w_i)) A log pi, phi a Gamma-shaped weight of the answer's ratio.
  geo_mean `gmpo_terms`      GMPO: A_i times the geometric mean of the answer's clipped ratios.
  dppo_tv, dppo_kl `dppo_terms`  sg(min(r, C)) A log pi on tokens inside a divergence trust region.
  gpg     `gpg_terms`        A log pi.
  clip_cov, kl_cov `clip_cov_terms`, `kl_cov_terms`  PPO's term with the gradient of a few
                             high-covariance tokens detached, or a |log r| penalty on them.

At r = 1 (pi_old read in the loss) each term's gradient is the plain policy gradient A grad log pi
(Clip-Cov: on the tokens it keeps), also with eps_low = 0 or eps_high = 0: clips and ties pass
the whole gradient (`losses.clip_passing_gradient`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from grpo_jax.core import losses

LossType = Literal["grpo", "bnpo", "dapo", "dr_grpo", "gspo", "luspo", "cispo", "sapo", "vespo", "geo_mean",
                   "dppo_tv", "dppo_kl", "gpg", "clip_cov", "kl_cov"]

# loss_type -> (aggregation it implies, whether that aggregation is fixed, ratio it needs or None: any).
# TRL's families fix their aggregation (TRL hard-codes it per loss_type); verl's take `loss_agg_mode`,
# default "token-mean", except GMPO whose loss is a mean over answers whatever the mode.
LOSS_TYPES: dict[str, tuple[str, bool, str | None]] = {
    "grpo": ("sequence", True, None),
    "bnpo": ("token", True, None),
    "dapo": ("token", True, None),
    "dr_grpo": ("constant", True, None),
    "gspo": ("sequence", False, "sequence"),
    "luspo": ("sequence_sum", True, "sequence"),
    "cispo": ("token", True, None),
    "sapo": ("sequence", True, None),
    "vespo": ("token", True, "token"),
    "geo_mean": ("sequence", True, "token"),
    "dppo_tv": ("token", False, "token"),
    "dppo_kl": ("token", False, "token"),
    "gpg": ("token", False, "token"),
    "clip_cov": ("token", False, "token"),
    "kl_cov": ("token", False, "token"),
}
# Families that are PPO's clipped term (grpo_loss without a surrogate).
CLIP_FAMILIES = ("grpo", "bnpo", "dapo", "dr_grpo", "gspo", "luspo")

_LOG_1E_8 = math.log(1e-8)  # VESPO's lower bound on log w (TRL's, from the paper's code)


def _token_mean(x_NxT, real_NxT, axis_name):
    count = losses._psum(real_NxT.sum().astype(jnp.float32), axis_name)
    return losses._psum(jnp.where(real_NxT, x_NxT, 0.0).sum(), axis_name) / jnp.maximum(count, 1.0)


def _log_ratio(logp, old_logp, real_NxT, clamp: float | None = None):
    """log r on real tokens (0 on padding, which may hold garbage), optionally clamped to +-clamp."""
    lr = jnp.where(real_NxT, jnp.asarray(logp, jnp.float32), 0.0) - jnp.where(
        real_NxT, jnp.asarray(old_logp, jnp.float32), 0.0)
    return lr if clamp is None else losses.clip_passing_gradient(lr, -clamp, clamp)


def _weighted(j_NxT, is_weights):
    return j_NxT if is_weights is None else j_NxT * jax.lax.stop_gradient(jnp.asarray(is_weights, jnp.float32))


def _logp(logp, real_NxT):
    return jnp.where(real_NxT, jnp.asarray(logp, jnp.float32), 0.0)


def cispo_terms(logp, old_logp, adv, mask, *, eps_low=0.2, eps_high=None, ratio="token", is_weights=None,
                axis_name=None):
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update.

      J = sum_{i,t} sg(clip(r_{i,t}, 1 - eps_low, 1 + eps_high)) A_{i,t} log pi_theta(o_{i,t})
          / sum_i |o_i|        (aggregation "token")

    Every token keeps a gradient (PPO's clip zeroes it); the weight only bounds its size. TRL's
    `epsilon_high=E` (a bare max, ScaleRL's eps_max = 5) is eps_low >= 1 (no lower bound) and
    eps_high = E - 1 here; verl's band [1 - eps_low, 1 + eps_high] is these arguments as they are.
    Metric `cispo_clip_ratio` (TRL): token fraction with r > 1 + eps_high and A > 0.
    """
    eps_high = eps_low if eps_high is None else eps_high
    real_NxT = jnp.asarray(mask) != 0
    rho_NxT = losses.importance_ratio(logp, old_logp, mask, ratio)
    weight_NxT = jax.lax.stop_gradient(losses.clip_passing_gradient(rho_NxT, 1.0 - eps_low, 1.0 + eps_high))
    j_NxT = _weighted(weight_NxT * adv * _logp(logp, real_NxT), is_weights)
    clipped = ((rho_NxT > 1.0 + eps_high) & (adv > 0)).astype(jnp.float32)
    return j_NxT, {"cispo_clip_ratio": _token_mean(jax.lax.stop_gradient(clipped), real_NxT, axis_name)}


def sapo_terms(logp, old_logp, adv, mask, *, temperature_pos=1.0, temperature_neg=1.05, ratio="token",
               is_weights=None, axis_name=None):
    """SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347): a smooth gate instead of a clip.

      j_{i,t} = f(r_{i,t}) A_{i,t},  f(r) = (4 / tau) sigmoid(tau (r - 1)),
      tau = temperature_pos where A > 0, temperature_neg otherwise (TRL's sapo_temperature_*).

    f(1) = 2 / tau and f'(1) = 1: on-policy it is the policy gradient; far off-policy the gate's
    slope tau sigmoid'(.) decays smoothly to 0. Aggregation "sequence" (TRL and verl).
    """
    rho_NxT = losses.importance_ratio(logp, old_logp, mask, ratio)
    tau_NxT = jnp.where(adv > 0, temperature_pos, temperature_neg)
    gate_NxT = jax.nn.sigmoid(tau_NxT * (rho_NxT - 1.0)) * (4.0 / tau_NxT)
    return _weighted(gate_NxT * adv, is_weights), {}


def vespo_terms(logp, old_logp, adv, mask, *, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0,
                is_weights=None, axis_name=None):
    """VESPO (Variational Sequence-level Soft Policy Optimization, arXiv 2602.10693).

      j_{i,t} = sg(phi(w_i)) A_{i,t} log pi_theta(o_{i,t}),  phi(w) = e^lambda w^k e^(-lambda w),
      w_i = prod_t r_{i,t} (times pi_old / pi_sampler with `is_weights`), in log space:
      log w_i = clamp(sum_t clamp(log r_{i,t}, +-20) + sum_t log is_w, log 1e-8, 20) (TRL's bounds),
      (k, lambda) = (k_pos, lambda_pos) where A >= 0, (k_neg, lambda_neg) otherwise.

    phi(1) = 1 and phi peaks at w = k / lambda, decaying towards w = 0 and w -> inf: answers far
    off-policy lose weight smoothly. The sampler weights enter phi and nothing else (TRL), so do not
    also multiply them in. Aggregation "token". Metric `vespo/phi_seq_mean`: mean of phi over
    answers with a real token.
    """
    real_NxT = jnp.asarray(mask) != 0
    sg = jax.lax.stop_gradient
    log_w_N = _log_ratio(sg(logp), old_logp, real_NxT, clamp=20.0).sum(axis=1)
    if is_weights is not None:
        log_is_NxT = jnp.clip(jnp.log(sg(jnp.asarray(is_weights, jnp.float32))), _LOG_1E_8, 20.0)
        log_w_N = log_w_N + jnp.where(real_NxT, jnp.broadcast_to(log_is_NxT, real_NxT.shape), 0.0).sum(axis=1)
    log_w_Nx1 = jnp.clip(log_w_N, _LOG_1E_8, 20.0)[:, None]
    k_NxT = jnp.where(adv >= 0, k_pos, k_neg)
    lam_NxT = jnp.maximum(jnp.where(adv >= 0, lambda_pos, lambda_neg), 1e-4)
    phi_NxT = jnp.exp(lam_NxT + k_NxT * log_w_Nx1 - lam_NxT * jnp.exp(log_w_Nx1))
    phi_NxT = sg(jnp.nan_to_num(phi_NxT, nan=0.0, posinf=0.0, neginf=0.0))
    j_NxT = phi_NxT * adv * _logp(logp, real_NxT)
    has_N = real_NxT.any(axis=1)
    phi_sum = losses._psum(jnp.where(has_N, phi_NxT[:, 0], 0.0).sum(), axis_name)
    answers = losses._psum(has_N.sum().astype(jnp.float32), axis_name)
    return j_NxT, {"vespo/phi_seq_mean": phi_sum / jnp.maximum(answers, 1.0)}


def gmpo_terms(logp, old_logp, adv, mask, *, eps_low=0.4, eps_high=None, is_weights=None, axis_name=None):
    """GMPO (Geometric-Mean Policy Optimization, arXiv 2507.20673; verl `geo_mean`).

      J = (1/N) sum_i A_i exp((1/|o_i|) sum_t l_{i,t}),  A_i = mean_t A_{i,t},
      l = sgn(A) min(sgn(A) log r, sgn(A) clamp(log r, -eps_low, eps_high)),

    the geometric mean of the answer's token ratios, each clipped in log space on the side that
    would increase sgn(A) r. Returned as that per-answer value on each of its tokens, which the
    "sequence" aggregation turns into the mean over answers (the only one GMPO has). With
    `is_weights`, the answer is weighted by their geometric mean (verl). The paper uses
    eps = 0.4 (a ratio band [e^-0.4, e^0.4]). Metrics (verl): `actor/pg_clipfrac` (clipped
    tokens with A > 0), `actor/pg_clipfrac_lower` (with A < 0).
    """
    eps_high = eps_low if eps_high is None else eps_high
    real_NxT = jnp.asarray(mask) != 0
    length_N = jnp.maximum(real_NxT.sum(axis=1).astype(jnp.float32), 1.0)
    lr_NxT = _log_ratio(logp, old_logp, real_NxT)
    clamped_NxT = losses.clip_passing_gradient(lr_NxT, -eps_low, eps_high)
    sign_NxT = jnp.sign(adv)
    # Ties (inside the band, or sgn(A) = 0) keep the unclipped log-ratio and its whole gradient.
    l_NxT = jnp.where(sign_NxT * lr_NxT <= sign_NxT * clamped_NxT, lr_NxT, clamped_NxT)
    geo_N = jnp.exp(jnp.where(real_NxT, l_NxT, 0.0).sum(axis=1) / length_N)
    adv_N = jnp.where(real_NxT, adv, 0.0).sum(axis=1) / length_N
    value_N = adv_N * geo_N
    if is_weights is not None:
        log_w_NxT = jnp.log(jax.lax.stop_gradient(jnp.broadcast_to(jnp.asarray(is_weights, jnp.float32),
                                                                   real_NxT.shape)))
        value_N = value_N * jnp.exp(jnp.where(real_NxT, log_w_NxT, 0.0).sum(axis=1) / length_N)
    clipped = jax.lax.stop_gradient(lr_NxT != clamped_NxT)
    metrics = {
        "actor/pg_clipfrac": _token_mean((clipped & (adv > 0)).astype(jnp.float32), real_NxT, axis_name),
        "actor/pg_clipfrac_lower": _token_mean((clipped & (adv < 0)).astype(jnp.float32), real_NxT, axis_name),
    }
    return jnp.broadcast_to(value_N[:, None], real_NxT.shape), metrics


def dppo_terms(logp, old_logp, adv, mask, *, divergence="tv", eps_low=0.2, eps_high=None, clip_ratio_c=3.0,
               is_weights=None, axis_name=None):
    """DPPO (Divergence PPO, arXiv 2602.04879; verl `dppo_tv`, `dppo_kl`): a trust region on the
    sampled token's probability instead of on the ratio.

      j_{i,t} = sg(min(r_{i,t}, C)) A_{i,t} log pi_theta(o_{i,t}) * valid_{i,t},
      "tv": valid = p - p_old <= eps_high where A > 0, p - p_old >= -eps_low otherwise;
      "kl": D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p)) (the binary KL, 1e-8
            inside the second log as verl), valid = D <= eps_high or p <= p_old where A > 0,
            D <= eps_low or p >= p_old otherwise;

    p = pi_theta(o_{i,t}), p_old = pi_old(o_{i,t}), C = clip_ratio_c (verl's name; truncated IS).
    A token that moved too far in the direction its advantage pushes gets no gradient. verl's
    defaults: thresholds = its clip_ratio (0.2), C = 3. Metrics (verl): `actor/pg_clipfrac`
    (token fraction outside the region), `actor/pg_clipfrac_lower` (inside it with r > C).
    """
    if divergence not in ("tv", "kl"):
        raise ValueError(f"divergence must be 'tv' or 'kl', got {divergence!r}")
    eps_high = eps_low if eps_high is None else eps_high
    real_NxT = jnp.asarray(mask) != 0
    sg = jax.lax.stop_gradient
    lr_NxT = sg(_log_ratio(logp, old_logp, real_NxT, clamp=20.0))
    rho_NxT = jnp.exp(lr_NxT)
    p_NxT, p_old_NxT = jnp.exp(sg(_logp(logp, real_NxT))), jnp.exp(_logp(old_logp, real_NxT))
    if divergence == "tv":
        valid_pos, valid_neg = p_NxT - p_old_NxT <= eps_high, p_NxT - p_old_NxT >= -eps_low
    else:
        log_p_old, log_p = _logp(old_logp, real_NxT), sg(_logp(logp, real_NxT))
        kl_NxT = p_old_NxT * (log_p_old - log_p) + (1.0 - p_old_NxT) * jnp.log(
            (1.0 - p_old_NxT + 1e-8) / (1.0 - p_NxT + 1e-8))
        valid_pos = (kl_NxT <= eps_high) | (p_NxT <= p_old_NxT)
        valid_neg = (kl_NxT <= eps_low) | (p_NxT >= p_old_NxT)
    valid_NxT = jnp.where(adv > 0, valid_pos, valid_neg)
    weight_NxT = jnp.where(valid_NxT, jnp.minimum(rho_NxT, clip_ratio_c), 0.0)
    j_NxT = _weighted(weight_NxT * adv * _logp(logp, real_NxT), is_weights)
    f32 = lambda b: b.astype(jnp.float32)  # noqa: E731
    return j_NxT, {
        "actor/pg_clipfrac": _token_mean(f32(~valid_NxT), real_NxT, axis_name),
        "actor/pg_clipfrac_lower": _token_mean(f32(valid_NxT & (rho_NxT > clip_ratio_c)), real_NxT, axis_name),
    }


def gpg_terms(logp, old_logp, adv, mask, *, is_weights=None, axis_name=None):
    """GPG (Group Policy Gradient, arXiv 2504.02546): the plain policy gradient, no ratio or clip.

      j_{i,t} = A_{i,t} log pi_theta(o_{i,t})   (verl's `gpg`; old_logp is not used).
    """
    real_NxT = jnp.asarray(mask) != 0
    return _weighted(adv * _logp(logp, real_NxT), is_weights), {}


def _top_k_mask(score_NxT, eligible_NxT, k):
    """The (at most) k eligible positions of largest score; k a traced int. Ties at the k-th value
    are all kept (probability 0 for random scores)."""
    flat = jnp.where(eligible_NxT, score_NxT, -jnp.inf).ravel()
    kth = jnp.sort(flat)[::-1][jnp.clip(k - 1, 0, flat.size - 1)]
    return eligible_NxT & (score_NxT >= kth) & (k > 0)


def _covariance(adv, logp, real_NxT):
    """(A - mean A)(log pi - mean log pi) per token, means over this call's real tokens (verl's
    centring: one micro-batch), no gradient; the selection statistic of Clip-Cov and KL-Cov."""
    lp = jax.lax.stop_gradient(_logp(logp, real_NxT))
    a = jnp.where(real_NxT, adv, 0.0)
    return (a - _token_mean(a, real_NxT, None)) * (lp - _token_mean(lp, real_NxT, None))


def _count_k(ratio, real_NxT):
    """max(floor(ratio * real tokens), 1) as verl (0 when there are none)."""
    n = real_NxT.sum().astype(jnp.float32)
    return jnp.where(n > 0, jnp.maximum(jnp.floor(ratio * n), 1.0), 0.0).astype(jnp.int32)


def clip_cov_terms(logp, old_logp, adv, mask, *, eps_low=0.2, eps_high=None, clip_cov_ratio=0.0002,
                   clip_cov_lb=1.0, clip_cov_ub=5.0, key=None, is_weights=None, axis_name=None):
    """Clip-Cov (Cui et al., "The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617).

      j_{i,t} = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) * (0 on the selected tokens),
      Cov_{i,t} = (A_{i,t} - mean A)(log pi(o_{i,t}) - mean log pi) over the real tokens,
      selected: max(floor(clip_cov_ratio * real tokens), 1) tokens drawn at random (`key`) among
      those PPO does not clip already with clip_cov_lb < Cov < clip_cov_ub.

    High-covariance tokens drive entropy collapse; detaching a few keeps entropy up. The draw, the
    means and the count are over the rows of this call (verl: one micro-batch), so unlike the other
    families two micro-batches need not draw what one batch would. `key` None: PRNG key 0.
    Metric (verl): `actor/pg_clipfrac`, token fraction detached.
    """
    eps_high = eps_low if eps_high is None else eps_high
    real_NxT = jnp.asarray(mask) != 0
    rho_NxT = losses.importance_ratio(logp, old_logp, mask)
    a = jnp.asarray(adv, jnp.float32)
    rho_sg = jax.lax.stop_gradient(rho_NxT)
    clipped_by_ppo = losses.clip_passing_gradient(rho_sg, 1.0 - eps_low, 1.0 + eps_high) * a < rho_sg * a
    cov_NxT = _covariance(a, logp, real_NxT)
    candidate = real_NxT & ~clipped_by_ppo & (cov_NxT > clip_cov_lb) & (cov_NxT < clip_cov_ub)
    key = jax.random.key(0) if key is None else key
    selected = _top_k_mask(jax.random.uniform(key, real_NxT.shape), candidate, _count_k(clip_cov_ratio, real_NxT))
    j_NxT = jnp.where(selected, 0.0, losses.clipped_surrogate(rho_NxT, a, eps_low, eps_high))
    return _weighted(j_NxT, is_weights), {
        "actor/pg_clipfrac": _token_mean(selected.astype(jnp.float32), real_NxT, axis_name)}


def kl_cov_terms(logp, old_logp, adv, mask, *, kl_cov_ratio=0.0002, ppo_kl_coef=0.1, is_weights=None,
                 axis_name=None):
    """KL-Cov (Cui et al., arXiv 2505.22617): a KL penalty on the highest-covariance tokens.

      j_{i,t} = r A - ppo_kl_coef |log r| on the max(floor(kl_cov_ratio * real tokens), 1) tokens
      of largest Cov (as in `clip_cov_terms`), r A elsewhere (no clip).

    |log r| has gradient 0 at r = 1 (as torch's abs), so on-policy this is the policy gradient.
    Selection over this call's rows, as Clip-Cov. verl's defaults: ratio 0.0002, coefficient 0.1.
    Metric (verl): `actor/ppo_kl`, mean |log r| over real tokens.
    """
    real_NxT = jnp.asarray(mask) != 0
    a = jnp.asarray(adv, jnp.float32)
    lr_NxT = _log_ratio(logp, old_logp, real_NxT)
    abs_lr_NxT = jnp.sign(lr_NxT) * lr_NxT  # |x| whose derivative at 0 is 0, not jnp.abs's 1
    selected = _top_k_mask(_covariance(a, logp, real_NxT), real_NxT, _count_k(kl_cov_ratio, real_NxT))
    j_NxT = jnp.exp(lr_NxT) * a - jnp.where(selected, ppo_kl_coef * abs_lr_NxT, 0.0)
    return _weighted(j_NxT, is_weights), {
        "actor/ppo_kl": _token_mean(jax.lax.stop_gradient(abs_lr_NxT), real_NxT, axis_name)}


def resolve_loss_type(loss_type: str, aggregation: str | None = None, ratio: str | None = None) -> tuple[str, str]:
    """(aggregation, ratio) a loss_type runs with, given the caller's (None: the family's).

    Raises ValueError naming both settings where they conflict: a family with a fixed aggregation
    (TRL's loss types, GMPO) given another, or a family defined on one ratio given the other.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not one of {sorted(LOSS_TYPES)}")
    implied, fixed, needs_ratio = LOSS_TYPES[loss_type]
    if aggregation is not None and aggregation != implied and fixed:
        raise ValueError(f"loss_type={loss_type!r} aggregates as {implied!r}, but aggregation={aggregation!r}; "
                         "drop one of the two")
    if ratio is not None and needs_ratio is not None and ratio != needs_ratio:
        raise ValueError(f"loss_type={loss_type!r} needs ratio={needs_ratio!r}, but ratio={ratio!r}; "
                         "drop one of the two")
    return aggregation or implied, ratio or needs_ratio or "token"


def surrogate_for(loss_type: str, *, eps_low: float = 0.2, eps_high: float | None = None, ratio: str = "token",
                  key: jax.Array | None = None, **options: Any) -> Callable | None:
    """The `surrogate=` argument of `losses.grpo_loss` for a loss_type: None for PPO's clipped term
    (the CLIP_FAMILIES), else `f(logp, old_logp, adv_NxT, mask, *, is_weights, axis_name) ->
    (j_NxT, metrics)`. `options` are the families' own (TRL/verl names): sapo_temperature_pos,
    sapo_temperature_neg, vespo_{k,lambda}_{pos,neg}, clip_ratio_c, clip_cov_ratio, clip_cov_lb,
    clip_cov_ub, kl_cov_ratio, ppo_kl_coef; options of other families are ignored."""
    o = options
    eps = dict(eps_low=eps_low, eps_high=eps_high)
    match loss_type:
        case "grpo" | "bnpo" | "dapo" | "dr_grpo" | "gspo" | "luspo":
            return None
        case "cispo":
            return functools.partial(cispo_terms, ratio=ratio, **eps)
        case "sapo":
            return functools.partial(sapo_terms, ratio=ratio, temperature_pos=o.get("sapo_temperature_pos", 1.0),
                                     temperature_neg=o.get("sapo_temperature_neg", 1.05))
        case "vespo":
            return functools.partial(vespo_terms, **{k: o.get(f"vespo_{k}", d) for k, d in (
                ("k_pos", 2.0), ("lambda_pos", 3.0), ("k_neg", 3.0), ("lambda_neg", 2.0))})
        case "geo_mean":
            return functools.partial(gmpo_terms, **eps)
        case "dppo_tv" | "dppo_kl":
            return functools.partial(dppo_terms, divergence=loss_type[5:], clip_ratio_c=o.get("clip_ratio_c", 3.0),
                                     **eps)
        case "gpg":
            return gpg_terms
        case "clip_cov":
            return functools.partial(clip_cov_terms, key=key, **eps, **{k: o[k] for k in (
                "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub") if k in o})
        case "kl_cov":
            return functools.partial(kl_cov_terms, **{k: o[k] for k in ("kl_cov_ratio", "ppo_kl_coef") if k in o})
        case _:
            raise ValueError(f"loss_type={loss_type!r} is not one of {sorted(LOSS_TYPES)}")


def policy_loss(logp, old_logp, ref_logp, advantages, mask, *, loss_type: str = "grpo", eps_low: float = 0.2,
                eps_high: float | None = None, beta: float = 0.04, kl: losses.KLKind = "k3",
                aggregation: str | None = None, max_len: int | None = None, ratio: str | None = None,
                normalizer=None, axis_name: str | None = None, is_weights=None, key=None, **options):
    """The loss -J of any family above: `losses.grpo_loss` with the family's surrogate, aggregation
    and ratio (`resolve_loss_type`). Arguments as grpo_loss's (shapes [N, T], advantages [N] or
    [N, T]); `key` is Clip-Cov's draw; `options` see `surrogate_for`. Pass the whole batch's
    `losses.loss_normalizer(mask, aggregation)` as `normalizer` to accumulate micro-batches exactly.

    Returns (loss, metrics): grpo_loss's metrics (`clip_ratio/*` only for the clipped families)
    plus the family's own (TRL / verl names).
    """
    aggregation, ratio = resolve_loss_type(loss_type, aggregation, ratio)
    surrogate = surrogate_for(loss_type, eps_low=eps_low, eps_high=eps_high, ratio=ratio, key=key, **options)
    return losses.grpo_loss(logp, old_logp, ref_logp, advantages, mask, eps_low=eps_low, eps_high=eps_high,
                            beta=beta, kl=kl, aggregation=aggregation, max_len=max_len, ratio=ratio,
                            normalizer=normalizer, axis_name=axis_name, is_weights=is_weights, surrogate=surrogate)
