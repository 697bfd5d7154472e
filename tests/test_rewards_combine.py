"""Combining rewards (seed Part 3), the user-facing RewardFn API, length rewards, format reward."""

import math
import threading
import time
import warnings

import numpy as np
import pytest

from grpo_jax.rewards import (
    LambdaSchedule,
    RewardInterrupted,
    RewardTimeoutError,
    WeightedReward,
    check_format_weight,
    compute_rewards,
    format_reward_fn,
    gate,
    math_accuracy_reward,
    penalty,
    scheduled,
    soft_overlong_penalty,
    truncation_gate,
    truncation_gated,
    weighted_sum,
)

ACC = [1.0, 1.0, 0.0, 0.0]  # seed Part 3 table: o1 correct+formatted, o2 correct, o3 formatted, o4 neither
FMT = [1.0, 0.0, 1.0, 0.0]


def _advantages(r):
    r = np.asarray(r, np.float64)
    return (r - r.mean()) / r.std(ddof=1)


def test_weighted_sum_lambda_half_matches_seed():
    # lambda = 0.5: rewards 1.5, 1.0, 0.5, 0; advantages +1.16, +0.39, -0.39, -1.16.
    r = weighted_sum(ACC, FMT, 0.5)
    np.testing.assert_allclose(r, [1.5, 1.0, 0.5, 0.0])
    np.testing.assert_allclose(_advantages(r), [1.16, 0.39, -0.39, -1.16], atol=0.005)


def test_weighted_sum_lambda_two_pushes_wrong_answer_up_and_warns():
    # lambda = 2: rewards 3, 1, 2, 0; the wrong-but-formatted o3 gets +0.39, the correct o2 -0.39.
    r = weighted_sum(ACC, FMT, 2.0)
    np.testing.assert_allclose(_advantages(r), [1.16, -0.39, 0.39, -1.16], atol=0.005)
    with pytest.warns(UserWarning, match="outweigh correctness"):
        assert check_format_weight(2.0) is False
    with pytest.warns(UserWarning):
        check_format_weight(1.0)  # lambda = 1 ties a correct unformatted and a wrong formatted answer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_format_weight(0.5) is True


def test_gate_and_penalty():
    np.testing.assert_allclose(gate(ACC, FMT), [1.0, 0.0, 0.0, 0.0])           # strict: only o1
    np.testing.assert_allclose(penalty(ACC, FMT, 0.5), [1.0, 0.5, 0.0, -0.5])  # unformatted < 0 when wrong
    # Same ranking as the weighted sum (a constant shift of lambda).
    np.testing.assert_allclose(penalty(ACC, FMT, 0.5) + 0.5, weighted_sum(ACC, FMT, 0.5))


def test_lambda_schedule_falls_then_holds():
    lin = LambdaSchedule(start=0.5, end=0.1, steps=100)
    assert [lin(s) for s in (0, 50, 100, 500)] == pytest.approx([0.5, 0.3, 0.1, 0.1])
    cos = LambdaSchedule(start=0.5, end=0.1, steps=100, kind="cosine")
    assert cos(50) == pytest.approx(0.3) and cos(25) == pytest.approx(0.1 + 0.4 * (1 + math.cos(math.pi / 4)) / 2)
    with pytest.warns(UserWarning):
        LambdaSchedule(start=1.5, end=0.1, steps=10)
    with pytest.raises(ValueError, match="kind"):
        LambdaSchedule(start=0.5, end=0.1, steps=10, kind="step")


def _half_applicable(prompts, completions, **_):
    return [1.0 if i % 2 == 0 else None for i in range(len(completions))]


def _none_at_all(prompts, completions, **_):
    return [None] * len(completions)


def test_compute_rewards_weighted_sum_and_per_function_logs():
    completions = [
        "<think>\nok\n</think>\n<answer>\n\\boxed{4}\n</answer>",  # correct + formatted
        "\\boxed{4}",                                              # correct only
        "<think>\nok\n</think>\n<answer>\n\\boxed{5}\n</answer>",  # formatted only
        "5",                                                       # neither
    ]
    fields = {"answer": ["4"] * 4, "truncated": [False] * 4, "completion_lengths": [10] * 4, "step": 0}
    fns = [WeightedReward("accuracy", math_accuracy_reward), WeightedReward("format", format_reward_fn, 0.5),
           WeightedReward("sparse", _half_applicable, 0.25)]
    total, per_fn = compute_rewards(fns, ["q"] * 4, completions, fields)
    assert total.dtype == np.float32 and total.shape == (4,)
    # None is skipped: items 1 and 3 get nothing from "sparse".
    np.testing.assert_allclose(total, [1.5 + 0.25, 1.0, 0.5 + 0.25, 0.0])
    np.testing.assert_allclose(per_fn["format"], [1, 0, 1, 0])
    assert np.isnan(per_fn["sparse"][1]) and per_fn["sparse"][0] == 1.0


def test_compute_rewards_all_none_is_nan():
    total, per_fn = compute_rewards([WeightedReward("n", _none_at_all)], ["q"] * 2, ["a", "b"], {})
    assert np.isnan(total).all() and np.isnan(per_fn["n"]).all()


def _raises(prompts, completions, **_):
    raise KeyError("answer")


def _short(prompts, completions, **_):
    return [1.0]


def _text(prompts, completions, **_):
    return ["yes"] * len(completions)


@pytest.mark.parametrize("fn, match", [
    (_raises, "'broken' raised KeyError"),
    (_short, "'broken' returned 1 values; expected 2"),
    (_text, "'broken' returned 'yes' at index 0"),
])
def test_compute_rewards_errors_name_the_function(fn, match):
    with pytest.raises(ValueError, match=match):
        compute_rewards([WeightedReward("broken", fn)], ["q"] * 2, ["a", "b"], {})


def test_compute_rewards_rejects_bad_fields_and_duplicate_names():
    with pytest.raises(ValueError, match="field 'answer' has 1 entries, expected 2"):
        compute_rewards([WeightedReward("f", format_reward_fn)], ["q"] * 2, ["a", "b"], {"answer": ["1"]})
    with pytest.raises(ValueError, match="unique"):
        compute_rewards([WeightedReward("f", format_reward_fn)] * 2, ["q"], ["a"], {})


def test_scheduled_reward_scales_by_step():
    fn = scheduled(format_reward_fn, LambdaSchedule(start=0.5, end=0.0, steps=10))
    good = "<think>\na\n</think>\n<answer>\nb\n</answer>"
    total, _ = compute_rewards([WeightedReward("fmt", fn)], ["q"], [good], {"step": 5})
    assert total[0] == pytest.approx(0.25)


def test_soft_overlong_penalty_dapo():
    # max_len 100, cache 20: no penalty up to 80, linear to -1 at 100, -1 beyond.
    assert soft_overlong_penalty([50, 80, 90, 100, 101], max_len=100, cache_len=20) == [0.0, 0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="cache_len"):
        soft_overlong_penalty([1], max_len=10, cache_len=11)


def test_truncation_gate():
    assert truncation_gate([1.0, 1.0, None, None], [False, True, False, True]) == [1.0, 0.0, None, 0.0]
    gated = truncation_gated(math_accuracy_reward)
    assert gated(["q"] * 2, ["\\boxed{4}"] * 2, answer=["4"] * 2, truncated=[False, True]) == [1.0, 0.0]


# ------------------------------------------------------------------------------------------------
# A user's reward function is hostile input too (issue "No silent data loss")


def _returns(value):
    def fn(prompts, completions, **_):
        return value
    return fn


@pytest.mark.parametrize("values, match", [
    # One inf among finite rewards makes the group's std inf and every advantage NaN: params NaN.
    ([1.0, math.inf], "'user' returned inf at index 1; rewards must be finite"),
    ([-math.inf, 0.0], "'user' returned -inf at index 0"),
    (np.array([0.0, np.inf]), "'user' returned inf at index 1"),
    ([1e39, 0.0], "returned 1e\\+39 at index 0, beyond float32's range"),  # float32(1e39) is inf
    ([0.0, 10**400], "returned inf at index 1"),                           # float() overflows
    ([math.nan, 0.0], "returned NaN at index 0; return None for 'not applicable'"),
    (np.array([0.0, np.nan]), "returned NaN at index 1; return None"),
])
def test_non_finite_reward_is_an_error_naming_function_index_value(values, match):
    with pytest.raises(ValueError, match=match) as e:
        compute_rewards([WeightedReward("user", _returns(values))], ["q"] * 2, ["a", "b"], {})
    assert "None for 'not applicable'" in str(e.value)  # the advice for a function that does not apply


@pytest.mark.parametrize("value, match", [
    ({1.0: "a", 0.0: "b"}, "'user' returned a dict; expected a list"),  # its two keys used to be the rewards
    ("10", "returned a str"),                                             # two characters, two "rewards"
    ({0.0, 1.0}, "returned a set"),
    ((x for x in [1.0, 0.0]), "returned a generator"),
    (None, "returned None; expected a list"),
    (np.array([[1.0], [0.0]]), r"returned an array of shape \(2, 1\)"),
    (np.float32(1.0), r"returned an array of shape \(\)"),
    (["1", "0.5"], "returned '1' at index 0; expected a float or None"),  # float("1") used to accept it
    ([[1.0], [0.0]], r"returned \[1.0\] at index 0"),
    ([1 + 0j, 0.0], r"returned \(1\+0j\) at index 0"),
])
def test_return_must_be_a_sequence_of_numbers_or_none(value, match):
    with pytest.raises(ValueError, match=match):
        compute_rewards([WeightedReward("user", _returns(value))], ["q"] * 2, ["a", "b"], {})


@pytest.mark.parametrize("value", [
    [1.0, None], (1, None), np.array([1.0, np.float64(0.5)]), np.array([True, False]),
    [np.float32(1.0), np.int64(0)], [True, 0], np.array([1.0, None], dtype=object),
])
def test_lists_tuples_and_numpy_arrays_of_numbers_are_fine(value):
    _, per_fn = compute_rewards([WeightedReward("user", _returns(value))], ["q"] * 2, ["a", "b"], {})
    assert per_fn["user"].dtype == np.float32 and per_fn["user"][0] == 1.0


def _hang(prompts, completions, **_):
    time.sleep(60)  # a reward function stuck on one input
    return [1.0] * len(completions)


def _on_main_thread(prompts, completions, **_):
    return [float(threading.current_thread() is threading.main_thread())] * len(completions)


def test_hung_function_times_out_in_a_thread_without_a_pool():
    start = time.monotonic()
    with pytest.raises(RewardTimeoutError, match="'slow' did not return within timeout_s=0.5 s") as e:
        compute_rewards([WeightedReward("slow", _hang)], ["q"] * 2, ["a", "b"], {}, timeout_s=0.5)
    assert 0.5 <= time.monotonic() - start < 3.0  # 0.5 s, plus a loaded 2-core machine's slack
    assert isinstance(e.value, ValueError)  # so callers that catch bad rewards catch this too
    assert "rewards.timeout_s" in str(e.value) and "rewards.workers > 0" in str(e.value)


class StopFlag:
    """The trainer's SIGTERM / Ctrl-C flag as a callable; remembers when it was raised."""

    def __init__(self):
        self.set_at = None

    def set(self):
        self.set_at = time.monotonic()

    def __call__(self) -> bool:
        return self.set_at is not None


def test_should_stop_interrupts_a_hung_function_promptly():
    stop = StopFlag()
    threading.Timer(0.3, stop.set).start()  # SIGTERM arrives 0.3 s into the reward call; no timeout set
    with pytest.raises(RewardInterrupted, match="'slow' ran.*should_stop"):
        compute_rewards([WeightedReward("slow", _hang)], ["q"] * 2, ["a", "b"], {}, should_stop=stop)
    assert time.monotonic() - stop.set_at < 0.5  # polled every 0.1 s: the trainer can save and stop at once


def test_functions_run_directly_without_a_timeout_and_builtins_always():
    fns = [WeightedReward("user", _on_main_thread), WeightedReward("math", math_accuracy_reward)]
    fields = {"answer": ["4", "4"]}
    # No timeout, no stop flag: called directly on this thread, as before (no overhead).
    _, per_fn = compute_rewards(fns, ["q"] * 2, [r"\boxed{4}", "5"], fields)
    assert per_fn["user"].tolist() == [1.0, 1.0]
    # With a timeout the user's function moves to a thread; the built-in stays here (its SIGALRM
    # limit needs the main thread), and scores the same.
    _, per_fn = compute_rewards(fns, ["q"] * 2, [r"\boxed{4}", "5"], fields, timeout_s=30.0)
    assert per_fn["user"].tolist() == [0.0, 0.0] and per_fn["math"].tolist() == [1.0, 0.0]
    # A wrapped user function is still the user's.
    sched = scheduled(_on_main_thread, LambdaSchedule(start=0.5, end=0.5, steps=1))
    _, per_fn = compute_rewards([WeightedReward("s", sched)], ["q"], ["a"], {"step": 0}, timeout_s=30.0)
    assert per_fn["s"].tolist() == [0.0]


def test_errors_in_a_thread_still_name_the_function():
    with pytest.raises(ValueError, match="'broken' raised KeyError"):
        compute_rewards([WeightedReward("broken", _raises)], ["q"] * 2, ["a", "b"], {}, timeout_s=30.0)
    with pytest.raises(ValueError, match="'broken' returned a dict"):
        compute_rewards([WeightedReward("broken", _returns({1: 2}))], ["q"], ["a"], {}, timeout_s=30.0)


@pytest.mark.parametrize("timeout_s", [0, -1.0, math.nan, True])
def test_timeout_must_be_none_or_positive(timeout_s):
    with pytest.raises(ValueError, match="timeout_s must be None \\(no limit\\) or > 0"):
        compute_rewards([WeightedReward("f", format_reward_fn)], ["q"], ["a"], {}, timeout_s=timeout_s)
