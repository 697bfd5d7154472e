"""grpo_jax.core.advantage_estimators: worked examples, the trainer's default, 8 fake devices, and parity
with verl 0.9.1's estimators (`parity`: needs torch and verl, skipped without them)."""

import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.core import advantage_estimators as est
from grpo_jax.core.advantages import group_advantages

# Exact-arithmetic examples computed in float32: a few roundings of O(1) values, so 1e-6 absolute
# (16 u) covers them; a wrong formula is off by >= 1e-2 in every example below.
ATOL = 1e-6


def test_rloo_is_the_leave_one_out_baseline():
    # r = (1, 0, 0, 1): a right answer's baseline is the mean of the other three, 1/3, so 1 - 1/3 = 2/3;
    # a wrong one's is 2/3, so -2/3. Equivalently 4/3 * (r - 1/2).
    got = est.rloo_advantages(jnp.array([1.0, 0.0, 0.0, 1.0]), 4)
    np.testing.assert_allclose(got, [2 / 3, -2 / 3, -2 / 3, 2 / 3], atol=ATOL)
    # A NaN (no reward function applied) is left out: n = 3, r = (1, -, 0, 0): 1 - mean(0, 0) = 1,
    # 0 - mean(1, 0) = -0.5; the NaN row gets 0.
    got = est.rloo_advantages(jnp.array([1.0, jnp.nan, 0.0, 0.0]), 4)
    np.testing.assert_allclose(got, [1.0, 0.0, -0.5, -0.5], atol=ATOL)
    # All equal: no answer beats the others, 0 exactly (not an ulp of the float mean).
    assert np.all(np.asarray(est.rloo_advantages(jnp.full(4, 0.1), 4)) == 0.0)


def test_opo_baseline_is_length_weighted():
    # r = (1, 0) with 1 and 3 tokens: b = (1 * 1 + 3 * 0) / 4 = 0.25, so A = (0.75, -0.25) where
    # GRPO's plain mean would give (0.5, -0.5).
    got = est.opo_advantages(jnp.array([1.0, 0.0]), jnp.array([1, 3]), 2)
    np.testing.assert_allclose(got, [0.75, -0.25], atol=ATOL)
    # Equal lengths: b is the plain mean (Dr. GRPO's r - mean).
    got = est.opo_advantages(jnp.array([1.0, 0.0, 0.0, 0.0]), jnp.array([5, 5, 5, 5]), 4)
    np.testing.assert_allclose(got, [0.75, -0.25, -0.25, -0.25], atol=ATOL)


def test_reinforce_plus_plus_whitens_over_tokens():
    # r = (1, 0) with 1 and 3 tokens: the tokens hold (1, 0, 0, 0), mean 0.25, unbiased variance
    # (0.75^2 + 3 * 0.25^2) / 3 = 0.25, std 0.5: A = (0.75 / 0.5, -0.25 / 0.5) = (1.5, -0.5).
    got = est.reinforce_plus_plus_advantages(jnp.array([1.0, 0.0]), jnp.array([1, 3]), 2)
    np.testing.assert_allclose(got, [1.5, -0.5], atol=ATOL)


def test_reinforce_plus_plus_baseline_subtracts_the_group_mean_first():
    # Groups (1, 0) and (1, 1), 2 tokens each. After the group means: (0.5, -0.5, 0, 0); over the 8
    # tokens the mean is 0 and the unbiased variance 4 * 0.25 / 7 = 1/7, so A = (+-0.5 * sqrt(7), 0, 0)
    # = (1.3229, -1.3229, 0, 0). Without the baseline the solved group (1, 1) would get +0.65 each.
    rewards, lengths = jnp.array([1.0, 0.0, 1.0, 1.0]), jnp.array([2, 2, 2, 2])
    got = est.reinforce_plus_plus_advantages(rewards, lengths, 2, baseline=True)
    np.testing.assert_allclose(got, [0.5 * math.sqrt(7), -0.5 * math.sqrt(7), 0.0, 0.0], atol=ATOL)
    plain = est.reinforce_plus_plus_advantages(rewards, lengths, 2)
    assert float(plain[2]) > 0.5  # the solved group is pushed up without the baseline
    # A masked (0-token) row and a NaN row are left out of the statistics and get 0.
    got = est.reinforce_plus_plus_advantages(jnp.array([1.0, 0.0, 7.0, jnp.nan]), jnp.array([1, 3, 0, 4]), 2)
    np.testing.assert_allclose(got, [1.5, -0.5, 0.0, 0.0], atol=ATOL)


def test_gdpo_normalises_each_reward_before_the_sum():
    # One group of 4; correctness (1, 0, 0, 0) and a wide-range reward (0, 10, 10, 0), weights 1.
    # Summed first (GRPO): (1, 10, 10, 0), mean 5.25, std 5.5, so the one correct answer gets
    # (1 - 5.25) / 5.5 = -0.77: the wide reward drowns correctness.
    # GDPO: correctness -> (1 - 0.25) / 0.5 = 1.5 and -0.5 x 3; the other -> +-5 / 5.7735 = +-sqrt(3)/2.
    # s = (1.5 - 0.866, -0.5 + 0.866, -0.5 + 0.866, -0.5 - 0.866), mean 0, then / std(s) (ddof 1).
    per_func = jnp.array([[1.0, 0.0], [0.0, 10.0], [0.0, 10.0], [0.0, 0.0]])
    h = math.sqrt(3) / 2
    s = np.array([1.5 - h, -0.5 + h, -0.5 + h, -0.5 - h])
    expected = s / np.sqrt((s**2).sum() / 3)
    got = est.gdpo_advantages(per_func, 4, eps=0.0)
    np.testing.assert_allclose(got, expected, atol=ATOL)
    assert float(got[0]) == pytest.approx(0.6896, abs=1e-4) and float(got[0]) == float(jnp.max(got))
    summed = group_advantages(per_func.sum(axis=1), 4, eps=0.0)
    assert float(summed[0]) == pytest.approx(-0.7727, abs=1e-4)
    # Weights scale each normalised reward: weight 0 on the wide one leaves correctness alone:
    # s = (1.5, -0.5, -0.5, -0.5), std(s) = 1, A = s.
    got = est.gdpo_advantages(per_func, 4, weights=jnp.array([1.0, 0.0]), eps=0.0)
    np.testing.assert_allclose(got, [1.5, -0.5, -0.5, -0.5], atol=ATOL)


def test_gdpo_not_applicable_values():
    # Row 3 has no value from any function: advantage 0 and left out of the batch statistics. Row 1's
    # format value is NaN: it adds 0 to s_1. Correctness in (1, 0, 1, -): mean 2/3, std 0.57735,
    # r~ = (0.57735, -1.1547, 0.57735); format in (1, -, 0, -): r~ = (0.7071, -, -0.7071).
    per_func = jnp.array([[1.0, 1.0], [0.0, jnp.nan], [1.0, 0.0], [jnp.nan, jnp.nan]])
    a, b = 1 / math.sqrt(3), 1 / math.sqrt(2)
    s = np.array([a + b, -2 * a, a - b])
    s = s - s.mean()
    expected = np.append(s / np.sqrt((s**2).sum() / 2), 0.0)
    np.testing.assert_allclose(est.gdpo_advantages(per_func, 4, eps=0.0), expected, atol=ATOL)


def test_passk_credits_only_the_best_answer():
    # Group 1 (1, 0, 0, 0): only answer 0 is right, so without it the max drops by 1: A_0 = 1, divided
    # by the group std 0.5 (+ eps): 2; the rest 0. Group 2 (1, 1, 0, 0): the max stays 1 without
    # either right answer, so every advantage is 0.
    rewards = jnp.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    got = est.passk_advantages(rewards, 4, eps=0.0)
    np.testing.assert_allclose(got, [2.0, 0, 0, 0, 0, 0, 0, 0], atol=ATOL)
    # Graded rewards, no std division: the best (0.9) gets 0.9 - 0.5 = 0.4.
    got = est.passk_advantages(jnp.array([0.2, 0.9, 0.5, 0.1]), 4, scale_by_std=False)
    np.testing.assert_allclose(got, [0.0, 0.4, 0.0, 0.0], atol=ATOL)
    # A NaN is never the best; one scored answer alone has no second: 0.
    got = est.passk_advantages(jnp.array([jnp.nan, 0.3, jnp.nan, jnp.nan]), 4, scale_by_std=False)
    np.testing.assert_allclose(got, [0.0, 0.0, 0.0, 0.0], atol=ATOL)


def test_grpo_estimator_is_exactly_group_advantages():
    # The trainer's default goes through estimator_advantages: it must be today's numbers, bit for bit.
    rewards = jax.random.normal(jax.random.key(0), (32,))
    for scale in ("group", "batch", "none"):
        a = est.estimator_advantages("grpo", rewards, 4, scale=scale, eps=1e-4)
        b = group_advantages(rewards, 4, scale=scale, eps=1e-4)
        assert np.array_equal(np.asarray(a), np.asarray(b)), scale


def test_estimators_run_under_jit_and_vmap():
    rewards = jax.random.uniform(jax.random.key(1), (3, 8))  # 3 independent batches of 2 groups
    lengths = jnp.arange(24).reshape(3, 8) % 5 + 1
    fns = {
        "rloo": lambda r, n: est.rloo_advantages(r, 4),
        "opo": lambda r, n: est.opo_advantages(r, n, 4),
        "rpp": lambda r, n: est.reinforce_plus_plus_advantages(r, n, 4, baseline=True),
        "passk": lambda r, n: est.passk_advantages(r, 4),
        "gdpo": lambda r, n: est.gdpo_advantages(jnp.stack([r, n.astype(jnp.float32)], 1), 4),
    }
    for name, fn in fns.items():
        batched = jax.jit(jax.vmap(fn))(rewards, lengths)
        one_by_one = jnp.stack([fn(rewards[i], lengths[i]) for i in range(3)])
        # Same ops on the same values; XLA may fuse differently: a few ulps of O(1) values.
        np.testing.assert_allclose(batched, one_by_one, atol=1e-5, err_msg=name)


def test_bad_inputs_name_what_is_wrong():
    with pytest.raises(ValueError, match="needs lengths"):
        est.estimator_advantages("opo", jnp.zeros(4), 2)
    with pytest.raises(ValueError, match="needs rewards_per_func"):
        est.estimator_advantages("gdpo", jnp.zeros(4), 2)
    with pytest.raises(ValueError, match="adv_estimator must be one of"):
        est.estimator_advantages("ppo", jnp.zeros(4), 2)
    with pytest.raises(ValueError, match="lengths has shape"):
        est.opo_advantages(jnp.zeros(4), jnp.zeros(3), 2)
    with pytest.raises(ValueError, match="weights has shape"):
        est.gdpo_advantages(jnp.zeros((4, 2)), 2, weights=jnp.ones(3))
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        est.rloo_advantages(jnp.zeros(5), 2)


def test_estimators_on_8_devices_match_one_device():
    # gdpo and reinforce_plus_plus take whole-batch statistics: with axis_name inside shard_map, and
    # under jit on a sharded batch, they must give the one-device numbers (the check script).
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    script = Path(__file__).with_name("advantage_estimators_check.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("OK"), proc.stdout


# ------------------------------------------------------------------------------------------------
# Parity with verl 0.9.1 (verl/trainer/ppo/core_algos.py), run on the same rewards.

# verl computes in float32 torch with another summation order and a 1e-8 in masked_mean's
# denominator: sums of <= 64 O(1) terms, 64 u ~ 4e-6 relative; 2e-5 absolute on O(1) advantages.
PARITY_ATOL = 2e-5


def _verl():
    torch = pytest.importorskip("torch")
    core = pytest.importorskip("verl.trainer.ppo.core_algos")
    return torch, core


def _verl_inputs(torch, rewards, lengths, width):
    """verl's layout: the outcome reward on each answer's last token, a response mask, group ids."""
    n = len(rewards)
    mask = torch.zeros(n, width)
    token_rewards = torch.zeros(n, width)
    for i, (r, n_tok) in enumerate(zip(rewards, lengths)):
        mask[i, :n_tok] = 1.0
        token_rewards[i, n_tok - 1] = float(r)
    return token_rewards, mask


@pytest.mark.parity
def test_parity_rloo_opo_reinforce_plus_plus_passk_with_verl():
    torch, core = _verl()
    rng = np.random.default_rng(0)
    n, g, width = 32, 4, 7
    rewards = rng.normal(size=n).astype(np.float32)
    lengths = rng.integers(1, width + 1, size=n)
    index = np.repeat(np.arange(n // g), g)
    token_rewards, mask = _verl_inputs(torch, rewards, lengths, width)

    class Cfg(dict):
        gamma = 1.0

    cfg = Cfg(norm_adv_by_std_in_grpo=True)
    r, ln = jnp.asarray(rewards), jnp.asarray(lengths)
    cases = {
        "rloo": (core.compute_rloo_outcome_advantage, est.rloo_advantages(r, g)),
        "opo": (core.compute_opo_outcome_advantage, est.opo_advantages(r, ln, g)),
        "reinforce_plus_plus": (core.compute_reinforce_plus_plus_outcome_advantage,
                                est.reinforce_plus_plus_advantages(r, ln, g)),
        "reinforce_plus_plus_baseline": (core.compute_reinforce_plus_plus_baseline_outcome_advantage,
                                         est.reinforce_plus_plus_advantages(r, ln, g, baseline=True)),
        "grpo_passk": (core.compute_grpo_passk_outcome_advantage, est.passk_advantages(r, g, eps=1e-6)),
    }
    for name, (verl_fn, ours) in cases.items():
        theirs, _ = verl_fn(token_level_rewards=token_rewards.clone(), response_mask=mask, index=index, config=cfg)
        # verl's are per token, constant along each answer (gamma = 1): compare on every real token.
        ours_tok = np.asarray(ours)[:, None] * mask.numpy()
        np.testing.assert_allclose(ours_tok, theirs.numpy(), atol=PARITY_ATOL, err_msg=name)
        assert np.abs(theirs.numpy()).max() > 0.1, name  # a real comparison, not zeros against zeros


@pytest.mark.parity
def test_parity_gdpo_with_verl_on_one_token_answers():
    # verl whitens GDPO's sum over tokens (rsqrt(var + 1e-8)); TRL and the paper normalise over answers
    # (std + eps), as we do. With one token per answer the two statistics are the same numbers, and
    # eps = 1e-6 (verl's) leaves a relative difference of ~1e-6 / std ~ 1e-6.
    torch, core = _verl()
    rng = np.random.default_rng(1)
    n, g, k = 16, 4, 3
    per_func = rng.normal(size=(n, k)).astype(np.float32) * np.array([1.0, 10.0, 0.1], np.float32)
    weights = [1.0, 0.5, 2.0]
    index = np.repeat(np.arange(n // g), g)
    mask = torch.ones(n, 1)
    keys = [f"r{j}" for j in range(k)]
    batch = {"prompts": torch.zeros(n, 2, dtype=torch.long), "attention_mask": torch.ones(n, 3, dtype=torch.long)}
    theirs, _ = core.compute_gdpo_outcome_advantage(
        token_level_rewards=torch.zeros(n, 1), response_mask=mask, index=index, epsilon=1e-6,
        config={"gdpo_reward_keys": keys, "gdpo_reward_weights": weights},
        non_tensor_batch={key: per_func[:, j] for j, key in enumerate(keys)}, batch=batch)
    ours = est.gdpo_advantages(jnp.asarray(per_func), g, weights=jnp.asarray(weights), eps=1e-6)
    np.testing.assert_allclose(np.asarray(ours), theirs.numpy()[:, 0], atol=PARITY_ATOL)
    assert np.abs(theirs.numpy()).max() > 0.5


def test_the_advantage_phase_feeds_each_estimator_what_it_needs():
    # phases.compute_advantages: lengths are the loss's real tokens (after mask_truncated_completions), GDPO gets
    # each function's values under the truncation rule and the tasks' weights.
    import types

    from grpo_jax import config as config_lib
    from grpo_jax.training import phases
    from grpo_jax.rewards import WeightedReward

    mask = np.array([[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]], np.int32)
    truncated = np.array([False, True, False, False])
    parts = {"acc": np.array([1.0, 1.0, 0.0, 0.0], np.float32), "fmt": np.array([1.0, 0.0, 1.0, 1.0], np.float32)}
    rewards = phases.truncation_rule(parts["acc"] + 0.5 * parts["fmt"], truncated, "at_most_zero")
    batch = types.SimpleNamespace(rewards=rewards, reward_parts=parts, truncated=truncated, arrays={"mask": mask})
    task = types.SimpleNamespace(reward_fns=lambda: [WeightedReward("acc", None, 1.0),
                                                     WeightedReward("fmt", None, 0.5)])

    def score(**grpo):
        cfg = config_lib.Config(grpo=config_lib.GRPOSection(num_generations=2, prompts_per_step=2, **grpo))
        return phases.compute_advantages(types.SimpleNamespace(config=cfg, task=task), batch)

    adv, m = score(adv_estimator="opo", mask_truncated_completions=True)
    # Row 1 is truncated: reward min(1.5, 0) = 0 and 0 tokens; group 0 = rewards (1.5, 0), lengths
    # (1, 0): b = 1.5, A = (0, -1.5). Group 1 = (0.5, 0.5): 0.
    np.testing.assert_allclose(adv, [0.0, -1.5, 0.0, 0.0], atol=ATOL)
    assert m[1].sum() == 0
    adv, _ = score(adv_estimator="gdpo")
    want = est.gdpo_advantages(jnp.array([[1.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.0, 1.0]]), 2,
                               weights=jnp.array([1.0, 0.5]))
    np.testing.assert_allclose(adv, want, atol=ATOL)
    adv, _ = score()  # the default: group_advantages of the total, today's numbers exactly
    assert np.array_equal(adv, np.asarray(group_advantages(jnp.asarray(rewards), 2)))
