"""VerifierPool: started once, order kept, a hung or crashed check costs one 0.0 and a worker."""

import os
import time

import pytest

from grpo_jax.rewards import VerifierPool, math_accuracy_reward, math_reward


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


def test_bad_arguments_and_closed_pool():
    with pytest.raises(ValueError, match="num_workers"):
        VerifierPool(num_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        VerifierPool(num_workers=1, timeout_s=0)
    p = VerifierPool(num_workers=1)
    p.close()
    with pytest.raises(RuntimeError, match="close"):
        p.map(_double, [(1,)])
