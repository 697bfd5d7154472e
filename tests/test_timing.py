"""`grpo_jax.training.timing`: when dispatched device work was ready, read after the fact."""

from __future__ import annotations

import time

import jax.numpy as jnp
import pytest

from grpo_jax.training.timing import PhaseTiming, ReadyAt


def test_ready_time_lies_between_dispatch_and_the_read():
    before = time.perf_counter()
    x = jnp.arange(1000.0) * 2  # dispatched; the watcher thread waits for it
    ready = ReadyAt([x])
    at = ready.time()
    assert before <= at <= time.perf_counter()
    assert ready.time() == at  # read twice (time/logprobs and time/update both use it): the same time


class _Failed:
    """A leaf whose computation failed on the device: blocking on it raises."""

    def block_until_ready(self):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")


def test_an_error_of_the_watched_work_is_raised_where_the_time_is_read():
    ready = ReadyAt([_Failed()])  # the watcher thread must not swallow it, nor die loudly
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        ready.time()


def test_a_phase_without_device_work_ends_when_dispatched():
    assert PhaseTiming(dispatched_at=5.0, ready=None).ended_at() == 5.0
