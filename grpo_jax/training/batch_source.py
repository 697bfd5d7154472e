"""Where the loop's batches come from: one interface over synchronous and asynchronous rollouts.

Per step the loop calls `begin(state)` (before it reads the previous step's row, so the devices
sample while the host writes), `next_batch` (the step's sampled and scored batch), then, after the
update is dispatched, `published` (the new params to whoever samples). `row_metrics` adds what the
source measured to the step's row. `SyncBatches` samples step n from the params after step n - 1
(the seed's Step 5); `async_rollouts.AsyncBatches` takes batches from a rollout thread sampling from
params up to `off_policy.max_staleness` steps older.
"""

from __future__ import annotations

from typing import Callable, Protocol

from grpo_jax.training import async_rollouts
from grpo_jax.training import phases
from grpo_jax.training.run_context import RunContext, RunState


class BatchSource(Protocol):
    def begin(self, state: RunState) -> None:
        """Starts step `state.step + 1`'s batch (the device work that can go out now)."""

    def next_batch(self, state: RunState, device_free_at: float,
                   should_stop: Callable[[], bool] | None) -> phases.StepBatch:
        """Step `state.step + 1`'s batch; `device_free_at`: when the devices finished their last work."""

    def published(self, state: RunState, update_metrics) -> RunState:
        """After the update of step `state.step` was dispatched: the state to keep (and checkpoint)."""

    def row_metrics(self, step: int, update_ready_at: float) -> dict[str, float]:
        """What the source measured for `step`; a "time/step" here replaces the loop's own."""

    def close(self) -> None: ...


class SyncBatches:
    """Step n's batch sampled from the params after step n - 1; its first sampler round is
    dispatched by `begin`, the rest (scoring, dynamic sampling's further rounds) by `next_batch`."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self._round = None  # (params, first sampler round) of the step begun

    def begin(self, state: RunState) -> None:
        params = self.ctx.sampler_params(state)
        self._round = params, phases.dispatch_round(self.ctx, params, state.step + 1, state.data_position, 0)

    def next_batch(self, state: RunState, device_free_at: float, should_stop=None) -> phases.StepBatch:
        # The update donates the params: no reference to them is kept past this step's sampling.
        (params, first), self._round = self._round, None
        return phases.sample_and_score(self.ctx, params, state.step + 1, state.data_position, first, device_free_at,
                                       should_stop)

    def published(self, state: RunState, update_metrics) -> RunState:
        return state  # the next step samples from `state` itself

    def row_metrics(self, step: int, update_ready_at: float) -> dict[str, float]:
        # An engine that keeps its own weights (vLLM) timed their sync before the step's sampling.
        pop = getattr(self.ctx.sampler, "pop_weight_sync_seconds", None)
        seconds = pop() if pop is not None else None
        return {} if seconds is None else {"time/weight_sync": seconds}

    def close(self) -> None:
        self._round = None


def open_source(ctx: RunContext, state: RunState, should_stop: Callable[[], bool]) -> BatchSource:
    """The run's batch source: a rollout thread with `off_policy.max_staleness` > 0 (`ctx.rollout`),
    else the synchronous one. `should_stop` interrupts the rollout thread's reward functions."""
    if ctx.rollout is not None:
        return async_rollouts.AsyncBatches(ctx, state, should_stop=should_stop)
    return SyncBatches(ctx)
