"""The step record's logged times (`grpo_jax.training.step_record`), the one place time/* and
tokens_per_second are derived, on a hand-made step whose times are exact binary fractions (so every
difference below is exact: no tolerance)."""

from __future__ import annotations

import types

import numpy as np

from grpo_jax.training.step_record import StepRecord
from grpo_jax.training.timing import PhaseTiming


class _ReadyAt:
    """A `timing.ReadyAt` whose arrays were ready at a time the test chooses."""

    def __init__(self, t):
        self.t = t

    def time(self):
        return self.t


def _record(logprobs_ready):
    # The rollout started at 10 s (devices free), its batch was on the host at 12 s after 0.5 s of
    # reward functions; 36 completion tokens.
    batch = types.SimpleNamespace(device_start=10.0, finished_at=12.0, reward_seconds=0.5,
                                  arrays={"mask": np.ones((4, 9), np.int32)})
    return StepRecord(step=3, batch=batch, advantages=np.zeros(4, np.float32), update_metrics=[],
                      logprobs=PhaseTiming(12.0, logprobs_ready), update=PhaseTiming(12.125, _ReadyAt(14.5)))


def test_times_of_a_step_whose_update_waited_for_the_logprob_pass():
    times = _record(_ReadyAt(12.25)).times(update_ready_at=14.5)
    assert times == {
        "time/rollout": 1.5,  # 12 - 10 - 0.5: sampling and decoding, rewards apart
        "time/reward": 0.5,
        "time/logprobs": 0.25,  # dispatched at 12, ready at 12.25
        # Dispatched at 12.125, but the device runs in order: the update started at 12.25.
        "time/update": 2.25,
        "time/step": 4.5,  # from the rollout's start to the update's end
        "tokens_per_second": 8.0,  # 36 tokens / 4.5 s
    }


def test_no_logprob_pass_takes_no_time_and_a_pipeline_period_is_the_step_time():
    # pi_old from the sampler and beta = 0: the phase dispatched nothing, so it ended when it began.
    # Asynchronous rollouts overlap the rollout with the updates: the step's time is the period from
    # the last update to this one (2.25 s here), and the throughput follows it.
    times = _record(None).times(update_ready_at=14.5, period=2.25)
    assert times["time/logprobs"] == 0.0
    assert times["time/update"] == 14.5 - 12.125
    assert times["time/step"] == 2.25
    assert times["tokens_per_second"] == 16.0  # 36 / 2.25
