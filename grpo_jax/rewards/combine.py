"""Several reward functions at once (weighted, each logged), and the seed's Part 3 combinations.

A RewardFn is a plain callable `f(prompts, completions, **fields) -> list[float | None]`, one value
per completion; None means "not applicable to this example" and is skipped in the total.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence

import numpy as np

RewardFn = Callable[..., list]


@dataclasses.dataclass(frozen=True)
class WeightedReward:
    name: str
    fn: RewardFn
    weight: float = 1.0


def compute_rewards(reward_fns: Sequence[WeightedReward], prompts: list[str], completions: list[str],
                    fields: dict[str, list], *, pool=None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Runs every reward function and sums them.

    Returns:
      total_N: float32 [N], nansum over functions of weight * value (None -> NaN -> skipped); NaN
        where every function returned None for that completion.
      per_fn: name -> float32 [N] raw values (NaN for None), for logging each reward on its own.
    Each fn is called as fn(prompts, completions, **fields, pool=pool). A fn that raises, returns
    the wrong number of values or a non-number: ValueError naming the function.
    """
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"compute_rewards: {len(prompts)} prompts but {n} completions")
    names = [r.name for r in reward_fns]
    if len(set(names)) != len(names):
        raise ValueError(f"compute_rewards: reward names must be unique, got {names}")
    for key, value in fields.items():
        if isinstance(value, (list, tuple, np.ndarray)) and len(value) != n:
            raise ValueError(f"compute_rewards: field {key!r} has {len(value)} entries, expected {n}")
    per_fn: dict[str, np.ndarray] = {}
    weighted = []
    for r in reward_fns:
        try:
            values = r.fn(prompts, completions, **fields, pool=pool)
        except Exception as e:  # noqa: BLE001 -- re-raised with the function's name
            raise ValueError(f"reward function {r.name!r} raised {type(e).__name__}: {e}") from e
        if values is None or len(values) != n:
            got = "None" if values is None else f"{len(values)} values"
            raise ValueError(f"reward function {r.name!r} returned {got}; expected {n} (one per completion)")
        arr = np.empty(n, np.float32)
        for i, v in enumerate(values):
            if v is None:
                arr[i] = np.nan
                continue
            try:
                arr[i] = float(v)
            except (TypeError, ValueError) as e:
                raise ValueError(f"reward function {r.name!r} returned {v!r} at index {i}; "
                                 "expected a float or None") from e
            if math.isnan(arr[i]):
                raise ValueError(f"reward function {r.name!r} returned NaN at index {i}; return None for "
                                 "'not applicable'")
        per_fn[r.name] = arr
        weighted.append(np.float32(r.weight) * arr)
    if not weighted:
        return np.full(n, np.nan, np.float32), per_fn
    stacked = np.stack(weighted)
    all_none = np.all(np.isnan(stacked), axis=0)
    total = np.where(all_none, np.nan, np.nansum(stacked, axis=0)).astype(np.float32)
    return total, per_fn


# ------------------------------------------------------------------------------------------------
# Seed Part 3: accuracy + format combinations (pure, elementwise on [N] arrays)


def weighted_sum(acc_N, fmt_N, lambda_: float) -> np.ndarray:
    """r = r_acc + lambda * r_fmt: early signal; lambda < 1 keeps correctness first."""
    return np.asarray(acc_N, np.float32) + np.float32(lambda_) * np.asarray(fmt_N, np.float32)


def gate(acc_N, fmt_N) -> np.ndarray:
    """r = r_acc * r_fmt: strict; no signal until the format is learned."""
    return np.asarray(acc_N, np.float32) * np.asarray(fmt_N, np.float32)


def penalty(acc_N, fmt_N, lambda_: float) -> np.ndarray:
    """r = r_acc - lambda * (1 - r_fmt): the sum's ranking, shifted so "unformatted" is negative."""
    return np.asarray(acc_N, np.float32) - np.float32(lambda_) * (1 - np.asarray(fmt_N, np.float32))


def check_format_weight(lambda_: float, *, max_format: float = 1.0, min_accuracy_gap: float = 1.0) -> bool:
    """Seed Part 3 rule of thumb: lambda * max(r_fmt) < min gap in r_acc (lambda < 1 for 0/1 rewards).

    Warns (UserWarning) and returns False when the format bonus can outweigh correctness: then a
    wrong but formatted answer can out-score a correct unformatted one and be pushed up.
    """
    if lambda_ * max_format >= min_accuracy_gap:
        warnings.warn(
            f"format weight lambda={lambda_} can outweigh correctness: lambda * max(r_fmt) = "
            f"{lambda_ * max_format} >= the accuracy gap {min_accuracy_gap}; a wrong but well-formatted "
            "answer would out-score a correct one (seed Part 3). Use lambda < 1 for 0/1 rewards.",
            stacklevel=2,
        )
        return False
    return True


@dataclasses.dataclass(frozen=True)
class LambdaSchedule:
    """lambda(step) falling from `start` to `end` over `steps` (linear or cosine), then held at `end`.

    Strong format signal early, correctness later (seed Part 3, "Schedule").
    """

    start: float
    end: float
    steps: int
    kind: str = "linear"

    def __post_init__(self):
        if self.steps <= 0:
            raise ValueError(f"LambdaSchedule.steps must be > 0, got {self.steps}")
        if self.kind not in ("linear", "cosine"):
            raise ValueError(f"LambdaSchedule.kind must be 'linear' or 'cosine', got {self.kind!r}")
        check_format_weight(self.start)

    def __call__(self, step: int) -> float:
        frac = min(max(step, 0), self.steps) / self.steps
        if self.kind == "cosine":
            frac = 0.5 * (1 - math.cos(math.pi * frac))
        return self.start + (self.end - self.start) * frac


def scheduled(fn: RewardFn, schedule: Callable[[int], float]) -> RewardFn:
    """A RewardFn whose values are scaled by schedule(step), `step` being the trainer's field."""

    def scaled(prompts, completions, *, step: int = 0, **fields):
        scale = schedule(step)
        values = fn(prompts, completions, step=step, **fields)
        return [None if v is None else scale * v for v in values]

    scaled.__name__ = f"scheduled_{getattr(fn, '__name__', 'reward')}"
    return scaled
