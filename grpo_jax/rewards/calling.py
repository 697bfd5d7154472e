"""How a reward function is called: TRL's keyword convention, for built-in and user functions alike.

Every reward function is called with keyword arguments only, as TRL's GRPOTrainer calls them:

    fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., <data set columns>...,
       truncated=..., completion_lengths=..., step=..., pool=...)

so TRL's usual `def f(completions, **kwargs)` runs unchanged, and so does grpo_jax's older
`def f(prompts, completions, **fields)`. A function without `**kwargs` gets only the names it
declares (`def f(completions, answer)` works); one that needs a name the trainer does not have gets
an error naming the function, the missing name and the names on offer.

Completions follow TRL: plain strings when the prompts are text; when a prompt is a list of
messages, its completions are `[{"role": "assistant", "content": text}]` (TRL's conversational
form). Built-in functions (defined in grpo_jax) always get strings: they read text only.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """The part of TRL's `trainer_state` argument that applies here: the optimizer steps done so far
    (`global_step`, the step the completions were sampled for) and the run's length (`max_steps`,
    None where the caller does not know it)."""

    global_step: int
    max_steps: int | None = None


class RewardLog:
    """TRL's `log_metric(name, value)` and `log_extra(column, values)` for reward functions: scalars
    averaged into the step's row under their own names, columns (one value per completion) added to
    the logged samples. A function run in a worker process (`rewards.workers > 0`) logs into
    the worker's copy, which is not collected."""

    def __init__(self):
        self.metrics: dict[str, list[float]] = {}
        self.extra: dict[str, list] = {}

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(str(name), []).append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        self.extra.setdefault(str(column), []).extend(values)

    def means(self) -> dict[str, float]:
        return {name: float(sum(v) / len(v)) for name, v in self.metrics.items() if v}


def is_conversational(prompt: Any) -> bool:
    """True for a prompt given as messages ([{"role", "content"}, ...]), TRL's conversational form."""
    return isinstance(prompt, (list, tuple))


def trl_completions(prompts: Sequence[Any], completions: Sequence[str]) -> list:
    """Completions as TRL hands them to a reward function: each a one-message list
    `[{"role": "assistant", "content": text}]` where its prompt is messages, the text otherwise."""
    return [[{"role": "assistant", "content": c}] if is_conversational(p) else c
            for p, c in zip(prompts, completions)]


def call_arguments(name: str, fn: Callable, offered: Mapping[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """(args, kwargs) to call `fn` with: every offered name it takes, by keyword (all of them when it
    takes **kwargs); a positional-only parameter (`def f(prompts, completions, /)`) by position.
    Raises ValueError naming the function when its signature cannot take the call (a required
    parameter the trainer does not offer). A function Python cannot inspect gets every keyword."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return (), dict(offered)
    params = list(sig.parameters.values())
    positional_only = [p.name for p in params if p.kind is p.POSITIONAL_ONLY]
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    args = tuple(offered[n] for n in positional_only if n in offered)
    kwargs = {k: v for k, v in offered.items()
              if k not in positional_only and (var_kw or k in named)}
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise ValueError(
            f"reward function {name!r} cannot take the call: {e}. Reward functions are called with keyword "
            f"arguments only, here {sorted(offered)} (TRL's convention; write e.g. "
            "`def my_reward(completions, answer, **kwargs) -> list[float | None]`)") from e
    return args, kwargs


# What the trainer passes every reward function besides the examples' fields (rollout.score_rollout).
TRAINER_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra",
                     "truncated", "completion_lengths", "step", "pool")


def check_signatures(reward_fns: Sequence[Any], example_fields: Sequence[str]) -> None:
    """Raises the ValueError of `call_arguments` for the first reward function (a WeightedReward)
    whose signature cannot take the trainer's call, before any sampling: a run stops at start-up,
    not at its first step."""
    offered = dict.fromkeys([*TRAINER_ARGUMENTS, *example_fields])
    for r in reward_fns:
        call_arguments(r.name, r.fn, offered)


def call_reward(name: str, fn: Callable, offered: Mapping[str, Any]):
    """fn called as `call_arguments` says: a wrapper's way to call the function it wraps."""
    args, kwargs = call_arguments(name, fn, offered)
    return fn(*args, **kwargs)


def unwrapped(fn: Callable) -> Callable:
    """fn after unwrapping `__wrapped__` and functools.partial (a chain, not a cycle: 16 at most)."""
    for _ in range(16):
        inner = fn.func if isinstance(fn, functools.partial) else getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = inner
    return fn


def is_builtin(fn: Callable) -> bool:
    """True for a reward function defined in grpo_jax, after unwrapping."""
    module = getattr(unwrapped(fn), "__module__", None) or ""
    return module == "grpo_jax" or module.startswith("grpo_jax.")
