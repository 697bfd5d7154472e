"""Asynchronous rollouts with bounded staleness (`off_policy.max_staleness = k >= 1`).

Step n's batch is sampled from the policy after step v(n) = max(0, n - 1 - k), so it can be
sampled while steps v(n) + 1 .. n - 1 update: rollout threads sample and score the steps in
order (`RolloutWorker`: step n+1 is sampled while step n's reward functions run), and the trainer
(the calling thread) takes each batch when it is ready. The gap between
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


@dataclasses.dataclass
class _SampledStep:
    """A step whose sampler call is done and read to the host, not scored yet (the pipeline's hand-over)."""

    step: int
    version: int
    params: Any  # what it was sampled from (`sample_and_score` takes them; it samples no more rounds here)
    data_position: int  # where its examples start
    pending: Any  # rollout.PendingRollout, its rows on the host (`phases.wait_for_tokens`)


_END = object()  # the sampling thread has no more steps to hand over


class RolloutWorker:
    """The rollout side: for steps first_step .. last_step in order, waits for the snapshot of
    `sampling_version(step)`, samples and scores the step's batch and queues it for `next`. An
    error is queued in its place (after the batches before it) and raised by `next`.

    Two threads, a pipeline of two stages: the sampling thread dispatches step n+1's sampler call
    and waits until its tokens are on the host while the scoring thread runs step n's reward
    functions. A slow reward (a judge service's round trip, a sandbox) then costs the period
    max(sampling, scoring) instead of their sum; in series it stalled the sampler for as long as
    it ran. The hand-over holds one step, so sampling runs at most one step ahead of scoring.
    Batches come out in step order, and which params a step samples from is fixed by its step
    (`sampling_version`), never by which thread is faster: the batches are the serial worker's,
    token for token. `time/reward` is still each batch's reward functions' own time; its
    `time/rollout` (dispatch to scored, less that) now also counts the wait in the hand-over.

    Dynamic sampling (`grpo.dynamic_sampling`) decides from a round's rewards whether to sample
    another round for the same step, so scoring gates sampling: under it one thread samples and
    scores each step in series (`phases.sample_and_score`), as before."""

    def __init__(self, ctx: RunContext, snapshots: Snapshots, *, first_step: int, last_step: int,
                 data_position: int, max_staleness: int, should_stop=lambda: False):
        # The rollout threads' context: the placement's sampler (its own devices when split).
        # Its params are the snapshots: full params already (adapters merged in by the trainer).
        self._ctx = dataclasses.replace(ctx, sampler=ctx.rollout.sampler, policy=ctx.policy.for_snapshots())
        self._snapshots, self._k = snapshots, max_staleness
        self._first, self._last, self._position = first_step, last_step, data_position
        self._out: queue.Queue = queue.Queue()
        self._sampled: queue.Queue = queue.Queue(maxsize=1)  # sampling thread -> scoring thread
        self._closing = threading.Event()
        self._should_stop = should_stop
        if ctx.config.grpo.dynamic_sampling:
            targets = {"grpo_jax rollouts": self._run_serial}
        else:
            targets = {"grpo_jax sampling": self._sample_steps, "grpo_jax scoring": self._score_steps}
        self._threads = [threading.Thread(target=t, name=name, daemon=True) for name, t in targets.items()]
        for thread in self._threads:
            thread.start()

    def _stop(self) -> bool:
        """What interrupts a reward function that is still running: `close`, or the trainer's stop."""
        return self._closing.is_set() or self._should_stop()

    def _steps(self):
        """(step, version, params) for each step in order, once the snapshot its step names is
        there; ends early when the worker closes."""
        for step in range(self._first, self._last + 1):
            version = sampling_version(step, self._k)
            params = self._snapshots.wait(version)
            if params is None or self._closing.is_set():
                return
            yield step, version, params

    def _run_serial(self) -> None:
        try:
            for step, version, params in self._steps():
                self._out.put(self.collect(step, version, params))
        except BaseException as e:  # noqa: BLE001 - handed to the trainer, which raises it
            self._out.put(e)

    def _sample_steps(self) -> None:
        """Stage 1: dispatch each step's sampler call and wait for its tokens, then hand it over."""
        try:
            for step, version, params in self._steps():
                pending = phases.dispatch_round(self._ctx, params, step, self._position, 0)
                phases.wait_for_tokens(pending)
                if not self._hand_over(_SampledStep(step, version, params, self._position, pending)):
                    return
                self._position += self._ctx.config.grpo.prompts_per_step
        except BaseException as e:  # noqa: BLE001 - scored steps first, then the error, in order
            self._hand_over(e)
        finally:
            self._hand_over(_END)

    def _hand_over(self, item) -> bool:
        """Puts `item` for the scoring thread, waiting while it holds one; False once closing."""
        while not self._closing.is_set():
            try:
                self._sampled.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def _take(self):
        """The next handed-over item; _END once closing (the sampling thread may hand over no more)."""
        while True:
            try:
                return self._sampled.get(timeout=0.05)
            except queue.Empty:
                if self._closing.is_set():
                    return _END

    def _score_steps(self) -> None:
        """Stage 2: score each handed-over step (its reward functions) and queue its batch."""
        while True:
            item = self._take()
            if item is _END or self._closing.is_set():
                return
            if isinstance(item, BaseException):
                self._out.put(item)
                return
            try:
                batch = phases.sample_and_score(self._ctx, item.params, item.step, item.data_position, item.pending,
                                                item.pending.dispatched_at, self._stop)
            except BaseException as e:  # noqa: BLE001 - handed to the trainer, which raises it
                self._out.put(e)
                self._closing.set()  # nothing after this step can be trained on: the sampler stops too
                return
            self._out.put(CollectedStep(step=item.step, version=item.version, batch=batch))

    def collect(self, step: int, version: int, params) -> CollectedStep:
        """Samples and scores step `step` from `params` (version `version`), at the next data
        position, in series on the calling thread."""
        first = phases.dispatch_round(self._ctx, params, step, self._position, 0)
        batch = phases.sample_and_score(self._ctx, params, step, self._position, first, first.dispatched_at,
                                        self._stop)
        self._position = batch.data_position
        return CollectedStep(step=step, version=version, batch=batch)

    def next(self) -> CollectedStep:
        item = self._out.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stops after the sampler call in progress (a reward function still running is interrupted)."""
        self._closing.set()
        self._snapshots.close()
        for thread in self._threads:
            thread.join()


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
