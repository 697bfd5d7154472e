"""Several reward functions at once (weighted, each logged), and the seed's Part 3 combinations.

A RewardFn is a plain callable `f(prompts=..., completions=..., **fields) -> list[float | None]`,
one value per completion, called with keyword arguments as TRL calls them (`calling.py`: TRL's
`def f(completions, **kwargs)` runs as written); None means "not applicable to this example" and is
skipped in the total.

A user's function is hostile input too: what it returns is checked (a sequence of finite numbers or
None, one per completion), and with a timeout or a stop flag it runs where it can be abandoned, in
a worker process of the pool (killed on timeout) or, without a pool, in a daemon thread. Built-in
functions (defined in grpo_jax) bound their own work and run on the calling thread.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import numbers
import pickle
import threading
import time
import warnings
from collections.abc import Callable, Sequence

import numpy as np

from grpo_jax.rewards import calling
from grpo_jax.rewards import pool as pool_lib

RewardFn = Callable[..., list]

_POLL_S = 0.1  # how often a wait checks should_stop(): a stop request is answered within ~0.1 s
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class RewardTimeoutError(ValueError):
    """A reward function's batch call ran past `timeout_s` (the trainer's `rewards.timeout_s`)."""


class RewardInterrupted(Exception):
    """`should_stop()` (the trainer's SIGTERM / Ctrl-C flag) became true while a reward function ran:
    this batch has no rewards; the trainer saves what it has and stops."""


@dataclasses.dataclass(frozen=True)
class WeightedReward:
    name: str
    fn: RewardFn
    weight: float = 1.0


def compute_rewards(reward_fns: Sequence[WeightedReward], prompts: list[str], completions: list[str],
                    fields: dict[str, list], *, pool=None, timeout_s: float | None = None,
                    should_stop: Callable[[], bool] | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Runs every reward function and sums them.

    Returns:
      total_N: float32 [N], nansum over functions of weight * value (None -> NaN -> skipped); NaN
        where every function returned None for that completion.
      per_fn: name -> float32 [N] raw values (NaN for None), for logging each reward on its own.
    Each fn is called once per batch with keywords, TRL's way (`calling.py`): prompts=, completions=
    (TRL's conversational form for a user function whose prompt is messages), the fields (data set
    columns, completion_ids, trainer_state, truncated, completion_lengths, step) and pool=; a fn
    without **kwargs gets only the names it declares. A signature that cannot take the call, a fn that
    raises, returns anything but a list / tuple / 1-D array of N numbers or None, or a NaN or
    infinite value: ValueError naming the function (and the index and value).

    timeout_s: seconds one function's batch call may take; None (the default) means no limit;
      otherwise it must be > 0. should_stop: polled every ~0.1 s while a function runs.
    With neither, every function is called directly (no thread, no process: today's cost). With
    either, a user function (one not defined in grpo_jax; wrappers are seen through `__wrapped__`)
    runs in a worker process of `pool` (killed and replaced on timeout; fn and its arguments must
    pickle; it gets pool=None) or, without a pool, in a daemon thread (abandoned on timeout: a
    thread cannot be killed). Built-in functions always run directly: they bound their own work
    (per-item limits, the pool, the sandbox), and math_reward's SIGALRM limit needs the main thread.
    Raises RewardTimeoutError (a ValueError) past timeout_s, RewardInterrupted when should_stop()
    returns true, checked before each isolated call and while waiting for it.
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
    if timeout_s is not None and (isinstance(timeout_s, bool) or not timeout_s > 0):
        raise ValueError(f"compute_rewards: timeout_s must be None (no limit) or > 0 seconds, got {timeout_s!r}")
    per_fn: dict[str, np.ndarray] = {}
    weighted = []
    for r in reward_fns:
        builtin = calling.is_builtin(r.fn)
        isolate = (timeout_s is not None or should_stop is not None) and not builtin
        offered = {"prompts": prompts,
                   "completions": completions if builtin else calling.trl_completions(prompts, completions),
                   **fields, "pool": pool if not isolate else None}
        args, kwargs = calling.call_arguments(r.name, r.fn, offered)
        if not isolate:
            try:
                values = r.fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 -- re-raised with the function's name
                raise ValueError(f"reward function {r.name!r} raised {type(e).__name__}: {e}") from e
        elif pool is not None:
            values = _call_in_worker(r, pool, args, kwargs, n, timeout_s, should_stop)
        else:
            values = _call_in_thread(r, args, kwargs, n, timeout_s, should_stop)
        arr = _reward_array(r.name, values, n)
        per_fn[r.name] = arr
        weighted.append(np.float32(r.weight) * arr)
    if not weighted:
        return np.full(n, np.nan, np.float32), per_fn
    stacked = np.stack(weighted)
    all_none = np.all(np.isnan(stacked), axis=0)
    total = np.where(all_none, np.nan, np.nansum(stacked, axis=0)).astype(np.float32)
    return total, per_fn


def _timeout_message(name: str, timeout_s: float, n: int, where: str) -> str:
    return (f"reward function {name!r} did not return within timeout_s={timeout_s:g} s for a batch of {n} "
            f"completions ({where}). If it is just slow, raise rewards.timeout_s; if it hangs on some "
            "input, fix it (time-limit its own per-completion work)")


def _interrupted(name: str, started: float) -> RewardInterrupted:
    return RewardInterrupted(f"stopped while reward function {name!r} ran ({time.monotonic() - started:.1f} s): "
                             "should_stop() became true (SIGTERM or Ctrl-C); this batch has no rewards")


def _call_in_thread(r: WeightedReward, args, kwargs, n, timeout_s, should_stop):
    """r.fn in a daemon thread; waits in slices of _POLL_S so a stop request or the timeout is seen."""
    started = time.monotonic()
    if should_stop is not None and should_stop():
        raise _interrupted(r.name, started)
    box: dict = {}
    done = threading.Event()

    def target():
        try:
            box["value"] = r.fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 -- re-raised on the caller's thread with the name
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=target, name=f"reward-{r.name}", daemon=True).start()
    deadline = math.inf if timeout_s is None else started + timeout_s
    while not done.wait(max(0.0, min(_POLL_S, deadline - time.monotonic()))):
        if should_stop is not None and should_stop():
            raise _interrupted(r.name, started)
        if time.monotonic() >= deadline:
            raise RewardTimeoutError(_timeout_message(
                r.name, timeout_s, n,
                "it ran in a thread of the trainer, which cannot be killed and may still be running; set "
                "rewards.workers > 0 to run reward functions in worker processes that are killed on "
                "timeout"))
    if "error" in box:
        e = box["error"]
        raise ValueError(f"reward function {r.name!r} raised {type(e).__name__}: {e}") from e
    return box["value"]


def _call_in_worker(r: WeightedReward, pool, args, kwargs, n, timeout_s, should_stop):
    """r.fn in one of the pool's worker processes (pool.call), errors renamed after the function."""
    started = time.monotonic()
    if should_stop is not None and should_stop():
        raise _interrupted(r.name, started)
    try:
        return pool.call(r.fn, args, kwargs, timeout_s=timeout_s,
                         should_stop=should_stop, poll_s=_POLL_S)
    except pickle.PicklingError as e:
        raise ValueError(
            f"reward function {r.name!r} cannot be sent to a worker process ({e}). With "
            "rewards.workers > 0 user reward functions run in worker processes, so the function and "
            "its arguments must pickle: define it at the top level of an importable module (not a lambda, a "
            "closure or a notebook cell), or set rewards.workers=0 to run it in a thread") from e
    except pool_lib.CallTimeout as e:
        raise RewardTimeoutError(_timeout_message(
            r.name, timeout_s, n, "its worker process was killed and replaced")) from e
    except pool_lib.CallInterrupted as e:
        raise _interrupted(r.name, started) from e
    except pool_lib.RemoteError as e:
        raise ValueError(f"reward function {r.name!r} {e}") from e


def _reward_array(name: str, values, n: int) -> np.ndarray:
    """float32 [n] from a reward function's return value (None -> NaN), or a ValueError saying what is wrong."""
    expected = f"expected a list (or tuple, or 1-D numpy array) of {n} floats or None, one per completion"
    if values is None:
        raise ValueError(f"reward function {name!r} returned None; {expected}")
    if isinstance(values, (str, bytes, bytearray, memoryview)) or not (
            isinstance(values, (collections.abc.Sequence, np.ndarray)) or hasattr(values, "__array__")):
        raise ValueError(f"reward function {name!r} returned a {type(values).__name__}; {expected}")
    if not isinstance(values, collections.abc.Sequence):  # an array: numpy, JAX, torch...
        values = np.asarray(values)
        if values.ndim != 1:
            raise ValueError(f"reward function {name!r} returned an array of shape {values.shape}; {expected}")
    if len(values) != n:
        raise ValueError(f"reward function {name!r} returned {len(values)} values; expected {n} (one per completion)")
    if isinstance(values, np.ndarray) and values.dtype.kind in "biuf":
        arr = values.astype(np.float64)
        bad = ~np.isfinite(arr) | (np.abs(arr) > _FLOAT32_MAX)
        if bad.any():
            i = int(np.argmax(bad))
            _raise_non_finite(name, i, float(arr[i]))
        return arr.astype(np.float32)
    arr = np.empty(n, np.float32)
    for i, v in enumerate(values):
        if v is None:
            arr[i] = np.nan
            continue
        if not (type(v) is float or type(v) is int or _is_number(v)):
            raise ValueError(f"reward function {name!r} returned {v!r} at index {i}; expected a float or None")
        try:
            x = float(v)
        except OverflowError:  # an int beyond float64
            x = math.inf
        if not (math.isfinite(x) and abs(x) <= _FLOAT32_MAX):
            _raise_non_finite(name, i, x)
        arr[i] = x
    return arr


def _raise_non_finite(name: str, i: int, x: float):
    if math.isnan(x):
        raise ValueError(f"reward function {name!r} returned NaN at index {i}; return None for 'not applicable'")
    beyond = ", beyond float32's range" if math.isfinite(x) else ""
    raise ValueError(f"reward function {name!r} returned {x!r} at index {i}{beyond}; rewards must be finite numbers "
                     "(clip or rescale it; return None for 'not applicable')")


def _is_number(v) -> bool:
    """A real number: int, float, bool, numpy scalars, or a 0-d array (a JAX scalar); not str or complex."""
    if isinstance(v, (numbers.Real, np.bool_)):
        return True
    return hasattr(v, "__array__") and getattr(v, "shape", None) == () and np.asarray(v).dtype.kind in "biuf"


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
    """A RewardFn whose values are scaled by schedule(step), `step` being the trainer's field.

    An object rather than a closure, so it pickles (to a worker process) when fn and schedule do.
    """
    return _Scheduled(fn, schedule)


@dataclasses.dataclass(frozen=True)
class _Scheduled:
    fn: RewardFn
    schedule: Callable[[int], float]

    @property
    def __wrapped__(self):  # compute_rewards judges the wrapped function (built-in or the user's)
        return self.fn

    @property
    def __name__(self):
        return f"scheduled_{getattr(self.fn, '__name__', 'reward')}"

    def __call__(self, prompts, completions, *, step: int = 0, **fields):
        scale = self.schedule(step)
        offered = {"prompts": prompts, "completions": completions, **fields, "step": step}
        values = calling.call_reward(self.__name__, self.fn, offered)
        return [None if v is None else scale * v for v in values]
