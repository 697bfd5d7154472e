"""The GRPO loop (seed, Step 5): build the run, restore or start its state, then step by step

    sample_and_score -> compute_advantages -> logprobs -> update -> sync_reference -> report
    -> (evaluate) -> (save)

with the phases of `grpo_jax.training.phases` around an explicit `RunState` (step, data position, params,
optimizer state, reference). The policy params and the optimizer state are donated to each update;
the reference is a separate frozen tree the optimizer never sees (Simply's layout).

The host never stalls the devices: JAX dispatches asynchronously, and the loop starts step N's
rollout before it reads step N-1's update metrics (nanodo's order, `step_record.StepLog`), so the
devices go straight from one step's update to the next step's sampling while the host writes the
previous step's row. The batches come from a `batch_source.BatchSource`: sampled from the latest
params, or with `off_policy.max_staleness` > 0 from a rollout thread sampling from older params
(`grpo_jax.training.async_rollouts`); the same loop trains on both.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from typing import Any

import jax
import numpy as np

from grpo_jax import config as config_lib
from grpo_jax.training import batch_source
from grpo_jax.training import phases
from grpo_jax.training import rollout as rollout_lib
from grpo_jax.training import run_context
from grpo_jax.io import run_dir as run_dir_lib
from grpo_jax.distributed import sharding
from grpo_jax.io import run_paths
from grpo_jax.training import run_state
from grpo_jax.io.checkpoint import CheckpointManager
from grpo_jax.training.diagnostics import Diagnostics
from grpo_jax.io.metrics import MetricsWriter
from grpo_jax.rewards import RewardInterrupted
from grpo_jax.training.signal_watch import SignalWatch
from grpo_jax.training.batch_source import BatchSource
from grpo_jax.training.run_context import RunContext, RunState
from grpo_jax.training.step_record import StepLog, StepRecord
from grpo_jax.training.timing import PhaseTiming

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
# One step.


def train_on_batch(ctx: RunContext, state: RunState, batch: phases.StepBatch) -> tuple[RunState, StepRecord]:
    """Phases 4-6 of step `state.step + 1` on its sampled and scored `batch`: the new state and the
    step's record (read one step later, `step_record.StepLog`); nothing here waits for the update."""
    step = state.step + 1
    advantages, completion_mask = phases.compute_advantages(ctx, batch)
    rows = phases.device_rows(ctx, batch, advantages, completion_mask)
    logprobs_dispatched_at = time.perf_counter()
    ref_logp, old_logp, logprobs_ready = phases.logprobs(ctx, state, rows)
    update_dispatched_at = time.perf_counter()
    state, update_metrics, update_ready = phases.update(ctx, state, rows, ref_logp, old_logp, step)
    state = phases.sync_reference(ctx, state, step)
    state = dataclasses.replace(state, step=step, data_position=batch.data_position)
    return state, StepRecord(
        step=step,
        batch=batch,
        advantages=advantages,
        update_metrics=update_metrics,
        logprobs=PhaseTiming(logprobs_dispatched_at, logprobs_ready),
        update=PhaseTiming(update_dispatched_at, update_ready),
    )


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
    _prepare_run_dir(config, resume=resume, overwrite=overwrite, allow_config_change=allow_config_change)
    ctx, fresh = run_context.build(config, task=task, tokenizer=tokenizer)
    if ctx.processes.is_primary:
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = CheckpointManager(
        run_state.ckpt_dir_of(ctx.run_dir), max_to_keep=config.train.keep_checkpoints, async_save=config.train.async_checkpoints
    )
    writer = _metrics_writer(config, ctx.run_dir)
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
        close_engine = getattr(ctx.sampler, "close", None)  # an external engine (vLLM) and its files
        if close_engine is not None:
            close_engine()

    if state.step == config.train.steps and config.train.export_hf:
        run_state.export_hf(ctx, state)
    return RunResult(ctx.run_dir, state.step, loop.history, loop.evals, params=state.params, stopped_by=stopped_by)


def _prepare_run_dir(config: config_lib.Config, *, resume: bool, overwrite: bool, allow_config_change: bool) -> None:
    """The run directory checked (a previous run is resumed or replaced, never mixed), on every process."""
    run_dir = run_paths.as_path(config.train.run_dir)  # gs://... stays itself
    run_dir_lib.prepare(config, run_dir, resume=resume, overwrite=overwrite, allow_config_change=allow_config_change,
                        primary=jax.process_index() == 0)
    if jax.process_count() > 1:  # the primary may have removed an old run: nobody opens it before that
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("grpo_jax run_dir prepared")


def _metrics_writer(config: config_lib.Config, run_dir) -> MetricsWriter:
    return MetricsWriter(
        run_dir,
        total_steps=config.train.steps,
        console=config.train.progress,
        key_metrics=("reward", "frac_reward_zero_std", "kl", "entropy", "eval/pass@1"),
        report_to=config.train.report_to,
        wandb_project=config.train.wandb_project,
        run_config=config_lib.to_dict(config),
    )


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
            episode_limits=rollout_lib.episode_limits(ctx.config),
        )
        res["time/eval"] = time.perf_counter() - t0
        self.evals.append({"step": step, **res})
        return res

    def write(self, row: dict | None) -> None:
        """Logs a metrics row (None: no row, nothing to do), and stops a run stuck on skipped updates."""
        if row is None:
            return
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
        ctx = self.ctx
        self.state = state
        if state.diagnostics is not None:  # resumed: the warnings continue from the saved window
            self.diagnostics.load_state_dict(state.diagnostics)
        if state.step == 0 and ctx.eval_examples:
            self.write({"step": 0, **self.evaluate(ctx.sampler_params(state), 0)})
        # off_policy.max_staleness > 0: batches come from the rollout thread, sampled from older params.
        source = batch_source.open_source(ctx, state, should_stop=lambda: stop.signal is not None)
        try:
            return self._steps(state, stop, source)
        finally:
            source.close()

    def _steps(self, state: RunState, stop: _StopFlag, source: BatchSource) -> tuple[RunState, str | None]:
        """The seed's Step 5, once per step: sample and score a batch, train on it, report it."""
        ctx, start_step, stopped_by = self.ctx, state.step, None
        late = StepLog(ctx, source)
        # One process alone must not leave a step early: the others would wait at its gathers.
        # Several processes therefore stop at step boundaries only, all together (`_stop_reason`).
        interrupt = (lambda: stop.signal is not None) if ctx.processes.count == 1 else None
        while state.step < ctx.config.train.steps and not stopped_by:
            step, compiles_before = state.step + 1, _COMPILES.count
            source.begin(state)  # step N's sampling goes out before step N-1's row is read (nanodo)
            self.write(late.read())
            try:
                batch = source.next_batch(state, late.device_free_at, interrupt)
            except RewardInterrupted:  # a reward function was still running: the step is dropped
                return self._stopped_in_rewards(state, step, stop)
            state, record = train_on_batch(ctx, state, batch)
            self.state = state = source.published(state, record.update_metrics)
            # The first steps of this process compile (resumed runs too); later compiles are reported.
            record.compiles = _COMPILES.count - compiles_before if step - start_step > 2 else 0
            late.hold(record)
            stopped_by = self._stop_reason(stop, step, start_step)
            self._after_step(state, record, late, stopped_by)
        self.write(late.read())
        return state, stopped_by

    def _stopped_in_rewards(self, state: RunState, step: int, stop: _StopFlag) -> tuple[RunState, str]:
        """A stop signal interrupted step `step`'s reward functions: the last finished step is saved."""
        stopped_by = signal.Signals(stop.signal).name
        if state.step != self.saved_step and state.step > 0:
            self.save(state)
        log.warning("stopped during step %d's rewards (%s); step %d saved, resume with --resume",
                    step, stopped_by, state.step)
        return state, stopped_by

    def _stop_reason(self, stop: _StopFlag, step: int, start_step: int) -> str | None:
        """Why the run stops after `step` (None: it goes on). A preempted TPU VM gets SIGTERM alone:
        every process stops after the same step."""
        t_cfg, stopped_by = self.ctx.config.train, None
        if self.ctx.processes.any(stop.signal is not None):
            stopped_by = signal.Signals(stop.signal).name if stop.signal is not None else "SIGTERM on another process"
        if t_cfg.stop_after_steps and step - start_step >= t_cfg.stop_after_steps and step < t_cfg.steps:
            stopped_by = "stop_after_steps"
        return stopped_by

    def _after_step(self, state: RunState, record: StepRecord, late: StepLog, stopped_by: str | None) -> None:
        """Samples, evaluation and checkpoint after step `state.step` was dispatched."""
        ctx, t_cfg, e_cfg, step = self.ctx, self.ctx.config.train, self.ctx.config.eval, state.step
        if t_cfg.samples_every and (step % t_cfg.samples_every == 0 or step == 1):
            self.writer.write_samples(step, record.batch.samples)
        evaluate_now = ctx.eval_examples and ((e_cfg.every and step % e_cfg.every == 0) or step == t_cfg.steps)
        save_now = (t_cfg.checkpoint_every and step % t_cfg.checkpoint_every == 0) or stopped_by or step == t_cfg.steps
        # A checkpoint holds the diagnostics' window up to its own step, so the row is read first
        # (the save waits for the update anyway, to copy its arrays).
        if evaluate_now or save_now:
            # The row is needed now (held-out figures join it, or the run ends here).
            row = late.read()
            if evaluate_now:
                row.update(self.evaluate(ctx.sampler_params(state), step))
                late.devices_free()
            self.write(row)
        if save_now:
            self.save(state)
        if stopped_by:
            log.warning("stopped at step %d (%s); resume with --resume", step, stopped_by)
