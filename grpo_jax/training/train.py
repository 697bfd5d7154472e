"""The GRPO loop (seed, Step 5): build the run, restore or start its state, then step by step

    collect -> score -> logprobs -> update -> report -> (evaluate) -> (save)

with the phases of `grpo_jax.training.phases` around an explicit `RunState` (step, data position, params,
optimizer state, reference). The policy params and the optimizer state are donated to each update;
the reference is a separate frozen tree the optimizer never sees (Simply's layout).

The host never stalls the devices: JAX dispatches asynchronously, and the loop starts step N's
rollout before it reads step N-1's update metrics (nanodo's order), so the devices go straight from
one step's update to the next step's sampling while the host writes the previous step's row. With
`off_policy.max_staleness` > 0 the batches come instead from a rollout thread sampling from older params
(`grpo_jax.training.async_rollouts`), and the same loop trains on them.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from typing import Any

import jax
import numpy as np

from grpo_jax.training import async_rollouts
from grpo_jax import config as config_lib
from grpo_jax.training import phases
from grpo_jax.training import rollout as rollout_lib
from grpo_jax.training import run_context
from grpo_jax.io import run_dir as run_dir_lib
from grpo_jax.distributed import sharding
from grpo_jax.io import run_paths
from grpo_jax.training import run_state
from grpo_jax.training import step as step_lib
from grpo_jax.io.checkpoint import CheckpointManager
from grpo_jax.training.diagnostics import Diagnostics
from grpo_jax.io.metrics import MetricsWriter
from grpo_jax.rewards import RewardInterrupted
from grpo_jax.training.signal_watch import SignalWatch
from grpo_jax.training.run_context import RunContext, RunState
from grpo_jax.training.timing import ReadyTimes

log = logging.getLogger("grpo_jax")


@dataclasses.dataclass
class RunResult:
    run_dir: str
    step: int
    history: list[dict]  # every metrics row of this process's run, in order
    evals: list[dict]  # the held-out evaluation rows
    params: Any = None
    stopped_by: str | None = None  # "SIGTERM", "SIGINT" or "stop_after_steps" when it stopped early

    def __repr__(self) -> str:
        # The params tree and every row would fill a screen: counts and the last figures instead.
        leaves = jax.tree.leaves(self.params) if self.params is not None else []
        size = sum(int(np.prod(getattr(x, "shape", ()))) for x in leaves)
        last = next((r for r in reversed(self.history) if "reward" in r), {})
        figures = ", ".join(f"{k}={last[k]:.4g}" for k in ("reward", "kl", "entropy") if k in last)
        evals = f", last eval/pass@1={self.evals[-1]['eval/pass@1']:.4g}" if self.evals and "eval/pass@1" in \
            self.evals[-1] else ""
        return (f"RunResult(run_dir={str(self.run_dir)!r}, step={self.step}, stopped_by={self.stopped_by!r}, "
                f"{len(self.history)} rows ({figures or 'no training row'}), {len(self.evals)} evals{evals}, "
                f"params: {len(leaves)} arrays, {size:,} values)")


def _log_like_the_cli() -> None:
    """From Python with logging left at its defaults (the root at WARNING, the "grpo_jax" logger
    untouched), the INFO lines the CLI prints are printed too: the logger goes to INFO, and when the
    root has no handler, one in the CLI's format goes on it. (absl, which Orbax imports, often puts a
    plain stderr handler on the root: then the lines print through it, once.) A program that set a
    level on the root or on "grpo_jax" keeps its own setup."""
    if log.level != logging.NOTSET or log.handlers or logging.getLogger().level < logging.WARNING:
        return
    log.setLevel(logging.INFO)
    if not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"))
        log.addHandler(handler)


class _CompileCounter:
    """Counts XLA compilations, so a recompile after warm-up can be reported."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        if event == "/jax/compilation_cache/compile_time_saved_sec":
            return
        if "backend_compile" in event:
            self.count += 1


_COMPILES: _CompileCounter | None = None


class _StopFlag:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint and returns at the end of the step."""

    def __init__(self):
        self.signal = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no handlers, no graceful stop
                pass
        return self

    def _handle(self, signum, frame):
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.signal = signum
        log.warning(
            "received %s: finishing this step, saving a checkpoint, then stopping",
            signal.Signals(signum).name,
        )

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


# ----------------------------------------------------------------------------------------------
# One step, and what is read one step later.


@dataclasses.dataclass
class _PendingReport:
    """A dispatched step whose update metrics have not been read yet."""

    step: int
    data_position: int
    batch: phases.StepBatch
    advantages: Any
    update_metrics: list  # device arrays
    logprobs_dispatched_at: float
    update_dispatched_at: float
    compiles: int = 0  # XLA compilations while dispatching this step


def grpo_step(ctx: RunContext, state: RunState, first_round, device_free_at: float, times: ReadyTimes,
              should_stop=None):
    """Phases 1-6 of step `state.step + 1`, with its first sampler round already dispatched.
    Returns the new state and what `_read_report` needs; nothing here waits for the update."""
    batch, data_position = phases.collect(ctx, state, state.step + 1, first_round, device_free_at, should_stop)
    return train_on_batch(ctx, state, batch, data_position, times)


def train_on_batch(ctx: RunContext, state: RunState, batch: phases.StepBatch, data_position: int,
                   times: ReadyTimes):
    """Phases 4-6 of step `state.step + 1` on its collected `batch` (the data position after it):
    the new state and what `_read_report` needs; nothing here waits for the update."""
    step = state.step + 1
    advantages, completion_mask = phases.score(ctx, batch)
    rows = phases.device_rows(ctx, batch, advantages, completion_mask)
    logprobs_dispatched_at = time.perf_counter()
    ref_logp, old_logp = phases.logprobs(ctx, state, rows, times, step)
    update_dispatched_at = time.perf_counter()
    state, update_metrics = phases.update(ctx, state, rows, ref_logp, old_logp, times, step)
    g = ctx.config.grpo
    if ctx.uses_reference and g.ref_resync_every and step % g.ref_resync_every == 0:
        state = dataclasses.replace(state, ref_params=step_lib.frozen_copy(state.params, ctx.ref_dtype))
    state = dataclasses.replace(state, step=step, data_position=data_position)
    pending = _PendingReport(
        step=step,
        data_position=data_position,
        batch=batch,
        advantages=advantages,
        update_metrics=update_metrics,
        logprobs_dispatched_at=logprobs_dispatched_at,
        update_dispatched_at=update_dispatched_at,
    )
    return state, pending


def _read_report(ctx: RunContext, pending: _PendingReport, times: ReadyTimes) -> tuple[dict, float]:
    """(the step's metrics row, when its update finished): reads the update metrics (waiting for
    them if they are not ready) and assembles the row."""
    update_ready_at = times.ready_at(f"update:{pending.step}")
    logprobs_ready_at = (
        times.ready_at(f"logprobs:{pending.step}") if f"logprobs:{pending.step}" in times else None
    )
    update_metrics = [{k: float(v) for k, v in m.items()} for m in pending.update_metrics]
    metrics = phases.report(
        ctx,
        pending.step,
        pending.data_position,
        pending.batch,
        pending.advantages,
        update_metrics,
        logprobs_dispatched_at=pending.logprobs_dispatched_at,
        logprobs_ready_at=logprobs_ready_at,
        update_dispatched_at=pending.update_dispatched_at,
        update_ready_at=update_ready_at,
    )
    if pending.compiles:
        log.warning(
            "step %d recompiled %d XLA program(s); shapes changed after warm-up (prompt length bucket or batch "
            "shape)",
            pending.step,
            pending.compiles,
        )
        metrics["recompiles"] = pending.compiles
    return metrics, update_ready_at


# ----------------------------------------------------------------------------------------------
# The run.


def run(
    config: config_lib.Config,
    *,
    resume: bool = False,
    overwrite: bool = False,
    allow_config_change: bool = False,
    task=None,
    tokenizer=None,
) -> RunResult:
    """Trains per `config`; writes metrics, samples and checkpoints to `config.train.run_dir`.

    A run directory that holds a previous run needs `resume` (continue it; the config is compared
    with the run's, see `grpo_jax.io.run_dir`) or `overwrite` (replace it). `task` and `tokenizer`
    replace the ones the config names (research code brings its own objects implementing
    `grpo_jax.tasks.Task` and `grpo_jax.io.tokenizer.Tokenizer`). A SIGTERM / Ctrl-C stops after the
    step with a checkpoint: `RunResult.stopped_by` says so. An error mid-run first saves the last
    finished step (if it is finite and not saved yet), then raises.
    """
    global _COMPILES
    _log_like_the_cli()
    if _COMPILES is None:
        _COMPILES = _CompileCounter()
    run_dir = run_paths.as_path(config.train.run_dir)  # gs://... stays itself
    run_dir_lib.prepare(config, run_dir, resume=resume, overwrite=overwrite, allow_config_change=allow_config_change,
                        primary=jax.process_index() == 0)
    if jax.process_count() > 1:  # the primary may have removed an old run: nobody opens it before that
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("grpo_jax run_dir prepared")
    ctx, fresh = run_context.build(config, task=task, tokenizer=tokenizer)
    if ctx.processes.is_primary:
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = CheckpointManager(
        run_state.ckpt_dir_of(ctx.run_dir), max_to_keep=config.train.keep_checkpoints, async_save=config.train.async_checkpoints
    )
    writer = MetricsWriter(
        ctx.run_dir,
        total_steps=config.train.steps,
        console=config.train.progress,
        key_metrics=("reward", "frac_reward_zero_std", "kl", "entropy", "eval/pass@1"),
        report_to=config.train.report_to,
        wandb_project=config.train.wandb_project,
        run_config=config_lib.to_dict(config),
    )
    loop = _Loop(ctx, ckpt, writer)
    state = None
    try:
        with _StopFlag() as stop:
            state = run_state.initial_state(ctx, fresh, ckpt, resume, should_stop=lambda: stop.signal is not None)
            if state is None:
                name = signal.Signals(stop.signal).name
                log.warning("stopped by %s during the SFT warm-up: nothing was saved; a new start repeats it", name)
                return RunResult(ctx.run_dir, 0, loop.history, loop.evals, stopped_by=name)
            if ctx.processes.is_primary:
                run_dir_lib.write_config(config, ctx.run_dir)
            state, stopped_by = loop.train(state, stop)
            loop.watch.close()
    except Exception:
        loop.save_on_error()
        raise
    finally:
        ckpt.wait_until_finished()
        ckpt.close()
        writer.close()
        if ctx.pool is not None:
            ctx.pool.close()

    if state.step == config.train.steps and config.train.export_hf:
        run_state.export_hf(ctx, state)
    return RunResult(ctx.run_dir, state.step, loop.history, loop.evals, params=state.params, stopped_by=stopped_by)


class _Loop:
    """The step loop of `run` and what it keeps between steps: rows written, evaluations, the
    streak of steps with skipped (non-finite) updates, the last step saved."""

    def __init__(self, ctx: RunContext, ckpt: CheckpointManager, writer: MetricsWriter):
        self.ctx, self.ckpt, self.writer = ctx, ckpt, writer
        self.diagnostics = Diagnostics()
        self.watch = SignalWatch(ctx.config, ctx.updates_per_step)  # settings that eat the signal, warned once
        self.history: list[dict] = []
        self.evals: list[dict] = []
        self.nonfinite_streak = 0
        self.saved_step = ckpt.latest_step()
        self.state: RunState | None = None  # the last step's state, once training started
        # 64 questions per sampler call, rounded up so even greedy (1 row each) splits over the devices.
        row_devices = sharding.batch_size_multiple(ctx.mesh)
        self.eval_batch_prompts = -(-64 // row_devices) * row_devices

    def evaluate(self, params, step: int) -> dict:
        ctx, e_cfg = self.ctx, self.ctx.config.eval
        t0 = time.perf_counter()
        res = rollout_lib.evaluate(
            ctx.sampler,
            params,
            ctx.tokenizer,
            ctx.task,
            ctx.eval_examples,
            num_samples=e_cfg.num_samples,
            ks=e_cfg.ks,
            temperature=e_cfg.temperature,
            max_new_tokens=ctx.config.sampling.max_new_tokens,
            greedy=e_cfg.greedy,
            rng=jax.random.fold_in(ctx.base_key, 10_000_000 + step),
            batch_prompts=self.eval_batch_prompts,
            processes=ctx.processes,
        )
        res["time/eval"] = time.perf_counter() - t0
        self.evals.append({"step": step, **res})
        return res

    def write(self, row: dict) -> None:
        t_cfg = self.ctx.config.train
        self.diagnostics.update(row["step"], row)  # logs each warning itself
        self.watch.update(row["step"], row)
        if row["step"] % t_cfg.log_every == 0 or "eval/pass@1" in row or row["step"] == t_cfg.steps:
            self.writer.write(row["step"], row)
        self.history.append(row)
        # Skipped updates leave the params as they were; a streak of them means the run is stuck.
        self.nonfinite_streak = self.nonfinite_streak + 1 if row.get("skipped_updates", 0) > 0 else 0
        if self.nonfinite_streak:
            log.warning("step %d: %d update(s) skipped (loss or gradient norm not finite); params unchanged",
                        row["step"], int(row["skipped_updates"]))
        if self.nonfinite_streak >= t_cfg.max_nonfinite_steps:
            raise FloatingPointError(
                f"{self.nonfinite_streak} steps in a row (to step {row['step']}) had updates with a non-finite loss "
                f"or gradient norm (train.max_nonfinite_steps={t_cfg.max_nonfinite_steps}); params were left "
                "unchanged. Check the rewards and log-probs of those steps (samples.jsonl) or lower the learning rate"
            )

    def save(self, state: RunState) -> None:
        run_state.save(self.ctx, self.ckpt, state, diagnostics=self.diagnostics.state_dict())
        self.saved_step = state.step

    def save_on_error(self) -> None:
        """After an error: the last finished step, if it is not saved yet and is finite."""
        state = self.state
        if state is None or state.step == 0 or state.step == self.saved_step or self.ckpt.failed:
            return  # (a checkpoint that could not be written, a full disk, would fail again)
        try:
            self.save(state)
            self.ckpt.wait_until_finished()
            log.warning("saved step %d before stopping on the error below; --resume continues from it", state.step)
        except Exception as e:  # noqa: BLE001 - the original error is the one to raise
            log.warning("could not save step %d after the error (%s)", state.step, str(e).splitlines()[0])

    def train(self, state: RunState, stop: _StopFlag) -> tuple[RunState, str | None]:
        """Steps until train.steps or a stop; returns the final state and what stopped it (or None)."""
        ctx, t_cfg, e_cfg = self.ctx, self.ctx.config.train, self.ctx.config.eval
        start_step = state.step
        self.state = state
        if state.diagnostics is not None:  # resumed: the warnings continue from the saved window
            self.diagnostics.load_state_dict(state.diagnostics)
        if state.step == 0 and ctx.eval_examples:
            self.write({"step": 0, **self.evaluate(ctx.policy_params(state), 0)})
        # off_policy.max_staleness > 0: batches come from the rollout thread, sampled from older params.
        batches = None
        if ctx.rollout is not None:
            batches = async_rollouts.AsyncBatches(ctx, state, should_stop=lambda: stop.signal is not None)
        try:
            return self._steps(state, stop, batches, start_step)
        finally:
            if batches is not None:
                batches.close()

    def _row(self, pending: _PendingReport, times: ReadyTimes, batches) -> tuple[dict, float]:
        """(a dispatched step's metrics row, when its update finished), waiting for the update."""
        row, update_ready_at = _read_report(self.ctx, pending, times)
        if batches is not None:
            row.update(batches.row_metrics(pending.step, update_ready_at))
            row["tokens_per_second"] = float(pending.batch.arrays["mask"].sum()) / max(row["time/step"], 1e-9)
        return row, update_ready_at

    def _steps(self, state: RunState, stop: _StopFlag, batches, start_step: int) -> tuple[RunState, str | None]:
        ctx, t_cfg, e_cfg = self.ctx, self.ctx.config.train, self.ctx.config.eval
        times = ReadyTimes()
        pending, device_free_at, stopped_by = None, time.perf_counter(), None
        while state.step < t_cfg.steps:
            step = state.step + 1
            compiles_before = _COMPILES.count
            first_round = None if batches else phases.dispatch_round(ctx, state, step, state.data_position, 0)
            if pending is not None:  # step N-1's row, read while the devices sample step N
                row, device_free_at = self._row(pending, times, batches)
                self.write({"step": pending.step, **row})
            # One process alone must not leave a step early: the others would wait at its gathers.
            # Several processes therefore stop at step boundaries only, all together (below).
            interrupt = (lambda: stop.signal is not None) if ctx.processes.count == 1 else None
            try:
                if batches is None:
                    state, pending = grpo_step(ctx, state, first_round, device_free_at, times, should_stop=interrupt)
                else:
                    batch, data_position = batches.take(state)
                    state, pending = train_on_batch(ctx, state, batch, data_position, times)
                    state = batches.published(state, pending.update_metrics)
            except RewardInterrupted:
                # A reward function was still running: the step is dropped, the last one is saved.
                stopped_by = signal.Signals(stop.signal).name
                if state.step != self.saved_step and state.step > 0:
                    self.save(state)
                log.warning("stopped during step %d's rewards (%s); step %d saved, resume with --resume",
                            step, stopped_by, state.step)
                return state, stopped_by
            self.state = state
            # The first steps of this process compile (resumed runs too); later compiles are reported.
            pending.compiles = _COMPILES.count - compiles_before if step - start_step > 2 else 0

            if t_cfg.samples_every and (step % t_cfg.samples_every == 0 or step == 1):
                self.writer.write_samples(step, pending.batch.samples)
            # A preempted TPU VM gets SIGTERM alone: every process stops after the same step.
            if ctx.processes.any(stop.signal is not None):
                stopped_by = signal.Signals(stop.signal).name if stop.signal is not None else "SIGTERM on another process"
            if t_cfg.stop_after_steps and step - start_step >= t_cfg.stop_after_steps and step < t_cfg.steps:
                stopped_by = "stop_after_steps"
            evaluate_now = ctx.eval_examples and ((e_cfg.every and step % e_cfg.every == 0) or step == t_cfg.steps)
            save_now = (t_cfg.checkpoint_every and step % t_cfg.checkpoint_every == 0) or stopped_by or step == t_cfg.steps
            # A checkpoint holds the diagnostics' window up to its own step, so the row is read first
            # (the save waits for the update anyway, to copy its arrays).
            if evaluate_now or save_now:
                # The row is needed now (held-out figures join it, or the run ends here).
                row, device_free_at = self._row(pending, times, batches)
                pending = None
                if evaluate_now:
                    row.update(self.evaluate(ctx.policy_params(state), step))
                    device_free_at = time.perf_counter()
                self.write({"step": step, **row})
            if save_now:
                self.save(state)
            if stopped_by:
                log.warning("stopped at step %d (%s); resume with --resume", step, stopped_by)
                break
        if pending is not None:
            row, _ = self._row(pending, times, batches)
            self.write({"step": pending.step, **row})
        return state, stopped_by
