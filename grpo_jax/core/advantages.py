"""Group-relative advantages: outcome rewards (one per answer) and process rewards (one per step).

Layout convention used everywhere in grpo_jax: the batch axis holds consecutive blocks of
`group_size` answers to the same prompt, so rows `[g * G, (g + 1) * G)` are group `g`. A group never
spans devices (the batch is sharded in multiples of `group_size`), so group statistics are always
local; only whole-batch statistics (the "batch" std, the zero-std fraction) take `axis_name`.

All functions are pure, accumulate in float32 and run under `jax.jit`, `jax.vmap`, `jax.shard_map`
and `jax.pmap`.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Scale = Literal["group", "batch", "none"]


def _check_group_size(num_rows: int, group_size: int, name: str) -> None:
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if num_rows % group_size != 0:
        raise ValueError(
            f"{name} has {num_rows} rows, which is not a multiple of group_size={group_size}; "
            "the batch must hold whole groups of consecutive answers"
        )


def _psum(x: jax.Array, axis_name: str | None) -> jax.Array:
    return x if axis_name is None else jax.lax.psum(x, axis_name)


def _group_stats(
    values_MxS: jax.Array, valid_MxS: jax.Array, ddof: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Nan-free mean, std and "all equal" flag of each row over its valid entries.

    Args:
      values_MxS: float32, one row per group (M groups, S values each); invalid entries any value.
      valid_MxS: bool, which entries count.
      ddof: delta degrees of freedom of the std (1 = sample std, torch's default).

    Returns:
      mean_M, std_M (0 where fewer than ddof + 1 valid values), constant_M (True when the valid
      values are all equal, or there are none).
    """
    count_M = valid_MxS.sum(axis=1).astype(jnp.float32)
    zeroed_MxS = jnp.where(valid_MxS, values_MxS, 0.0)
    mean_M = zeroed_MxS.sum(axis=1) / jnp.maximum(count_M, 1.0)
    centered_MxS = jnp.where(valid_MxS, values_MxS - mean_M[:, None], 0.0)
    var_M = (centered_MxS**2).sum(axis=1) / jnp.maximum(count_M - ddof, 1.0)
    std_M = jnp.where(count_M > ddof, jnp.sqrt(var_M), 0.0)
    # Exact test, not std < tol: [0.1, 0.1, 0.1] has a float mean that differs from 0.1 by an ulp,
    # and dividing that ulp by eps would give a tiny non-zero advantage instead of the seed's 0.
    hi_M = jnp.where(valid_MxS, values_MxS, -jnp.inf).max(axis=1)
    lo_M = jnp.where(valid_MxS, values_MxS, jnp.inf).min(axis=1)
    constant_M = (hi_M == lo_M) | (count_M == 0)
    return mean_M, std_M, constant_M


def group_advantages(
    rewards: jax.Array,
    group_size: int,
    *,
    scale: Scale = "group",
    ddof: int = 1,
    eps: float = 1e-4,
    axis_name: str | None = None,
) -> jax.Array:
    """Outcome advantage of each answer relative to its group (seed, Step 3).

    `scale="group"`: A_i = (r_i - mean_group(r)) / (std_group(r) + eps), the seed's formula
    (sample std with ddof=1, as torch.std). `"batch"`: the group mean, but one std over every
    reward in the (global) batch, as TRL's `scale_rewards="batch"`. `"none"`: Dr. GRPO,
    A_i = r_i - mean_group(r).

    A group whose rewards are all equal gets exactly 0 (never NaN). A NaN reward means "not
    applicable": it is left out of its group's (and the batch's) statistics and gets advantage 0.

    Args:
      rewards: [N] rewards, N a multiple of group_size; consecutive blocks of `group_size` rows
        are the answers to one prompt. Any float dtype.
      group_size: G, answers per prompt (static Python int).
      scale: "group", "batch" or "none", see above.
      ddof: delta degrees of freedom of the std (1 = sample std).
      eps: added to the std before dividing.
      axis_name: mapped axis the batch is split over (shard_map/pmap); only "batch" uses it.

    Returns:
      advantages_N: float32 [N].
    """
    (num_rows,) = jnp.shape(rewards)
    _check_group_size(num_rows, group_size, "rewards")
    r_MxG = jnp.asarray(rewards, jnp.float32).reshape(num_rows // group_size, group_size)
    valid_MxG = ~jnp.isnan(r_MxG)
    mean_M, std_M, constant_M = _group_stats(r_MxG, valid_MxG, ddof)
    centered_MxG = jnp.where(valid_MxG, r_MxG - mean_M[:, None], 0.0)

    match scale:
        case "group":
            adv_MxG = centered_MxG / (std_M[:, None] + eps)
        case "batch":
            adv_MxG = centered_MxG / (_batch_std(r_MxG, valid_MxG, ddof, axis_name) + eps)
        case "none":
            adv_MxG = centered_MxG
        case _:
            raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    adv_MxG = jnp.where(constant_M[:, None] | ~valid_MxG, 0.0, adv_MxG)
    return adv_MxG.reshape(num_rows)


def _batch_std(
    r_MxG: jax.Array, valid_MxG: jax.Array, ddof: int, axis_name: str | None
) -> jax.Array:
    """Std of all valid rewards in the global batch, around the global mean (two passes)."""
    count = _psum(valid_MxG.sum().astype(jnp.float32), axis_name)
    mean = _psum(jnp.where(valid_MxG, r_MxG, 0.0).sum(), axis_name) / jnp.maximum(count, 1.0)
    sq = _psum(jnp.where(valid_MxG, (r_MxG - mean) ** 2, 0.0).sum(), axis_name)
    return jnp.where(count > ddof, jnp.sqrt(sq / jnp.maximum(count - ddof, 1.0)), 0.0)


def zero_std_fraction(
    rewards: jax.Array, group_size: int, *, axis_name: str | None = None
) -> jax.Array:
    """Fraction of groups whose (non-NaN) rewards are all equal: TRL's `frac_reward_zero_std`.

    Such groups have every advantage 0 and teach nothing (seed, Part 1, "Zero-Variance Groups").

    Args:
      rewards: [N], consecutive blocks of `group_size` answers per prompt.
      group_size: G (static Python int).
      axis_name: mapped axis the batch is split over; the fraction is then over all groups.

    Returns:
      float32 scalar in [0, 1].
    """
    (num_rows,) = jnp.shape(rewards)
    _check_group_size(num_rows, group_size, "rewards")
    r_MxG = jnp.asarray(rewards, jnp.float32).reshape(num_rows // group_size, group_size)
    _, _, constant_M = _group_stats(r_MxG, ~jnp.isnan(r_MxG), ddof=1)
    num_constant = _psum(constant_M.sum().astype(jnp.float32), axis_name)
    num_groups = _psum(jnp.float32(constant_M.shape[0]), axis_name)
    return num_constant / num_groups


def step_token_advantages(
    step_advantages: jax.Array, step_ends: jax.Array, step_mask: jax.Array, seq_len: int
) -> jax.Array:
    """Token advantages from (already normalised) step advantages (seed, "Case 2: Process Reward").

    A_{i,t} = sum over steps j of answer i with index(j) >= t of step_advantages[i, j].

    Positions are 1-based and inclusive, as in the seed's table: steps ending at 3, 6, 8 cover
    tokens 1-3, 4-6, 7-8. Token t (1-based) sits at array column t - 1. A step ending past
    `seq_len` (a truncated answer) still credits every token; a step with end < 1 or with
    step_mask False contributes nothing. Tokens after an answer's last step get 0.

    Args:
      step_advantages: [N, K] float, one value per step (padding steps any value).
      step_ends: [N, K] int, 1-based position of each step's last token.
      step_mask: [N, K] bool, True for real steps.
      seq_len: T, number of token columns to return (static Python int).

    Returns:
      advantages_NxT: float32 [N, T].
    """
    num_rows, _ = jnp.shape(step_advantages)
    ends_NxK = jnp.asarray(step_ends, jnp.int32)
    keep_NxK = jnp.asarray(step_mask, bool) & (ends_NxK >= 1)
    values_NxK = jnp.where(keep_NxK, jnp.asarray(step_advantages, jnp.float32), 0.0)
    # Scatter each step's value onto its last token, then a reverse cumulative sum gives every
    # token the sum of the steps ending at or after it: O(N * T) instead of an [N, T, K] table.
    col_NxK = jnp.clip(ends_NxK, 1, seq_len) - 1
    rows_NxK = jnp.broadcast_to(jnp.arange(num_rows)[:, None], col_NxK.shape)
    at_end_NxT = jnp.zeros((num_rows, seq_len), jnp.float32).at[rows_NxK, col_NxK].add(values_NxK)
    return jnp.flip(jnp.cumsum(jnp.flip(at_end_NxT, axis=1), axis=1), axis=1)


def process_advantages(
    step_rewards: jax.Array,
    step_ends: jax.Array,
    step_mask: jax.Array,
    group_size: int,
    seq_len: int,
    *,
    eps: float = 1e-4,
    ddof: int = 1,
) -> jax.Array:
    """Token advantages from process (per-step) rewards (seed, "Case 2: Process Reward").

    Each step reward is normalised with the mean and std of all real step rewards R of its group
    (every step of every answer to the same prompt): r~ = (r - mean(R)) / (std(R) + eps). Then
    token t gets the sum of r~ over the steps of its answer that end at or after t (see
    `step_token_advantages` for the position convention: 1-based inclusive ends). A group whose
    step rewards are all equal gets 0 everywhere. NaN step rewards count as padding.

    Args:
      step_rewards: [N, K] step rewards; answers have different numbers of steps, padded to K.
      step_ends: [N, K] int, 1-based position of each step's last token (ends 3, 6, 8 => tokens
        1-3, 4-6, 7-8).
      step_mask: [N, K] bool, True for real steps.
      group_size: G, consecutive rows per prompt (static Python int).
      seq_len: T, token columns of the result (static Python int).
      eps: added to the group std.
      ddof: delta degrees of freedom of the group std.

    Returns:
      advantages_NxT: float32 [N, T]; 0 on tokens after an answer's last step.
    """
    num_rows, num_steps = jnp.shape(step_rewards)
    _check_group_size(num_rows, group_size, "step_rewards")
    for name, arr in (("step_ends", step_ends), ("step_mask", step_mask)):
        if jnp.shape(arr) != (num_rows, num_steps):
            raise ValueError(
                f"{name} has shape {jnp.shape(arr)}, expected {(num_rows, num_steps)} "
                "(the shape of step_rewards)"
            )
    r_NxK = jnp.asarray(step_rewards, jnp.float32)
    valid_NxK = jnp.asarray(step_mask, bool) & ~jnp.isnan(r_NxK)
    # One row per group holding all its answers' steps.
    num_groups = num_rows // group_size
    r_MxS = r_NxK.reshape(num_groups, group_size * num_steps)
    valid_MxS = valid_NxK.reshape(num_groups, group_size * num_steps)
    mean_M, std_M, constant_M = _group_stats(r_MxS, valid_MxS, ddof)
    norm_MxS = (r_MxS - mean_M[:, None]) / (std_M[:, None] + eps)
    norm_MxS = jnp.where(constant_M[:, None] | ~valid_MxS, 0.0, norm_MxS)
    return step_token_advantages(
        norm_MxS.reshape(num_rows, num_steps), step_ends, valid_NxK, seq_len
    )
