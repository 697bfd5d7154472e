"""Your own reward functions on any task: given as callables (Python) or import paths (the command
line's `rewards.reward_funcs`), with TRL's `reward_weights`.

    task = with_reward_funcs(make_task("jsonl", path="train.jsonl"), [my_reward, "my_pkg.rewards:brevity"])

The task keeps its data, its held-out checker and its answer extraction; only `reward_fns()` changes.
Functions are called as TRL's GRPOTrainer calls them (`grpo_jax.rewards.calling`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from grpo_jax.config.import_paths import import_object

from .base import RewardSpec


def import_reward(path: str) -> Callable:
    """The function at `path`, "package.module:function" (or "package.module.function", TRL's CLI
    form). Raises ValueError naming the path and what went wrong."""
    fn = import_object(path, "reward function")
    if not callable(fn):
        raise ValueError(f"reward function {path!r} is a {type(fn).__name__}, not a function")
    return fn


def reward_specs(funcs: Sequence[Callable | str], weights: Sequence[float] = ()) -> list[RewardSpec]:
    """One RewardSpec per function (an import path is imported), named after the function (a
    repeated name gets _2, _3...), weighted by `weights` (TRL's reward_weights; empty: 1.0 each)."""
    if isinstance(funcs, (str, bytes)) or not funcs:
        raise ValueError(f"reward_funcs={funcs!r}: expected a non-empty list of functions or import paths")
    if weights and len(weights) != len(funcs):
        raise ValueError(f"reward_weights has {len(weights)} entries for {len(funcs)} reward_funcs; give one "
                         "weight per function, or none (1.0 each)")
    specs, seen = [], {}
    for i, f in enumerate(funcs):
        fn = import_reward(f) if isinstance(f, str) else f
        if not callable(fn):
            raise ValueError(f"reward_funcs[{i}]={f!r} is not callable")
        weight = float(weights[i]) if weights else 1.0
        if not math.isfinite(weight):
            raise ValueError(f"reward_weights[{i}]={weights[i]!r}: must be a finite number")
        base = getattr(fn, "__name__", None) or type(fn).__name__
        seen[base] = seen.get(base, 0) + 1
        specs.append(RewardSpec(base if seen[base] == 1 else f"{base}_{seen[base]}", fn, weight))
    return specs


@dataclasses.dataclass
class WithRewards:
    """`task` with its reward functions replaced by `rewards`; everything else is the task's."""

    task: Any
    rewards: list[RewardSpec]

    @property
    def name(self) -> str:
        return self.task.name

    def reward_fns(self) -> list[RewardSpec]:
        return list(self.rewards)

    def __getattr__(self, attr):  # train_example, eval_examples, eval_correct, check_prompt_lengths...
        if attr in ("task", "rewards"):
            raise AttributeError(attr)
        return getattr(self.task, attr)


def with_reward_funcs(task, funcs: Sequence[Callable | str], weights: Sequence[float] = ()) -> WithRewards:
    """`task` trained on `funcs` (callables or import paths) instead of its own reward functions."""
    return WithRewards(task, reward_specs(funcs, weights))
