"""VerifierPool: started once, order kept, a hung or crashed check costs one 0.0 and a worker."""

import os
import pickle
import threading
import time

import pytest

from grpo_jax.rewards import (
    RewardInterrupted,
    RewardTimeoutError,
    VerifierPool,
    WeightedReward,
    compute_rewards,
    math_accuracy_reward,
    math_accuracy_reward_fn,
    math_reward,
)
from grpo_jax.rewards.pool import CallTimeout, RemoteError


def _double(x):
    return 2.0 * x


def _sleep_if_negative(x):
    if x < 0:
        time.sleep(60)  # a hung checker
    return float(x)


def _crash_if_negative(x):
    if x < 0:
        os._exit(3)  # a checker that takes its process down (segfault, OOM kill)
    return float(x)


def _raise_if_negative(x):
    if x < 0:
        raise RuntimeError("checker bug")
    return float(x)


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(num_workers=2, timeout_s=2.0, max_chunk=4) as p:
        yield p


def test_map_keeps_order_across_chunks(pool):
    # 50 items, chunks of at most 4, two workers: results come back in input order.
    assert pool.map(_double, [(i,) for i in range(50)]) == [2.0 * i for i in range(50)]
    assert pool.map(_double, []) == []


def test_hung_item_scores_zero_and_the_rest_survive(pool):
    start = time.monotonic()
    out = pool.map(_sleep_if_negative, [(1,), (-1,), (3,), (4,), (5,)])
    assert out == [1.0, 0.0, 3.0, 4.0, 5.0]  # the hung item costs one 0.0 ...
    assert time.monotonic() - start < 10     # ... and its timeout (2 s; generous for a loaded 2-core machine)
    assert pool.restarts >= 1


def test_crashed_worker_is_replaced(pool):
    before = pool.restarts
    out = pool.map(_crash_if_negative, [(1,), (-1,), (2,), (-2,), (3,)])
    assert out == [1.0, 0.0, 2.0, 0.0, 3.0]
    assert pool.restarts == before + 2
    # The pool still works afterwards (same object, reused).
    assert pool.map(_double, [(1,), (2,)]) == [2.0, 4.0]


def test_raising_check_scores_zero_without_restart(pool):
    before = pool.restarts
    assert pool.map(_raise_if_negative, [(1,), (-1,)]) == [1.0, 0.0]
    assert pool.restarts == before


def test_math_accuracy_reward_through_the_pool(pool):
    completions = [r"\boxed{4}", r"\boxed{\sqrt{16}}", r"\boxed{9^{9^{9}}}", r"\boxed{2+2}", "none"]
    answers = ["4"] * 5
    assert math_accuracy_reward([""] * 5, completions, answer=answers, pool=pool) == [1.0, 1.0, 0.0, 1.0, 0.0]
    # Same scores as inline, item for item.
    assert [math_reward(c, a) for c, a in zip(completions, answers)] == [1.0, 1.0, 0.0, 1.0, 0.0]


def test_lenient_options_reach_the_workers(pool):
    # The symbolic cases go to the workers with their VerifyOptions: the lenient location and an
    # approximation tolerance must apply there as inline (3.1416 vs pi: 2.3e-6 relative error).
    fn = math_accuracy_reward_fn(location="lenient", approx_rtol=1e-4)
    completions = ["The answer is $\\sqrt{8}$.", "So $x \\approx 3.1416$.", "\\boxed{2\\sqrt2} or \\boxed{3}"]
    answers = ["2\\sqrt{2}", "\\pi", "2\\sqrt{2}"]
    assert fn([""] * 3, completions, answer=answers, pool=pool) == fn([""] * 3, completions, answer=answers)
    assert fn([""] * 3, completions, answer=answers, pool=pool) == [1.0, 1.0, 0.0]


def test_bad_arguments_and_closed_pool():
    with pytest.raises(ValueError, match="num_workers"):
        VerifierPool(num_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        VerifierPool(num_workers=1, timeout_s=0)
    p = VerifierPool(num_workers=1)
    p.close()
    with pytest.raises(RuntimeError, match="close"):
        p.map(_double, [(1,)])


# ------------------------------------------------------------------------------------------------
# call: one whole function call in a worker (user reward functions, with compute_rewards' timeout)


def _scale(values, *, by):
    return [by * v for v in values]


def test_call_returns_the_value_and_keeps_the_worker(pool):
    before = pool.restarts
    assert pool.call(_scale, ([1.0, 2.0],), {"by": 3.0}) == [3.0, 6.0]
    assert pool.call(_scale, ([1.0],), {"by": 0.5}, timeout_s=30.0) == [0.5]
    assert pool.restarts == before


def test_call_timeout_kills_and_replaces_the_worker(pool):
    before = pool.restarts
    with pytest.raises(CallTimeout, match="ran past 0.5 s"):
        pool.call(_sleep_if_negative, (-1,), timeout_s=0.5)
    assert pool.restarts == before + 1
    with pytest.raises(RemoteError, match="(?s)raised RuntimeError: checker bug.*traceback"):
        pool.call(_raise_if_negative, (-1,))
    with pytest.raises(pickle.PicklingError, match="cannot pickle"):
        pool.call(lambda: 1.0)


def _user_pid(prompts, completions, **_):
    return [float(os.getpid())] * len(completions)


def _user_hang(prompts, completions, **_):
    time.sleep(60)  # a user's reward function stuck on one input
    return [1.0] * len(completions)


def _user_crash(prompts, completions, **_):
    os._exit(3)  # takes its process down (segfault, OOM kill)


def _user_raises(prompts, completions, **_):
    raise KeyError("answer")


def _user_generator(prompts, completions, **_):
    return (1.0 for _ in completions)


def _user_pool_arg(prompts, completions, *, pool=None, **_):
    return [float(pool is None)] * len(completions)


def test_user_reward_functions_run_in_a_worker_process(pool):
    fns = [WeightedReward("pid", _user_pid), WeightedReward("pool_arg", _user_pool_arg),
           WeightedReward("math", math_accuracy_reward)]
    _, per_fn = compute_rewards(fns, ["q"] * 2, [r"\boxed{4}", r"\boxed{\sqrt{16}}"], {"answer": ["4", "4"]},
                                pool=pool, timeout_s=30.0)
    assert per_fn["pid"][0] not in (float(os.getpid()), 0.0)  # another process ...
    assert per_fn["pool_arg"].tolist() == [1.0, 1.0]          # ... which gets pool=None
    assert per_fn["math"].tolist() == [1.0, 1.0]              # built-ins run here, sending sympy items to the pool


def test_hung_user_function_is_killed_after_the_timeout(pool):
    before = pool.restarts
    start = time.monotonic()
    with pytest.raises(RewardTimeoutError, match="'slow' did not return within timeout_s=0.5 s") as e:
        compute_rewards([WeightedReward("slow", _user_hang)], ["q"] * 2, ["a", "b"], {}, pool=pool, timeout_s=0.5)
    assert time.monotonic() - start < 10  # 0.5 s once loaded; a fresh worker's start-up is not counted
    assert "killed and replaced" in str(e.value) and "rewards.timeout_s" in str(e.value)
    assert pool.restarts == before + 1
    _, per_fn = compute_rewards([WeightedReward("pid", _user_pid)], ["q"], ["a"], {}, pool=pool, timeout_s=30.0)
    assert per_fn["pid"][0] > 0  # the pool still works


class StopFlag:
    """The trainer's SIGTERM / Ctrl-C flag as a callable; remembers when it was raised."""

    def __init__(self):
        self.set_at = None

    def set(self):
        self.set_at = time.monotonic()

    def __call__(self) -> bool:
        return self.set_at is not None


def test_should_stop_interrupts_a_hung_worker_promptly(pool):
    compute_rewards([WeightedReward("pid", _user_pid)], ["q"], ["a"], {}, pool=pool, timeout_s=30.0)  # warm
    stop = StopFlag()
    threading.Timer(0.5, stop.set).start()  # SIGTERM arrives mid-call; no timeout set
    with pytest.raises(RewardInterrupted, match="'slow' ran"):
        compute_rewards([WeightedReward("slow", _user_hang)], ["q"], ["a"], {}, pool=pool, should_stop=stop)
    assert time.monotonic() - stop.set_at < 0.5


@pytest.mark.parametrize("fn, fields, match", [
    (lambda prompts, completions, **_: [1.0], {}, "'user' cannot be sent to a worker process.*rewards.workers=0"),
    (_user_pid, {"lock": [threading.Lock()]}, "'user' cannot be sent to a worker process.*lock"),
    (_user_raises, {}, "'user' raised KeyError: 'answer'"),
    (_user_generator, {}, "'user' returned a generator, which cannot be pickled back"),
    (_user_crash, {}, "'user' killed its worker process \\(exit code 3\\)"),
])
def test_user_function_errors_in_a_worker_name_the_function(pool, fn, fields, match):
    with pytest.raises(ValueError, match=match):
        compute_rewards([WeightedReward("user", fn)], ["q"], ["a"], fields, pool=pool, timeout_s=30.0)
