"""Advantage estimators besides GRPO's: RLOO, REINFORCE++ (and its group-baseline variant), GDPO,
OPO and pass@k, each a pure function of one step's rewards, with verl's names.

Same layout as `grpo_jax.core.advantages`: consecutive blocks of `group_size` rows answer one prompt, a
group never spans devices, and only whole-batch statistics take `axis_name`. A NaN reward means "no
reward function applied": the row is left out of every statistic and gets advantage 0. Every
function returns one float32 advantage per answer, [N]; the loss broadcasts it over the answer's
tokens. (verl's REINFORCE++ writes per-token discounted returns; with its default gamma = 1 they are
the answer's reward on every token, which is what these functions compute.)

`estimator_advantages` selects one by its verl `adv_estimator` name ("grpo" is
`advantages.group_advantages`, unchanged).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from grpo_jax.core.advantages import _check_group_size, _group_stats, _psum, group_advantages

AdvEstimator = Literal[
    "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gdpo", "opo", "grpo_passk"
]
ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gdpo", "opo",
                  "grpo_passk")

# verl's masked_whiten: (x - mean) * rsqrt(var + 1e-8).
_WHITEN_EPS = 1e-8


def _grouped(rewards, group_size: int, name: str = "rewards") -> tuple[jax.Array, jax.Array]:
    """rewards [N] -> (r_MxG float32, valid_MxG bool: not NaN)."""
    (num_rows,) = jnp.shape(rewards)
    _check_group_size(num_rows, group_size, name)
    r_MxG = jnp.asarray(rewards, jnp.float32).reshape(num_rows // group_size, group_size)
    return r_MxG, ~jnp.isnan(r_MxG)


def _check_lengths(lengths, num_rows: int) -> jax.Array:
    if jnp.shape(lengths) != (num_rows,):
        raise ValueError(f"lengths has shape {jnp.shape(lengths)}, expected ({num_rows},): one token count "
                         "per answer")
    return jnp.asarray(lengths, jnp.float32)


def rloo_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv 2402.14740; verl `rloo`).

    A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean_group(r)), over the n scored answers of
    the group. A group with a single scored answer has no baseline: A_i = r_i (as verl).
    Example: r = (1, 0, 0, 1): mean of the others is 1/3 for a 1 and 2/3 for a 0, so
    A = (2/3, -2/3, -2/3, 2/3), i.e. 4/3 * (r - 1/2).

    Args:
      rewards: [N], consecutive blocks of `group_size` answers per prompt; NaN: not scored.
      group_size: G (static Python int).

    Returns:
      advantages_N float32.
    """
    r_MxG, valid_MxG = _grouped(rewards, group_size)
    n_M = valid_MxG.sum(axis=1).astype(jnp.float32)
    mean_M, _, constant_M = _group_stats(r_MxG, valid_MxG, ddof=1)
    loo_MxG = (r_MxG - mean_M[:, None]) * (n_M / jnp.maximum(n_M - 1.0, 1.0))[:, None]
    adv_MxG = jnp.where((n_M > 1)[:, None], jnp.where(constant_M[:, None], 0.0, loo_MxG), r_MxG)
    return jnp.where(valid_MxG, adv_MxG, 0.0).reshape(-1)


def opo_advantages(rewards: jax.Array, lengths: jax.Array, group_size: int) -> jax.Array:
    """On-Policy RL with Optimal reward baseline (Hao et al. 2025, arXiv 2505.23585; verl `opo`).

    A_i = r_i - b with the length-weighted group baseline b = sum_j |o_j| r_j / sum_j |o_j|, the
    variance-minimising baseline when the gradient norm grows with length. A group with a single
    scored answer (or no tokens) has b = 0 (as verl). Example: r = (1, 0), lengths (1, 3):
    b = (1 * 1 + 3 * 0) / 4 = 0.25, A = (0.75, -0.25).

    Args:
      rewards: [N]; NaN: not scored.
      lengths: [N] completion tokens of each answer (the loss's real tokens).
      group_size: G (static Python int).

    Returns:
      advantages_N float32.
    """
    r_MxG, valid_MxG = _grouped(rewards, group_size)
    len_MxG = jnp.where(valid_MxG, _check_lengths(lengths, r_MxG.size).reshape(r_MxG.shape), 0.0)
    n_M = valid_MxG.sum(axis=1)
    weight_M = len_MxG.sum(axis=1)
    weighted_M = (len_MxG * jnp.where(valid_MxG, r_MxG, 0.0)).sum(axis=1)
    b_M = jnp.where((n_M > 1) & (weight_M > 0), weighted_M / jnp.maximum(weight_M, 1.0), 0.0)
    return jnp.where(valid_MxG, r_MxG - b_M[:, None], 0.0).reshape(-1)


def _token_whiten(x_N: jax.Array, tokens_N: jax.Array, axis_name: str | None) -> jax.Array:
    """(x - mu) / sqrt(var + 1e-8), mu and var (Bessel) over every token of the (global) batch, each
    answer's x counted once per token (verl's masked_whiten of a per-token tensor that is constant
    along each answer). Rows without tokens get 0, and so does a batch whose values are all equal."""
    has_N = tokens_N > 0
    total = _psum(tokens_N.sum(), axis_name)
    mean = _psum((tokens_N * jnp.where(has_N, x_N, 0.0)).sum(), axis_name) / jnp.maximum(total, 1.0)
    sq = _psum((tokens_N * jnp.where(has_N, x_N - mean, 0.0) ** 2).sum(), axis_name)
    var = sq / jnp.maximum(total - 1.0, 1.0)
    hi, lo = jnp.where(has_N, x_N, -jnp.inf).max(), jnp.where(has_N, x_N, jnp.inf).min()
    if axis_name is not None:
        hi, lo = jax.lax.pmax(hi, axis_name), jax.lax.pmin(lo, axis_name)
    # Exact test (see advantages._group_stats): equal values must give 0, not an ulp times 1e4.
    white_N = jnp.where(hi == lo, 0.0, (x_N - mean) * jax.lax.rsqrt(var + _WHITEN_EPS))
    return jnp.where(has_N, white_N, 0.0)


def reinforce_plus_plus_advantages(
    rewards: jax.Array,
    lengths: jax.Array,
    group_size: int,
    *,
    baseline: bool = False,
    axis_name: str | None = None,
) -> jax.Array:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262; verl `reinforce_plus_plus`, `..._baseline`).

    Outcome reward, gamma = 1: every token of answer i has return x_i = r_i (`baseline=False`), or
    x_i = r_i - mean_group(r) (`baseline=True`, REINFORCE++-baseline: the group mean removes the
    prompt's difficulty). Then the returns are whitened over all tokens of the global batch:
    A_i = (x_i - mu) / sqrt(var + 1e-8), mu and var (unbiased) over tokens, so a long answer weighs
    |o_i| times in the statistics. Example: r = (1, 0), lengths (1, 3), no baseline: the tokens hold
    (1, 0, 0, 0), mu = 0.25, var = (0.5625 + 3 * 0.0625) / 3 = 0.25, A = (1.5, -0.5).

    Args:
      rewards: [N]; NaN: not scored (left out, advantage 0).
      lengths: [N] completion tokens of each answer; rows with 0 tokens are left out.
      group_size: G (static Python int), for the baseline's groups.
      baseline: subtract the group mean first.
      axis_name: mapped axis the batch is split over (shard_map/pmap): global token statistics.

    Returns:
      advantages_N float32.
    """
    r_MxG, valid_MxG = _grouped(rewards, group_size)
    tokens_N = jnp.where(valid_MxG.reshape(-1), _check_lengths(lengths, r_MxG.size), 0.0)
    if baseline:
        mean_M, _, _ = _group_stats(r_MxG, valid_MxG, ddof=1)
        n_M = valid_MxG.sum(axis=1)
        # verl: a group of one answer has mean 0 (no baseline).
        x_MxG = r_MxG - jnp.where(n_M > 1, mean_M, 0.0)[:, None]
    else:
        x_MxG = r_MxG
    return _token_whiten(jnp.where(valid_MxG, x_MxG, 0.0).reshape(-1), tokens_N, axis_name)


def gdpo_advantages(
    rewards_per_func: jax.Array,
    group_size: int,
    *,
    weights: jax.Array | None = None,
    eps: float = 1e-4,
    axis_name: str | None = None,
) -> jax.Array:
    """GDPO, group reward-decoupled normalisation (arXiv 2601.05242; verl `gdpo`, TRL
    `multi_objective_aggregation="normalize_then_sum"`).

    Each reward function k is normalised in its group on its own,
    r~_{i,k} = (r_{i,k} - mean_group(r_k)) / (std_group(r_k) + eps), so a function with a wide
    range cannot drown the others; then s_i = sum_k w_k r~_{i,k} and A_i = (s_i - mean(s)) /
    (std(s) + eps) over the (global) batch (sample stds, ddof 1). NaN values (not applicable) are left
    out of their function's statistics and add 0 to s; a row where every function is NaN gets 0.
    A function whose group values are all equal contributes 0 there.
    Example, one group of two, correctness (1, 0) and format (1, 1): r~ = (0.707, -0.707) and (0, 0)
    (std 0.707), s = (0.707, -0.707), A = (0.707, -0.707) (batch std 1).

    Args:
      rewards_per_func: [N, K] raw rewards of the K functions (NaN: not applicable).
      group_size: G (static Python int).
      weights: [K] weight of each function; None: all 1.
      eps: added to both stds.
      axis_name: mapped axis the batch is split over: global batch statistics.

    Returns:
      advantages_N float32.
    """
    r_NxK = jnp.asarray(rewards_per_func, jnp.float32)
    if r_NxK.ndim != 2:
        raise ValueError(f"rewards_per_func must be [N, K], got shape {r_NxK.shape}")
    num_rows, num_funcs = r_NxK.shape
    _check_group_size(num_rows, group_size, "rewards_per_func")
    w_K = jnp.ones(num_funcs, jnp.float32) if weights is None else jnp.asarray(weights, jnp.float32)
    if w_K.shape != (num_funcs,):
        raise ValueError(f"weights has shape {w_K.shape}, expected ({num_funcs},): one per reward function")
    # [M * K, G]: one row per (group, function); groups stay the major axis, as the batch is split.
    num_groups = num_rows // group_size
    r_MxKxG = r_NxK.reshape(num_groups, group_size, num_funcs).transpose(0, 2, 1)
    r_LxG = r_MxKxG.reshape(num_groups * num_funcs, group_size)
    valid_LxG = ~jnp.isnan(r_LxG)
    mean_L, std_L, constant_L = _group_stats(r_LxG, valid_LxG, ddof=1)
    norm_LxG = jnp.where(constant_L[:, None] | ~valid_LxG, 0.0,
                         (r_LxG - mean_L[:, None]) / (std_L[:, None] + eps))
    norm_MxKxG = norm_LxG.reshape(num_groups, num_funcs, group_size)
    s_N = (norm_MxKxG * w_K[None, :, None]).sum(axis=1).reshape(num_rows)
    scored_N = (~jnp.isnan(r_NxK)).any(axis=1)
    return _batch_normalize(s_N, scored_N, eps, axis_name)


def _batch_normalize(s_N, valid_N, eps, axis_name):
    """(s - mean) / (std + eps) over the valid rows of the global batch (ddof 1); 0 elsewhere and when
    the valid values are all equal."""
    count = _psum(valid_N.sum().astype(jnp.float32), axis_name)
    mean = _psum(jnp.where(valid_N, s_N, 0.0).sum(), axis_name) / jnp.maximum(count, 1.0)
    sq = _psum((jnp.where(valid_N, s_N - mean, 0.0) ** 2).sum(), axis_name)
    std = jnp.where(count > 1, jnp.sqrt(sq / jnp.maximum(count - 1.0, 1.0)), 0.0)
    hi, lo = jnp.where(valid_N, s_N, -jnp.inf).max(), jnp.where(valid_N, s_N, jnp.inf).min()
    if axis_name is not None:
        hi, lo = jax.lax.pmax(hi, axis_name), jax.lax.pmin(lo, axis_name)
    return jnp.where(valid_N & (hi != lo), (s_N - mean) / (std + eps), 0.0)


def passk_advantages(rewards: jax.Array, group_size: int, *, scale_by_std: bool = True,
                     eps: float = 1e-4) -> jax.Array:
    """Pass@k (max@k) advantages for k = G (Tang et al. 2025, arXiv 2503.19595; verl `grpo_passk`).

    The leave-one-out gradient of E[max of the G rewards] credits only the best answer of each group:
    A_best = r_max - r_second_max (divided by std_group(r) + eps with `scale_by_std`, as verl's
    norm_adv_by_std_in_grpo), every other answer 0. So with binary rewards a group learns only when
    exactly one answer is right: r = (1, 0, 0, 0) gives A = (1 / (0.5 + eps), 0, 0, 0); two right
    answers give all 0 (the max is already reached without either one).

    Args:
      rewards: [N]; NaN: not scored (never the best, left out of the std).
      group_size: G (static Python int); a group with fewer than 2 scored answers gets 0.
      scale_by_std: divide by the group's sample std (+ eps).
      eps: see above.

    Returns:
      advantages_N float32.
    """
    r_MxG, valid_MxG = _grouped(rewards, group_size)
    masked_MxG = jnp.where(valid_MxG, r_MxG, -jnp.inf)
    best_M = jnp.argmax(masked_MxG, axis=1)
    is_best_MxG = jnp.arange(group_size)[None, :] == best_M[:, None]
    top2_Mx2 = jax.lax.top_k(masked_MxG, 2)[0]
    n_M = valid_MxG.sum(axis=1)
    gap_M = jnp.where(n_M >= 2, top2_Mx2[:, 0] - top2_Mx2[:, 1], 0.0)
    if scale_by_std:
        _, std_M, _ = _group_stats(r_MxG, valid_MxG, ddof=1)
        gap_M = gap_M / (std_M + eps)
    return jnp.where(is_best_MxG & valid_MxG, gap_M[:, None], 0.0).reshape(-1)


def estimator_advantages(
    estimator: AdvEstimator,
    rewards: jax.Array,
    group_size: int,
    *,
    lengths: jax.Array | None = None,
    rewards_per_func: jax.Array | None = None,
    weights: jax.Array | None = None,
    scale: str = "group",
    eps: float = 1e-4,
    axis_name: str | None = None,
) -> jax.Array:
    """The advantages [N] of one step by verl's `adv_estimator` name.

    "grpo": `group_advantages(rewards, scale=scale, eps=eps)` (today's default, unchanged);
    "rloo", "opo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gdpo", "grpo_passk":
    the functions above. `lengths` [N] (completion tokens) is needed by opo and reinforce_plus_plus*,
    `rewards_per_func` [N, K] (and `weights` [K]) by gdpo; `scale` "none" turns off grpo_passk's std
    division; `eps` is grpo's, gdpo's and grpo_passk's.
    """
    needs = {"opo": lengths, "reinforce_plus_plus": lengths, "reinforce_plus_plus_baseline": lengths,
             "gdpo": rewards_per_func}
    if estimator in needs and needs[estimator] is None:
        missing = "rewards_per_func" if estimator == "gdpo" else "lengths"
        raise ValueError(f"adv_estimator={estimator!r} needs {missing}")
    match estimator:
        case "grpo":
            return group_advantages(rewards, group_size, scale=scale, eps=eps, axis_name=axis_name)
        case "rloo":
            return rloo_advantages(rewards, group_size)
        case "opo":
            return opo_advantages(rewards, lengths, group_size)
        case "reinforce_plus_plus" | "reinforce_plus_plus_baseline":
            return reinforce_plus_plus_advantages(
                rewards, lengths, group_size, baseline=estimator.endswith("baseline"), axis_name=axis_name)
        case "gdpo":
            return gdpo_advantages(rewards_per_func, group_size, weights=weights, eps=eps, axis_name=axis_name)
        case "grpo_passk":
            return passk_advantages(rewards, group_size, scale_by_std=scale != "none", eps=eps)
        case _:
            raise ValueError(f"adv_estimator must be one of {', '.join(ADV_ESTIMATORS)}; got {estimator!r}")
