"""Advantages against the worked numbers of seeds/000 (Step 3, the normalisation deep dive, Part 3).

Each test: the input rewards, the numbers the seed prints, and why.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.core.advantages import (
    group_advantages,
    process_advantages,
    step_token_advantages,
    zero_std_fraction,
)


def adv(rewards, group_size=None, **kw):
    r = jnp.asarray(rewards, jnp.float32)
    return np.asarray(group_advantages(r, group_size or r.shape[0], **kw))


def test_running_example_matches_torch_printout():
    # Step 3: torch prints [0.8659, -0.8659, 0.8659, -0.8659] for (r - mean) / (r.std() + 1e-4),
    # r.std() the sample std 0.5774.
    np.testing.assert_allclose(adv([1, 0, 1, 0]), [0.8659, -0.8659, 0.8659, -0.8659], atol=1e-4)


def test_zero_variance_group_gives_exact_zeros():
    # [1, 1, 1, 1]: nothing to learn, every advantage is 0 (not NaN). [0.1] * 3 has a float mean
    # one ulp off 0.1; dividing that by eps must not leak a non-zero advantage.
    assert np.all(adv([1, 1, 1, 1]) == 0.0)
    assert np.all(adv([0.1, 0.1, 0.1]) == 0.0)
    assert np.all(adv([0.1, 0.1, 0.1], scale="batch") == 0.0)


def test_one_of_eight_and_seven_of_eight():
    # Deep dive, Part B: 1 of 8 correct, mean 0.125, std 0.354 -> +2.47 / -0.35; 7 of 8 mirrors it.
    one = adv([1, 0, 0, 0, 0, 0, 0, 0])
    np.testing.assert_allclose(one, [2.47] + [-0.35] * 7, atol=0.01)
    seven = adv([1, 1, 1, 1, 1, 1, 1, 0])
    np.testing.assert_allclose(seven, [0.35] * 7 + [-2.47], atol=0.01)


def test_invariant_under_positive_affine_map():
    # Part B, "the reward's scale stops mattering": (a r + c) gives the same advantages for a > 0
    # (up to eps, which does not scale: a=10 changes the 4th decimal at most).
    r = np.array([0.3, 1.0, 0.0, 0.7, 1.0, 1.0, 0.2, 0.9])
    base = adv(r, 4)
    for a, c in [(10.0, 0.0), (0.5, 3.0), (1.0, -7.0)]:
        np.testing.assert_allclose(adv(a * r + c, 4), base, atol=1e-3)
    # Partial credit [0.6, 0.5, 0.6, 0.5] gets the same +-0.87 as [1, 0, 1, 0] (eps=0 to be exact).
    np.testing.assert_allclose(
        adv([0.6, 0.5, 0.6, 0.5], eps=0.0), adv([1, 0, 1, 0], eps=0.0), atol=1e-5
    )


def test_reward_hack_table():
    # Part 2: [1, 0, 0, 0], mean 0.25, sample std 0.5 -> +1.5, -0.5, -0.5, -0.5.
    np.testing.assert_allclose(adv([1, 0, 0, 0], eps=0.0), [1.5, -0.5, -0.5, -0.5], atol=1e-6)


def test_format_bonus_lambda_half_keeps_correct_above_wrong():
    # Part 3: lambda = 0.5, rewards 1.5, 1.0, 0.5, 0 -> +1.16, +0.39, -0.39, -1.16.
    a = adv([1.5, 1.0, 0.5, 0.0])
    np.testing.assert_allclose(a, [1.16, 0.39, -0.39, -1.16], atol=0.005)
    assert min(a[0], a[1]) > max(a[2], a[3])  # every correct answer beats every wrong one


def test_format_bonus_lambda_two_ranks_a_wrong_answer_above_a_correct_one():
    # Part 3: lambda = 2, rewards 3, 1, 2, 0 -> +1.16, -0.39, +0.39, -1.16: a self-made hack.
    a = adv([3.0, 1.0, 2.0, 0.0])
    np.testing.assert_allclose(a, [1.16, -0.39, 0.39, -1.16], atol=0.005)
    assert a[2] > a[1]  # formatted-but-wrong o3 is pushed up above correct o2


def test_dr_grpo_none_is_mean_only():
    # "Dr. GRPO": r - mean(r), no std. Hard question [1, 0, 0, 0] -> [+0.75, -0.25, -0.25, -0.25].
    a = adv([1, 0, 0, 0, 1, 1, 1, 1], 4, scale="none")
    np.testing.assert_allclose(a, [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0], atol=1e-6)


def test_batch_scale_uses_group_mean_and_one_batch_std():
    # "Batch-level std": (r - group mean) / std over the whole batch,
    # as TRL's scale_rewards="batch".
    r = np.array([1.0, 0.0, 0.0, 0.0, 0.6, 0.5, 0.6, 0.5])
    group_mean = np.repeat(r.reshape(2, 4).mean(1), 4)
    expected = (r - group_mean) / (r.std(ddof=1) + 1e-4)
    np.testing.assert_allclose(adv(r, 4, scale="batch"), expected, rtol=1e-5)


def test_ddof_zero_is_population_std():
    # seeds/001 uses rewards.std(unbiased=False): [1, 0, 1, 0] -> 0.5 / 0.5 = +-1.
    np.testing.assert_allclose(adv([1, 0, 1, 0], ddof=0, eps=0.0), [1, -1, 1, -1], atol=1e-6)


def test_nan_rewards_are_ignored_and_get_zero():
    # A NaN ("not applicable") answer is left out: [1, nan, 0, nan] is the group [1, 0], mean 0.5,
    # sample std 0.707 -> +-0.707; the NaN rows get 0.
    a = adv([1.0, np.nan, 0.0, np.nan], eps=0.0)
    np.testing.assert_allclose(a, [0.7071, 0.0, -0.7071, 0.0], atol=1e-4)
    assert np.all(adv([np.nan] * 4) == 0.0)  # an all-NaN group: zeros, no NaN
    assert np.all(np.isfinite(adv([1.0, np.nan, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0], 4, scale="batch")))


def test_jit_and_vmap_give_the_same_numbers():
    r = jax.random.bernoulli(jax.random.key(0), 0.4, (3, 16)).astype(jnp.float32)
    for scale in ("group", "batch", "none"):
        eager = np.stack([group_advantages(row, 4, scale=scale) for row in r])
        jitted = jax.jit(lambda x, s=scale: group_advantages(x, 4, scale=s))(r[0])
        vmapped = jax.vmap(lambda x, s=scale: group_advantages(x, 4, scale=s))(r)
        np.testing.assert_allclose(jitted, eager[0], rtol=1e-6)
        np.testing.assert_allclose(vmapped, eager, rtol=1e-6)


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="not a multiple of group_size=4"):
        group_advantages(jnp.zeros(6), 4)
    with pytest.raises(ValueError, match="scale must be"):
        group_advantages(jnp.zeros(4), 4, scale="global")


def test_zero_std_fraction_counts_constant_groups():
    # Groups [1,1,1,1] and [0,0,0,0] are constant, [1,0,0,0] is not: 2 of 3.
    r = jnp.array([1.0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0])
    assert float(zero_std_fraction(r, 4)) == pytest.approx(2 / 3)
    assert float(jax.jit(zero_std_fraction, static_argnums=1)(r, 4)) == pytest.approx(2 / 3)


def test_step_table_of_the_seed():
    # "Case 2: Process Reward": normalised step rewards +0.5, +0.4, -1.2 ending at tokens 3, 6, 8
    # give token advantages -0.3 x3 (0.5+0.4-1.2), -0.8 x3 (0.4-1.2), -1.2 x2; tokens past the
    # last step (9, 10: padding) get 0. A padded 4th step (mask False) changes nothing.
    a = step_token_advantages(
        jnp.array([[0.5, 0.4, -1.2, 9.0]]),
        jnp.array([[3, 6, 8, 10]]),
        jnp.array([[True, True, True, False]]),
        seq_len=10,
    )
    np.testing.assert_allclose(
        a[0], [-0.3] * 3 + [-0.8] * 3 + [-1.2] * 2 + [0.0] * 2, atol=1e-6
    )


def test_truncated_step_still_credits_every_token():
    # A step ending at 12 in a 5-column array still ends "at or after" every column.
    a = step_token_advantages(jnp.array([[1.0, 2.0]]), jnp.array([[2, 12]]), jnp.ones((1, 2)), 5)
    np.testing.assert_allclose(a[0], [3, 3, 2, 2, 2], atol=0)


def numpy_process_advantages(r, ends, mask, group_size, seq_len, eps=1e-4):
    out = np.zeros((r.shape[0], seq_len))
    for g in range(r.shape[0] // group_size):
        rows = slice(g * group_size, (g + 1) * group_size)
        vals = r[rows][mask[rows]]
        norm = (r[rows] - vals.mean()) / (vals.std(ddof=1) + eps)
        for i in range(g * group_size, (g + 1) * group_size):
            for k in range(r.shape[1]):
                if mask[i, k]:
                    out[i, : ends[i, k]] += norm[i - g * group_size, k]  # tokens 1..end
    return out


def test_process_advantages_normalise_over_the_group_then_sum_later_steps():
    # Two groups of two answers with 3, 2 | 1, 3 real steps: a NumPy loop over the seed's formula.
    r = np.array([[1.0, 0.2, -0.5], [0.8, 0.0, 0.0], [0.3, 0.0, 0.0], [0.1, 0.9, 0.4]])
    ends = np.array([[2, 4, 7], [3, 6, 0], [5, 0, 0], [1, 3, 4]])
    mask = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], bool)
    got = process_advantages(jnp.asarray(r), jnp.asarray(ends), jnp.asarray(mask), 2, 8)
    np.testing.assert_allclose(got, numpy_process_advantages(r, ends, mask, 2, 8), atol=1e-5)
    jitted = jax.jit(process_advantages, static_argnums=(3, 4))(r, ends, mask, 2, 8)
    np.testing.assert_allclose(jitted, got, atol=1e-6)


def test_process_advantages_constant_group_is_zero():
    # Every step of every answer scored 0.7: nothing is better than usual, all zeros.
    got = process_advantages(
        jnp.full((2, 2), 0.7), jnp.array([[2, 4], [3, 0]]), jnp.array([[1, 1], [1, 0]]), 2, 5
    )
    assert np.all(np.asarray(got) == 0.0)
