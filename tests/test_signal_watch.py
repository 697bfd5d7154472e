"""Settings that eat the signal are named once; a step that trained on no token logs no per-token
metric (never 0); a mean stays within its min and max."""

import dataclasses
import logging
import math

import jax.numpy as jnp

from grpo_jax.training import metric_rules, rollout as rollout_lib, step as step_lib, train
from grpo_jax.io import plot
from grpo_jax.config import Config, OptimSection, TrainSection
from grpo_jax.training.signal_watch import SignalWatch, startup_warnings
from test_train import SevensTask, tiny_config

PER_TOKEN = ("entropy", "kl", "ratio/mean", "ratio/min", "ratio/max", "sampling/importance_sampling_ratio/mean",
             "clip_ratio/region_mean", "grad_norm", "loss")


def test_a_step_without_tokens_has_no_per_token_metrics():
    # What the losses give for an all-masked batch: means 0 over max(tokens, 1), min/max 1 by convention.
    update = {"num_tokens": 0.0, "entropy": 0.0, "kl": 0.0, "ratio/mean": 0.0, "ratio/min": 1.0, "ratio/max": 1.0,
              "grad_norm": 0.0, "loss": 0.0, "skipped_updates": 0.0}
    row = {**step_lib.combine_update_metrics([update, update]), "reward": 0.5, "completions/clipped_ratio": 1.0}
    assert row["ratio/mean"] == 0.0 and row["ratio/min"] == 1.0  # today's row: a mean outside its bounds
    out = metric_rules.without_masked_step_metrics(row, [update, update])
    assert out == {"skipped_updates": 0.0, "reward": 0.5, "completions/clipped_ratio": 1.0, "masked_step": 1.0}
    # One token anywhere in the step: the row is kept whole.
    assert metric_rules.without_masked_step_metrics(row, [update, {**update, "num_tokens": 1.0}]) == row


def test_a_token_mean_is_clamped_into_its_bounds():
    # Every update saw ratio 1.7489662170410156 (a float32) exactly; weighted by 5 and 20 tokens in
    # float64 the mean comes out one ulp above it: 5/25 and 20/25 are not exact binary fractions.
    x = 1.7489662170410156
    updates = [{"num_tokens": t, "ratio/mean": x, "ratio/min": x, "ratio/max": x} for t in (5.0, 20.0)]
    row = step_lib.combine_update_metrics(updates)
    assert row["ratio/mean"] > row["ratio/max"]  # the float64 weighted sum: 1.7489662170410158
    clamped = metric_rules.means_within_bounds(row)
    assert clamped["ratio/min"] <= clamped["ratio/mean"] <= clamped["ratio/max"]
    assert clamped["ratio/mean"] == x
    # NaN and unbounded means pass through.
    assert math.isnan(metric_rules.means_within_bounds({"a/mean": math.nan, "a/max": 1.0})["a/mean"])


def test_startup_warnings_name_warmup_and_a_learning_rate_that_rounds_away():
    cfg = Config(optim=OptimSection(learning_rate=1e-5, warmup_steps=20), train=TrainSection(steps=3))
    (warmup,) = startup_warnings(cfg, updates_per_step=1)
    # 3 of 20 warm-up updates: the learning rate ends at 3/20 of 1e-5.
    assert "optim.warmup_steps=20 updates is not shorter than the run (3 updates" in warmup
    assert "ends at 1.5e-06" in warmup
    # float32 weights near 0.02 are 0.02 * 2^-23 = 2.4e-9 apart: an Adam step of 1e-10 (a typo for
    # 1e-6) rounds away; half a unit, 1.2e-9, is the line.
    (lr,) = startup_warnings(Config(optim=OptimSection(learning_rate=1e-10)), updates_per_step=1)
    assert "optim.learning_rate=1e-10 is below half a unit in the last place" in lr and "(1.2e-09)" in lr
    # No warm-up and 1e-5: no warning.
    assert startup_warnings(Config(optim=OptimSection(learning_rate=1e-5)), updates_per_step=1) == []


def test_watch_warns_once_per_kind_and_counts_masked_steps(caplog):
    watch = SignalWatch(Config(), updates_per_step=1)
    row = {"completions/truncated_reward_zeroed": 0.625, "completions/clipped_ratio": 1.0, "reward": 0.0,
           "masked_step": 1.0}
    with caplog.at_level(logging.WARNING, logger="grpo_jax"):
        for step in (1, 2, 3):
            watch.update(step, row)
        watch.close()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("rewards.truncated_reward='at_most_zero' set 62% of the completions' rewards to 0" in m
               for m in messages) == 1
    assert sum("step 1: every completion was masked" in m for m in messages) == 1
    assert "3 step(s) had every completion masked" in messages[-1]


def test_all_masked_run_logs_no_zeros_and_warns(tmp_path, caplog, monkeypatch):
    # Every completion reads as truncated (as when all run into max_new_tokens, the repro):
    # with mask_truncated_completions no token trains, and "at_most_zero" zeroes the sevens reward.
    score_rollout = rollout_lib.score_rollout

    def all_truncated(pending, *args, **kwargs):
        pending.sample.truncated_B = jnp.ones_like(pending.sample.truncated_B)
        return score_rollout(pending, *args, **kwargs)

    monkeypatch.setattr(rollout_lib, "score_rollout", all_truncated)
    cfg = tiny_config(tmp_path)
    cfg = dataclasses.replace(
        cfg, grpo=dataclasses.replace(cfg.grpo, mask_truncated_completions=True),
        optim=dataclasses.replace(cfg.optim, warmup_steps=20),
        train=dataclasses.replace(cfg.train, steps=2, checkpoint_every=0),
        rewards=dataclasses.replace(cfg.rewards, truncated_reward="at_most_zero"))
    with caplog.at_level(logging.WARNING, logger="grpo_jax"):
        result = train.run(cfg, task=SevensTask())
    rows = [r for r in result.history if "reward" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["masked_step"] == 1.0 and r["completions/clipped_ratio"] == 1.0
        assert not [k for k in PER_TOKEN if k in r], r
        assert r["reward"] == 0.0 and r["rewards/sevens/mean"] > 0  # the cap ate what the function gave
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert text.count("every completion was masked") == 1
    assert text.count("rewards.truncated_reward='at_most_zero' set") == 1
    assert "optim.warmup_steps=20 updates is not shorter than the run (4 updates" in text  # 2 steps x 2 minibatches
    assert "2 step(s) had every completion masked" in text
    plot.plot_run(result.run_dir)  # the plots skip the missing values
