"""Each cheat-sheet warning fires on a synthetic run showing its signal, once per episode; a healthy run is quiet."""

import json
import logging

import numpy as np
import pytest

from grpo_jax.training.diagnostics import Diagnostics


def healthy_run(n_steps: int = 120, seed: int = 0) -> list[dict]:
    """Reward and held-out accuracy rise together, entropy eases off, KL grows smoothly."""
    rng = np.random.default_rng(seed)
    run = []
    for s in range(n_steps):
        f = s / n_steps
        m = {
            "reward": 0.2 + 0.4 * f + rng.normal(0, 0.02),
            "rewards/accuracy/mean": 0.2 + 0.4 * f,
            "rewards/format/mean": 0.9,
            "kl": 0.05 * f + abs(rng.normal(0, 0.001)),
            "entropy": 1.0 - 0.3 * f + rng.normal(0, 0.01),
            "frac_reward_zero_std": 0.2 + rng.normal(0, 0.02),
            "completions/mean_length": 200 + rng.normal(0, 5),
            "completions/clipped_ratio": 0.02 + abs(rng.normal(0, 0.005)),
            "clip_ratio/region_mean": 0.01,
        }
        if s % 10 == 9:  # held-out evaluation every 10 steps, in the same record
            m["eval/pass@1"] = 0.2 + 0.4 * f
            m["eval/pass@8"] = 0.5 + 0.2 * f
        run.append(m)
    return run


def feed(diag: Diagnostics, run: list[dict]) -> list[tuple[int, str]]:
    return [(step, msg) for step, m in enumerate(run) for msg in diag.update(step, m)]


def test_healthy_run_is_quiet():
    for seed in range(3):
        assert feed(Diagnostics(), healthy_run(seed=seed)) == []


def test_entropy_collapse_fires_once_with_cause_and_fix(caplog):
    run = healthy_run()
    for s in range(60, 120):  # entropy 0.85 -> 0.05 while zero-variance climbs (below 0.5: no second warning)
        run[s]["entropy"] = max(0.05, 0.85 - 0.03 * (s - 60))
        run[s]["frac_reward_zero_std"] = 0.2 + 0.004 * (s - 60)
    with caplog.at_level(logging.WARNING, logger="grpo_jax.training.diagnostics"):
        warnings = feed(Diagnostics(), run)
    assert len(warnings) == 1  # once per episode, not every step of the collapse
    step, msg = warnings[0]
    # Start level ~0.99, so the bar is ~0.247; the 10-step mean ending at step s is
    # 0.85 - 0.03 * (s - 64.5), under the bar from s = 85.
    assert step == 85
    assert "entropy_collapse" in msg and "raise the sampling temperature" in msg and "zero-variance" in msg
    assert "eval/pass@8" in msg  # the pass@k trend is part of the evidence
    assert [r.getMessage() for r in caplog.records] == [msg]


def test_kl_spike_fires_at_the_spike_and_rearms_after_it_clears():
    run = healthy_run()
    run[50]["kl"] = 0.5  # ~25x the median of the previous 10 steps (~0.02)
    run[90]["kl"] = 0.6  # a second, separate episode: the first cleared long ago
    warnings = feed(Diagnostics(), run)
    assert [s for s, _ in warnings] == [50, 90]
    assert "kl_spike" in warnings[0][1] and "read the samples from step 50" in warnings[0][1]


def test_kl_spikes_close_together_are_one_episode():
    run = healthy_run()
    for s in (50, 53, 56):  # clear for only 2 steps between them, fewer than rearm_steps=10
        run[s]["kl"] = 0.5
    assert [s for s, _ in feed(Diagnostics(), run)] == [50]
    assert [s for s, _ in feed(Diagnostics(rearm_steps=2), run)] == [50, 53, 56]


def test_reward_rising_while_heldout_flat_suggests_hacking():
    run = healthy_run()
    for s, m in enumerate(run):
        # Training reward 0.2 until step 40, +0.015 per step to 0.8 at step 80; held-out stays at 0.3.
        m["reward"] = 0.2 + 0.015 * min(max(s - 40, 0), 40)
        if "eval/pass@1" in m:
            m["eval/pass@1"] = 0.3
    warnings = feed(Diagnostics(), run)
    assert len(warnings) == 1
    step, msg = warnings[0]
    # Evals at 9, 19, ...; first vs third of the last three. At 49 the 10-step reward mean is
    # 0.2675, only 0.0675 above the eval at 29; at 59 it is 0.4175, 0.2175 above the eval at 39.
    assert step == 59
    assert "reward_up_heldout_flat" in msg and "0.200 -> 0.417" in msg and "tighten the verifier" in msg


def test_reward_and_heldout_rising_together_is_healthy():
    run = healthy_run()
    for s, m in enumerate(run):
        m["reward"] = 0.2 + 0.015 * min(max(s - 40, 0), 40)
        if "eval/pass@1" in m:
            m["eval/pass@1"] = 0.2 + 0.01 * min(max(s - 40, 0), 40)  # held-out follows
    assert feed(Diagnostics(), run) == []


def test_high_zero_variance_with_flat_reward_points_at_difficulty():
    run = healthy_run()
    for s in range(40, 120):
        run[s]["reward"] = 0.92 + (0.01 if s % 2 else -0.01)  # flat and mostly solved
        run[s]["frac_reward_zero_std"] = 0.7
    warnings = feed(Diagnostics(), run)
    assert len(warnings) == 1
    step, msg = warnings[0]
    assert 49 <= step <= 60
    assert "high_zero_variance" in msg and "too easy" in msg and "filter prompts by difficulty" in msg


def test_rising_truncation_points_at_rambling():
    run = healthy_run()
    for s in range(60, 120):
        run[s]["completions/clipped_ratio"] = 0.02 + 0.01 * (s - 60)
        run[s]["completions/mean_length"] = 200 + 5 * (s - 60)
    warnings = feed(Diagnostics(), run)
    assert len(warnings) == 1
    step, msg = warnings[0]
    assert 70 <= step <= 80  # window mean passes 0.1 around step 73
    assert "truncation_rising" in msg and "length penalty" in msg and "mean length" in msg


def test_high_clip_fraction_with_jumpy_reward_says_updates_too_big():
    run = healthy_run()
    for s in range(60, 120):
        run[s]["reward"] = 0.6 if s % 2 else 0.2  # swings by 0.4 every step
        run[s].pop("clip_ratio/region_mean")
        run[s]["clip_ratio/low_mean"] = 0.15  # the low and high sides add up to 0.3
        run[s]["clip_ratio/high_mean"] = 0.15
    warnings = feed(Diagnostics(), run)
    names = [msg.split(":")[0].split("] ")[1] for _, msg in warnings]
    assert names == ["clip_high_reward_unstable"]
    assert "lower the learning rate" in warnings[0][1]


def test_high_clip_fraction_alone_is_not_enough():
    run = healthy_run()
    for m in run:
        m["clip_ratio/region_mean"] = 0.3  # high clipping but the reward curve is smooth
    assert feed(Diagnostics(), run) == []


def test_thresholds_are_parameters_and_unknown_names_are_errors():
    run = healthy_run()
    run[50]["kl"] = 0.5
    assert feed(Diagnostics(kl_spike_factor=100.0), run) == []  # 25x is under a 100x threshold
    with pytest.raises(TypeError, match="kl_spike_facter.*allowed"):
        Diagnostics(kl_spike_facter=3.0)
    with pytest.raises(ValueError, match="window must be >= 2"):
        Diagnostics(window=1)


def test_reward_nan_for_five_steps_says_no_function_applies():
    run = healthy_run()
    for s in list(range(30, 40)) + list(range(70, 80)):  # every function returned None for every completion
        run[s].update({"reward": np.nan, "reward_std": np.nan, "frac_reward_zero_std": 1.0,
                       "rewards/accuracy/mean": np.nan, "rewards/format/mean": np.nan})
    warnings = feed(Diagnostics(), run)
    # NaN at 30, 31, 32, 33, 34: the fifth in a row fires; 40-69 are clear for 30 > rearm_steps=10
    # steps, so the second outage is a new episode. One warning each, not one per function too.
    assert [s for s, _ in warnings] == [34, 74]
    msg = warnings[0][1]
    assert "no_reward" in msg and "NaN for 5 steps in a row" in msg and "'accuracy', 'format'" in msg
    assert "field" in msg and "format they parse" in msg


def test_one_function_that_never_applies_is_named():
    run = healthy_run()
    for m in run:
        m["rewards/format/mean"] = np.nan  # e.g. it reads example["solution"] but the data has "answer"
    warnings = feed(Diagnostics(), run)
    assert [s for s, _ in warnings] == [4]  # steps 0-4: five in a row, then once for the whole run
    msg = warnings[0][1]
    assert "reward_fn_never_applies" in msg and "reward function 'format'" in msg
    assert "field-name or format mismatch" in msg and "'accuracy'" not in msg


def test_sometimes_none_is_not_never():
    run = healthy_run()
    for s, m in enumerate(run):
        if s % 5:  # 4 NaN steps in a row, then one where the function applied to something
            m["rewards/format/mean"] = np.nan
    assert feed(Diagnostics(), run) == []
    assert [s for s, _ in feed(Diagnostics(no_reward_steps=3), run)] == [3]
    with pytest.raises(ValueError, match="no_reward_steps must be >= 1"):
        Diagnostics(no_reward_steps=0)


@pytest.mark.parametrize("stop_at", [5, 40, 52, 95])
def test_a_resumed_run_warns_at_the_same_steps_as_a_straight_one(stop_at):
    # Issue 30: the window was not in the checkpoint, so a resumed run relearned it and warned late
    # (kl_spike at step 18 instead of 11) or twice. Stopping after `stop_at` steps, saving
    # state_dict as JSON (the checkpoint's meta) and loading it into a new Diagnostics must give
    # the straight run's warnings: the entropy collapse (needs the first 10 values: the start
    # level), the spikes at 50 and 90, and the episode open at 52 (no second kl_spike at 53).
    run = healthy_run()
    run[50]["kl"], run[53]["kl"], run[90]["kl"] = 0.5, 0.5, 0.6
    for s in range(60, 120):
        run[s]["entropy"] = max(0.05, 0.85 - 0.03 * (s - 60))
    straight = feed(Diagnostics(), run)
    assert [s for s, _ in straight] == [50, 85, 90]

    first = Diagnostics()
    before = [(s, msg) for s in range(stop_at) for msg in first.update(s, run[s])]
    saved = json.loads(json.dumps(first.state_dict()))
    resumed = Diagnostics()
    resumed.load_state_dict(saved)
    after = [(s, msg) for s in range(stop_at, len(run)) for msg in resumed.update(s, run[s])]
    assert before + after == straight
    # Bounded: 3 * window + 1 values per metric, however long the run.
    assert max(len(v) for v in saved["history"].values()) <= 31


def test_every_advantage_zero_with_unequal_rewards_says_the_rewards_overflow():
    # Issue 30: a reward of 1e30 trained on advantages of 0 silently. In float32 the group's squared
    # deviations (1e60) overflow, its std is inf, and every (r - mean) / inf is 0, while the groups'
    # rewards do differ (frac_reward_zero_std 0.25 < 1): not the equal-rewards case.
    diag = Diagnostics()
    vanished = {"reward": 5e29, "frac_reward_zero_std": 0.25, "advantages/min": -0.0, "advantages/max": 0.0}
    (message,) = diag.update(1, vanished)
    assert message.startswith("[step 1] advantages_all_zero: every advantage is 0 although 75% of groups")
    assert "scale the reward functions' outputs" in message
    assert diag.update(2, vanished) == []  # one warning per episode
    # All groups with equal rewards also give zero advantages: that is high_zero_variance's case.
    assert Diagnostics().update(1, {**vanished, "frac_reward_zero_std": 1.0}) == []
    assert Diagnostics().update(1, {**vanished, "advantages/max": 0.7}) == []
