"""What a dispatched step leaves for the host to read one step later, and that read.

The loop dispatches step N's update and goes on to step N+1's rollout without waiting: step N's
update metrics are device arrays not read yet. A `StepRecord` keeps them with the batch and a typed
timing handle per phase (`timing.PhaseTiming`); `StepLog` holds the one record not read yet and
turns it into the step's metrics row when the loop asks (nanodo's order: the host reads step N
while the devices run step N+1). `StepRecord.times` is the one place the logged seconds (time/*)
and tokens_per_second are derived.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np

from grpo_jax.training import phases
from grpo_jax.training.run_context import RunContext
from grpo_jax.training.timing import PhaseTiming

log = logging.getLogger("grpo_jax")


@dataclasses.dataclass
class StepRecord:
    """One dispatched step whose update metrics have not been read yet."""

    step: int
    batch: phases.StepBatch
    advantages: np.ndarray  # [B] float32, or [B, C] per token (episodes with task.turn_rewards="process")
    update_metrics: list[dict[str, Any]]  # one dict of device scalars per optimizer update
    logprobs: PhaseTiming
    update: PhaseTiming  # its `ready` watches `update_metrics`
    compiles: int = 0  # XLA compilations while dispatching this step

    def times(self, update_ready_at: float, period: float | None = None) -> dict[str, float]:
        """The step's seconds by logged name, and its throughput. Times are perf_counter() readings;
        `period` (asynchronous rollouts): the time from the last update to this one, which is the
        step's time when rollout and update overlap."""
        batch = self.batch
        logprobs_end = self.logprobs.ended_at()
        step_seconds = update_ready_at - batch.device_start if period is None else period
        # Readiness is observed by watcher threads (timing.ReadyAt), which may see a phase end a
        # little late; where that lag exceeds a short phase a difference would come out negative,
        # which no phase takes: such a phase is reported as 0.
        return {
            # TRL splits generation from scoring: time/rollout is sampling + decoding text.
            "time/rollout": max(0.0, batch.finished_at - batch.device_start - batch.reward_seconds),
            "time/reward": batch.reward_seconds,
            "time/logprobs": max(0.0, logprobs_end - self.logprobs.dispatched_at),
            # The device runs in order: the update starts when it is dispatched and the log-probs are done.
            "time/update": max(0.0, update_ready_at - max(self.update.dispatched_at, logprobs_end)),
            "time/step": step_seconds,
            "tokens_per_second": float(batch.arrays["mask"].sum()) / max(step_seconds, 1e-9),
        }


def read_row(ctx: RunContext, record: StepRecord, source) -> tuple[dict, float]:
    """(the step's metrics row, when its update finished): waits for the update's metrics if they
    are not ready, reads them and adds what the batch source measured (`source.row_metrics`)."""
    update_ready_at = record.update.ended_at()
    from_source = source.row_metrics(record.step, update_ready_at)
    times = record.times(update_ready_at, period=from_source.pop("time/step", None))
    update_metrics = [{k: float(v) for k, v in m.items()} for m in record.update_metrics]
    row = {"step": record.step, **phases.report(ctx, record.step, record.batch, record.advantages, update_metrics,
                                                times)}
    if record.compiles:
        log.warning("step %d recompiled %d XLA program(s); shapes changed after warm-up (prompt length bucket or "
                    "batch shape)", record.step, record.compiles)
        row["recompiles"] = record.compiles
    row.update(from_source)
    return row, update_ready_at


class StepLog:
    """The one-step-late read: holds the last dispatched step until its row is read, and when the
    devices were last free (the synchronous rollout's time starts there at the earliest)."""

    def __init__(self, ctx: RunContext, source):
        self.ctx, self.source = ctx, source
        self.pending: StepRecord | None = None
        self.device_free_at = time.perf_counter()

    def hold(self, record: StepRecord) -> None:
        self.pending = record

    def read(self) -> dict | None:
        """The held step's row (waiting for its update), or None when no step is held."""
        if self.pending is None:
            return None
        record, self.pending = self.pending, None
        row, self.device_free_at = read_row(self.ctx, record, self.source)
        return row

    def devices_free(self) -> None:
        """Notes that the devices are free now (after an evaluation the host waited for)."""
        self.device_free_at = time.perf_counter()
