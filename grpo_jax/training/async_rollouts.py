"""Asynchronous rollouts with bounded staleness (`off_policy.max_staleness = k >= 1`).

Step n's batch is sampled from the policy after step v(n) = max(0, n - 1 - k), so it can be
sampled while steps v(n) + 1 .. n - 1 update: a rollout thread samples and scores the steps in
order, and the trainer (the calling thread) takes each batch when it is ready. The gap between
the sampling policy and the trainer's pi_old is what the sampler correction weighs
(`losses.sampler_correction`, on by default); every batch's staleness is logged
(`async/staleness`).

Which params a batch is sampled from is fixed by its step, never by timing: a run is
reproducible, and a resumed run re-runs the rollouts that were in flight from the snapshots its
checkpoint holds (`RunState.rollout_params`, k of them). A batch older than k steps (it cannot be
produced by this schedule; the guard is for what a future scheduler might do) is dropped, counted
in `async/dropped_batches`, and sampled again from the current params.

Placement (`run_context.RolloutPlacement`): on the trainer's devices, the sampler reads a copy of
the params (the update donates the ones it read), dispatched from the rollout thread; with
`off_policy.rollout_devices` the sampler has devices of its own and each update's params are resharded
onto them (`jax.device_put`), timed as `time/weight_sync`.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any

import jax

from grpo_jax.training import phases
from grpo_jax.rewards import RewardInterrupted
from grpo_jax.training.run_context import RunContext, RunState

log = logging.getLogger("grpo_jax")


def sampling_version(step: int, max_staleness: int) -> int:
    """The params version (GRPO steps done) that step `step`'s batch is sampled from."""
    return max(0, step - 1 - max_staleness)


def snapshot_versions(done_step: int, max_staleness: int) -> list[int]:
    """The versions that the rollouts of steps done_step + 1 .. done_step + k sample from, slot j
    for step done_step + 1 + j: what a checkpoint at `done_step` keeps (`RunState.rollout_params`)."""
    return [sampling_version(done_step + 1 + j, max_staleness) for j in range(max_staleness)]


class Snapshots:
    """Params snapshots by version, shared by the trainer (put) and the rollout thread (wait)."""

    def __init__(self):
        self._by_version: dict[int, Any] = {}
        self._changed = threading.Condition()
        self._closed = False

    def put(self, version: int, params) -> None:
        with self._changed:
            self._by_version[version] = params
            self._changed.notify_all()

    def get(self, version: int):
        with self._changed:
            return self._by_version[version]

    def wait(self, version: int):
        """The snapshot of `version` once it is there; None once `close` was called."""
        with self._changed:
            self._changed.wait_for(lambda: version in self._by_version or self._closed)
            return self._by_version.get(version) if not self._closed else None

    def keep_from(self, version: int) -> None:
        """Drops the snapshots older than `version` (nothing will sample from them)."""
        with self._changed:
            for v in [v for v in self._by_version if v < version]:
                del self._by_version[v]

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()


@dataclasses.dataclass
class CollectedStep:
    step: int
    version: int  # the params version it was sampled from
    batch: phases.StepBatch  # its data_position: after this step's examples


class RolloutWorker:
    """The rollout thread: for steps first_step .. last_step in order, waits for the snapshot of
    `sampling_version(step)`, samples and scores the step's batch (`phases.sample_and_score`, dynamic
    sampling included) and queues it. An error is queued in its place and raised by `next`."""

    def __init__(self, ctx: RunContext, snapshots: Snapshots, *, first_step: int, last_step: int,
                 data_position: int, max_staleness: int, should_stop=lambda: False):
        # The rollout thread's context: the placement's sampler (its own devices when split).
        # Its params are the snapshots: full params already (adapters merged in by the trainer).
        self._ctx = dataclasses.replace(ctx, sampler=ctx.rollout.sampler, policy=ctx.policy.for_snapshots())
        self._snapshots, self._k = snapshots, max_staleness
        self._first, self._last, self._position = first_step, last_step, data_position
        self._out: queue.Queue = queue.Queue()
        self._closing = threading.Event()
        self._should_stop = should_stop
        self._thread = threading.Thread(target=self._run, name="grpo_jax rollouts", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for step in range(self._first, self._last + 1):
                version = sampling_version(step, self._k)
                params = self._snapshots.wait(version)
                if params is None or self._closing.is_set():
                    return
                self._out.put(self.collect(step, version, params))
        except BaseException as e:  # noqa: BLE001 - handed to the trainer, which raises it
            self._out.put(e)

    def collect(self, step: int, version: int, params) -> CollectedStep:
        """Samples and scores step `step` from `params` (version `version`), at the next data position."""
        first = phases.dispatch_round(self._ctx, params, step, self._position, 0)
        stop = lambda: self._closing.is_set() or self._should_stop()  # noqa: E731
        batch = phases.sample_and_score(self._ctx, params, step, self._position, first, first.dispatched_at, stop)
        self._position = batch.data_position
        return CollectedStep(step=step, version=version, batch=batch)

    def next(self) -> CollectedStep:
        item = self._out.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stops after the rollout in progress (a reward function still running is interrupted)."""
        self._closing.set()
        self._snapshots.close()
        self._thread.join()


def _time_after(first, then):
    """A function returning the seconds between `first` and `then` (trees of device arrays)
    becoming ready, measured by a thread that waits for one and then the other."""
    seconds = [float("nan")]

    def wait():
        try:
            jax.block_until_ready(first)
            start = time.perf_counter()
            jax.block_until_ready(then)
            seconds[0] = time.perf_counter() - start
        except Exception:  # noqa: BLE001 - the trainer meets the same error where it reads them
            pass

    thread = threading.Thread(target=wait, name="grpo_jax weight sync", daemon=True)
    thread.start()

    def result() -> float:
        thread.join()
        return seconds[0]

    return result


class AsyncBatches:
    """The trainer's side of asynchronous rollouts: the loop's `batch_source.BatchSource` when
    max_staleness > 0.

    Per step: `next_batch` takes the step's batch (waiting for the rollout thread if it is not
    ready), the update is dispatched, then `published` hands the new params to the rollout thread
    and returns the state with the snapshots a checkpoint must keep."""

    def __init__(self, ctx: RunContext, state: RunState, should_stop=lambda: False):
        self.ctx, self.k = ctx, ctx.config.off_policy.max_staleness
        self.placement = ctx.rollout
        self.snapshots = Snapshots()
        # Fresh: every early step samples from version 0. Resumed: the checkpoint's snapshots.
        for version, params in zip(snapshot_versions(state.step, self.k), state.rollout_params):
            self.snapshots.put(version, params)
        self.snapshots.put(state.step, self.placement.to_sampler(ctx.policy_params(state)))
        self.dropped = 0
        self._sync: dict[int, float] = {}  # step -> when its weight sync was dispatched
        self._previous_update_ready: float | None = None
        self._waited: dict[int, float] = {}
        self._staleness: dict[int, int] = {}
        self.worker = RolloutWorker(ctx, self.snapshots, first_step=state.step + 1, last_step=ctx.config.train.steps,
                                    data_position=state.data_position, max_staleness=self.k, should_stop=should_stop)

    def begin(self, state: RunState) -> None:
        """Nothing to start: the rollout thread is already sampling the coming steps."""

    def next_batch(self, state: RunState, device_free_at: float, should_stop=None) -> phases.StepBatch:
        """Step `state.step + 1`'s batch, sampled at most max_staleness steps ago (waiting for the
        rollout thread if it is not ready). The thread keeps its own clock and stop: the arguments
        are the synchronous source's."""
        step = state.step + 1
        t0 = time.perf_counter()
        item = self.worker.next()
        self._waited[step] = time.perf_counter() - t0
        if item.step != step:
            raise RuntimeError(f"async rollouts: expected step {step}'s batch, got step {item.step}'s")
        staleness = state.step - item.version
        if staleness > self.k:
            self.dropped += 1
            log.warning("step %d: its batch is %d steps stale (off_policy.max_staleness=%d); dropped and sampled again "
                        "from the current params", step, staleness, self.k)
            item = self.worker.collect(step, state.step, self.snapshots.get(state.step))
            staleness = 0
        self._staleness[step] = staleness
        return item.batch

    def published(self, state: RunState, update_metrics) -> RunState:
        """After step `state.step`'s update was dispatched (`update_metrics`: its outputs, device
        arrays): its params go to the rollout thread."""
        step = state.step
        snapshot = self.placement.to_sampler(self.ctx.policy_params(state))
        self._sync[step] = _time_after(update_metrics, snapshot)
        self.snapshots.put(step, snapshot)
        keep = snapshot_versions(step, self.k)
        self.snapshots.keep_from(min(keep, default=step))
        return dataclasses.replace(state, rollout_params=tuple(self.snapshots.get(v) for v in keep))

    def row_metrics(self, step: int, update_ready_at: float) -> dict[str, float]:
        """The step's asynchronous figures. time/step is the pipeline's period (update to update),
        as rollout and update overlap; time/weight_sync what the sampler's copy took after the update."""
        row = {
            "async/staleness": float(self._staleness.pop(step)),
            "async/dropped_batches": float(self.dropped),
            "async/rollout_wait": self._waited.pop(step),
            "time/weight_sync": self._sync.pop(step)(),
        }
        if self._previous_update_ready is not None:
            row["time/step"] = update_ready_at - self._previous_update_ready
        self._previous_update_ready = update_ready_at
        return row

    def close(self) -> None:
        try:
            self.worker.close()
        except RewardInterrupted:
            pass
