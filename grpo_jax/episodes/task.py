"""A task played as episodes: `with_environment(task, factory)` keeps the task's data, held-out checker
and reward functions, and adds the environment the trainer plays each row against.

    task = with_environment(make_task("jsonl", path="train.jsonl"), Calculator)   # a class: one per episode
    train.run(config, task=task)

From the command line `task.environment="my_pkg.envs:Calculator"` does the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from grpo_jax.rewards import WeightedReward


def environment_reward(prompts, completions, environment_reward=None, **_) -> list[float | None]:
    """The environment's own reward of each episode (the sum of its replies' rewards; None where it
    gave none, so this function does not count for that episode)."""
    if environment_reward is None:
        return [None] * len(completions)
    return [None if r is None else float(r) for r in environment_reward]


@dataclasses.dataclass
class WithEnvironment:
    """`task` played as episodes against `environment_factory()` (one environment per episode).
    Its reward functions are the task's, plus "environment" (`environment_reward`, weight
    `environment_weight`) for environments that score episodes themselves."""

    task: Any
    environment_factory: Callable[[], Any]
    environment_weight: float = 1.0

    @property
    def name(self) -> str:
        return self.task.name

    def reward_fns(self) -> list[WeightedReward]:
        own = list(self.task.reward_fns())
        if any(r.name == "environment" for r in own):
            return own
        return [*own, WeightedReward("environment", environment_reward, self.environment_weight)]

    def __getattr__(self, attr):  # train_example, eval_examples, eval_correct, extract_answer...
        if attr in ("task", "environment_factory", "environment_weight"):
            raise AttributeError(attr)
        return getattr(self.task, attr)


def with_environment(task, environment_factory: Callable[[], Any], *, environment_weight: float = 1.0
                     ) -> WithEnvironment:
    """`task` played as episodes against environments made by `environment_factory` (a class or a
    zero-argument callable)."""
    if not callable(environment_factory):
        raise ValueError(f"environment factory {environment_factory!r} is not callable; give a class or a "
                         "function that makes one environment")
    return WithEnvironment(task, environment_factory, environment_weight)
