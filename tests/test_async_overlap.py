"""The rollout pipeline of `async_rollouts.RolloutWorker` (off_policy.max_staleness >= 1): step n+1
is sampled while step n's reward functions run, and nothing else about the batches changes.

Each test drives a worker directly on the tiny SevensTask model of tests/test_train.py, whose
reward sleeps like a judge service's round trip and writes down when it ran.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import jax
import numpy as np
import pytest

from grpo_jax.rewards import RewardInterrupted
from grpo_jax.tasks import RewardSpec
from grpo_jax.training import async_rollouts, run_context
from test_train import SevensTask, sevens_reward, tiny_config

STEPS = 4
JUDGE_S = 0.4  # each reward call's wait: far above a tiny model's sampler call (a few ms after compiling)


class JudgedSevens(SevensTask):
    """SevensTask whose reward waits `wait_s` per batch call first and logs (step, start, end);
    `fail_at`: the step whose call raises instead."""

    def __init__(self, wait_s: float, fail_at: int | None = None):
        self.wait_s, self.fail_at = wait_s, fail_at
        self.calls: list[tuple[int, float, float]] = []
        self.started = threading.Event()

    def reward_fns(self):
        def judged(prompts, completions, step, **fields):
            start = time.perf_counter()
            self.started.set()
            time.sleep(self.wait_s)
            if step == self.fail_at:
                raise ConnectionError(f"judge unreachable at step {step}")
            self.calls.append((step, start, time.perf_counter()))
            return sevens_reward(prompts, completions)

        return [RewardSpec("judged", judged, 1.0)]


class TimedSampler:
    """The rollout sampler, with the time of each call written down (calls come in step order)."""

    def __init__(self, sampler, fail_at_call: int | None = None):
        self.sampler, self.fail_at_call = sampler, fail_at_call
        self.called_at: list[float] = []

    def __call__(self, *args, **kwargs):
        self.called_at.append(time.perf_counter())
        if len(self.called_at) == self.fail_at_call:
            raise RuntimeError("sampler failed")
        return self.sampler(*args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self.sampler, attr)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One run context (k = 1) for every test: the model and its jitted sampler are built once."""
    cfg = tiny_config(tmp_path_factory.mktemp("run"))
    cfg = dataclasses.replace(cfg, off_policy=dataclasses.replace(cfg.off_policy, max_staleness=1))
    return run_context.build(cfg, task=SevensTask())


def _context(built, task, *, dynamic_sampling=False, fail_at_call=None):
    """The built context with `task`, a timed sampler and, if asked, dynamic sampling."""
    ctx, fresh = built
    grpo = dataclasses.replace(ctx.config.grpo, dynamic_sampling=dynamic_sampling)
    config = dataclasses.replace(ctx.config, grpo=grpo)
    sampler = TimedSampler(ctx.rollout.sampler, fail_at_call)
    ctx = dataclasses.replace(ctx, config=config, task=task, rollout=dataclasses.replace(ctx.rollout, sampler=sampler))
    return ctx, fresh, sampler


def _versions(params) -> dict[int, object]:
    # Distinct params per version (each a scaled copy), so a batch shows which one it was sampled from.
    return {v: jax.tree.map(lambda x, s=1.0 + 0.5 * v: x * s, params) for v in range(STEPS)}


def _worker(ctx, versions, should_stop=lambda: False, first_step=1, last_step=STEPS):
    snapshots = async_rollouts.Snapshots()
    for v, p in versions.items():
        snapshots.put(v, p)
    return async_rollouts.RolloutWorker(ctx, snapshots, first_step=first_step, last_step=last_step, data_position=0,
                                        max_staleness=1, should_stop=should_stop)


def test_step_n_plus_1_is_sampled_while_step_n_is_scored_and_the_batches_are_the_serial_ones(built):
    task = JudgedSevens(JUDGE_S)
    ctx, fresh, sampler = _context(built, task)
    versions = _versions(fresh.params)
    worker = _worker(ctx, versions)
    piped = [worker.next() for _ in range(STEPS)]
    worker.close()

    # In order, each from the params its step names (k = 1: versions 0, 0, 1, 2).
    assert [c.step for c in piped] == [1, 2, 3, 4]
    assert [c.version for c in piped] == [async_rollouts.sampling_version(n, 1) for n in range(1, 5)] == [0, 0, 1, 2]
    # The overlap: step n+1's sampler call went out before step n's reward returned, by most of
    # the judge's wait (the sampling thread only waits for step n's tokens, a few ms on CPU).
    reward_end = {step: end for step, _, end in task.calls}
    for n in range(1, STEPS):
        assert sampler.called_at[n] < reward_end[n] - JUDGE_S / 2, n
    # The reward's own time is still each batch's time/reward.
    assert all(c.batch.reward_seconds >= JUDGE_S for c in piped)

    # The serial worker (`collect`, today's path) on the same steps, versions and data positions:
    # the same tokens and rewards, bit for bit (per-row keys fold in the step, never the timing).
    serial_worker = _worker(ctx, {}, first_step=1, last_step=0)
    task.wait_s = 0.0
    for got in piped:
        want = serial_worker.collect(got.step, got.version, versions[got.version]).batch
        for name in want.arrays:
            np.testing.assert_array_equal(got.batch.arrays[name], want.arrays[name], err_msg=name)
        np.testing.assert_array_equal(got.batch.rewards, want.rewards)
        assert got.batch.data_position == want.data_position == got.step * ctx.config.grpo.prompts_per_step
    serial_worker.close()


def test_dynamic_sampling_samples_and_scores_in_series(built):
    # Its next round depends on this round's rewards: no sampler call while a reward runs.
    task = JudgedSevens(0.1)
    ctx, fresh, sampler = _context(built, task, dynamic_sampling=True)
    worker = _worker(ctx, _versions(fresh.params), last_step=2)
    assert [worker.next().step for _ in range(2)] == [1, 2]
    worker.close()
    for _, start, end in task.calls:
        assert not any(start < t < end for t in sampler.called_at)


def test_an_error_in_a_reward_function_reaches_the_trainer_after_the_steps_before_it(built):
    task = JudgedSevens(0.05, fail_at=2)
    ctx, fresh, _ = _context(built, task)
    worker = _worker(ctx, _versions(fresh.params))
    assert worker.next().step == 1
    with pytest.raises(ValueError, match="'judged' raised ConnectionError: judge unreachable at step 2"):
        worker.next()
    worker.close()


def test_an_error_in_the_sampler_reaches_the_trainer_after_the_steps_before_it(built):
    ctx, fresh, _ = _context(built, JudgedSevens(0.05), fail_at_call=3)
    worker = _worker(ctx, _versions(fresh.params))
    assert [worker.next().step for _ in range(2)] == [1, 2]
    with pytest.raises(RuntimeError, match="sampler failed"):
        worker.next()
    worker.close()


def test_close_or_a_stop_while_a_reward_waits_returns_promptly(built):
    # The reward runs in a thread the trainer polls every 0.1 s (rewards.combine._POLL_S): a close
    # returns within that poll, the hand-over's 0.05 s and the join, far below the judge's 30 s.
    task = JudgedSevens(30.0)
    ctx, fresh, _ = _context(built, task)
    worker = _worker(ctx, _versions(fresh.params))
    assert task.started.wait(timeout=20)
    t0 = time.perf_counter()
    worker.close()
    assert time.perf_counter() - t0 < 1.0

    # The trainer's stop (SIGTERM / Ctrl-C) interrupts it too, and `next` says so.
    stop = threading.Event()
    task = JudgedSevens(30.0)
    ctx, fresh, _ = _context(built, task)
    worker = _worker(ctx, _versions(fresh.params), should_stop=stop.is_set)
    assert task.started.wait(timeout=20)
    t0 = time.perf_counter()
    stop.set()
    with pytest.raises(RewardInterrupted):
        worker.next()
    worker.close()
    assert time.perf_counter() - t0 < 1.0
