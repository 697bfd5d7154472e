"""Training on episodes through the public `train.run(config, task=...)`: the model's second turn
is what earns the reward, the environment's reply sits between the turns, and the run reports the
episode metrics beside the usual ones."""

from __future__ import annotations

import dataclasses

import numpy as np

from grpo_jax.episodes import Reply
from grpo_jax.episodes.task import with_environment
from grpo_jax.training import train
from test_train import SevensTask, tiny_config


class AskThenAnswer:
    """Turn 1 is a question (any text); the environment answers "=" and the model's second turn is
    the answer the task scores. Counts its episodes' turns for the test to read."""

    def reset(self, **row):
        self.turns = 0
        return None

    def step(self, turn):
        self.turns += 1
        return Reply(text="=") if self.turns == 1 else Reply(done=True)


def test_a_two_turn_episode_trains_on_its_answer_turn(tmp_path):
    cfg = tiny_config(tmp_path)
    cfg = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, max_new_tokens=12),
                              task=dataclasses.replace(cfg.task, max_turns=2, max_tokens_per_turn=5),
                              train=dataclasses.replace(cfg.train, steps=30, checkpoint_every=0))
    result = train.run(cfg, task=with_environment(SevensTask(), AskThenAnswer))
    rows = [row for row in result.history if "reward" in row]
    assert len(rows) == 30
    for key in ("turns/mean", "turns/max", "tools/calls", "episode/env_tokens", "turns/retokenized",
                "time/environment", "rewards/sevens/mean", "kl", "grad_norm"):
        assert key in rows[-1], key
    # Random init writes a 7 about 1 time in 14 (of 4 scored characters: ~0.07); the answer turn learns.
    rewards = [row["reward"] for row in rows]
    assert np.mean(rewards[:3]) < 0.3, rewards[:3]
    assert np.mean(rewards[-5:]) > 0.5, rewards[-5:]
    assert 1.0 <= rows[-1]["turns/mean"] <= 2.0


class PaysPerTurn(AskThenAnswer):
    """AskThenAnswer, whose first turn earns 0.1 per '7' in it (a process reward)."""

    def step(self, turn):
        reply = super().step(turn)
        if self.turns == 1:
            reply.reward = 0.1 * turn.count("7")
        return reply


def test_turn_rewards_train_per_token(tmp_path):
    cfg = tiny_config(tmp_path)
    cfg = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, max_new_tokens=12),
                              task=dataclasses.replace(cfg.task, max_turns=2, max_tokens_per_turn=5,
                                                       turn_rewards="process"),
                              train=dataclasses.replace(cfg.train, steps=3, checkpoint_every=0))
    result = train.run(cfg, task=with_environment(SevensTask(), PaysPerTurn))
    rows = [row for row in result.history if "reward" in row]
    assert len(rows) == 3
    assert all(np.isfinite(row["loss"]) and np.isfinite(row["grad_norm"]) for row in rows)
    assert any(row["advantages/std"] > 0 for row in rows)
    # The turn rewards train per token, not again as the episode's reward function "environment".
    assert all(not np.isfinite(row.get("rewards/environment/mean", np.nan)) for row in rows)


def test_dynamic_sampling_and_truncation_work_on_episodes(tmp_path):
    """DAPO's dynamic sampling plays further rounds of episodes until groups disagree, and episodes
    that run out of budget are truncated and masked as single answers are."""
    cfg = tiny_config(tmp_path)
    cfg = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, max_new_tokens=8),
                              task=dataclasses.replace(cfg.task, max_turns=2, max_tokens_per_turn=4),
                              grpo=dataclasses.replace(cfg.grpo, dynamic_sampling=True, max_resample_rounds=2,
                                                       mask_truncated_completions=True),
                              train=dataclasses.replace(cfg.train, steps=3, checkpoint_every=0))
    result = train.run(cfg, task=with_environment(SevensTask(), AskThenAnswer))
    rows = [row for row in result.history if "reward" in row]
    assert len(rows) == 3
    assert all(1 <= row["dynamic_sampling/rounds"] <= 3 for row in rows)
    assert any(row["completions/clipped_ratio"] > 0 for row in rows)  # random turns often run out of budget
    # A step whose every episode was truncated has nothing to train (masked out), as for single answers.
    assert all(np.isfinite(row["loss"]) for row in rows if "loss" in row)
