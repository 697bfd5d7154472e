"""Orbax save/restore of the whole run state: params, optimizer state, PRNG key data, step, data position, config.

One checkpoint per step lives in ``directory/<step>/`` with two items:
``state`` (a pytree of arrays, written by ``StandardSave``, sharded and asynchronous) and
``meta`` (a JSON dict: data position, config, anything small the trainer needs to resume).

Safety rules, because a lost good checkpoint costs a whole run:
- Orbax writes each step into a temporary directory and renames it only when complete, so a
  crash mid-save leaves a temporary directory, never a half-written step; those are removed
  when the manager opens the directory (``cleanup_tmp_directories``).
- ``restore(step=None)`` walks from the newest step down and returns the first one that loads;
  every step it had to skip gets one warning (step, path, the first line of its error), and when
  none loads one error lists every step tried with its cause. Orbax's own output about those
  attempts is kept out of the log: its absl records about the directory (INFO per read, an
  ERROR per unparsable metadata file) go to this module's DEBUG log, and the tracebacks its
  abandoned tensorstore reads print ("Event loop is closed", one per array) are dropped.
- A step that failed is moved aside to ``directory/corrupt/`` only after an older step has
  loaded, so a wrong ``abstract_state`` (which makes every step fail) never moves anything.
  Moving it aside matters: the resumed run will reach that step number again and Orbax refuses
  to overwrite an existing step; it also stops the broken step counting toward ``max_to_keep``.
- Every save records a fingerprint of each array (``grpo_jax.io.fingerprint``: two 32-bit sums over
  its bit patterns, computed on the devices) in the meta item; a restore recomputes them on what
  it read and treats any difference as a corrupt step, like a missing file: a flipped bit in an
  array file is caught instead of training on. A step whose meta lost the fingerprints, or a
  field the caller requires (``required_meta``), is corrupt too; one saved before fingerprints
  existed (no ``FORMAT_KEY``) restores with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from grpo_jax.io import fingerprint as fingerprint_lib
from grpo_jax.io import run_paths
# The step checks and Orbax's output live in their own modules; `verify_partial_restore`,
# `silence_abandoned_reads` and the meta keys stay importable from here (eval reads them here).
from grpo_jax.io.checkpoint_verify import (  # noqa: F401
    FINGERPRINTS_KEY,
    FORMAT_KEY,
    check_json_files,
    check_restored_matches,
    verified_meta,
    verify_partial_restore,
)
from grpo_jax.io.orbax_output import MAX_CAUSE, one_line, silence_abandoned_reads

log = logging.getLogger(__name__)

CORRUPT_SUBDIR = "corrupt"


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, a lost bucket): one line with the step, the
    directory and what to do; the steps already on disk are untouched."""


class CheckpointManager:
    """Saves every ``save_interval_steps`` steps (or when forced), keeps the newest ``max_to_keep``.

    Usage in a training loop::

        ckpt = CheckpointManager(run_dir / "checkpoints", max_to_keep=3, save_interval_steps=100)
        if ckpt.latest_step() is not None:
            step, state, meta = ckpt.restore(jax.eval_shape(lambda: state))  # or with shardings
        ...
        ckpt.save(step, state, {"data_position": pos, "config": cfg_dict})
        ...
        ckpt.save(last_step, state, meta, force=True)   # at the end, whatever the interval
        ckpt.close()

    ``state`` leaves must be arrays (jax/numpy) or Python scalars. Store a PRNG key as its
    ``jax.random.key_data`` (uint32) and rebuild it with ``jax.random.wrap_key_data``.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int = 3,
        save_interval_steps: int = 1,
        async_save: bool = True,
    ):
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}")
        # etils.epath (Orbax's own path type): a local directory or object storage (gs://...).
        self.directory = run_paths.as_path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise NotADirectoryError(
                f"checkpoint directory {self.directory} exists but is a file; pass a directory path"
            )
        self.max_to_keep = max_to_keep
        self.save_interval_steps = save_interval_steps
        self.async_save = async_save
        # The Orbax manager is opened lazily: opening creates the directory, and a restore from a
        # mistyped path must fail with that path rather than silently create an empty one.
        self._manager: ocp.CheckpointManager | None = None
        self._failed: CheckpointWriteError | None = None  # a save that could not be written, once raised
        if self.directory.is_dir():
            self._open()

    # -- internals -------------------------------------------------------------------------

    def _open(self) -> ocp.CheckpointManager:
        if self._manager is None:
            options = ocp.CheckpointManagerOptions(
                save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(self.save_interval_steps),
                preservation_policy=ocp.checkpoint_managers.LatestN(self.max_to_keep),
                enable_async_checkpointing=self.async_save,
                cleanup_tmp_directories=True,
                create=True,
            )
            with self._quiet_orbax():  # it reads every step's metadata, broken or not
                self._manager = ocp.CheckpointManager(self.directory, options=options)
            # A failed background save (a full disk) makes Orbax log an ERROR with a traceback from
            # each of its threads, and leaves abandoned writes that print more at exit; `save` and
            # `wait_until_finished` report it once, as a CheckpointWriteError.
            logging.getLogger("absl").addFilter(self._save_noise)
            silence_abandoned_reads(self.directory)
        return self._manager

    def _save_noise(self, record: logging.LogRecord) -> bool:
        """absl filter while the manager is open: False (drop, to this module's DEBUG log) for Orbax's
        ERROR records about a save into this directory."""
        if record.levelno < logging.ERROR:
            return True
        where = str(self.directory)
        exc = record.exc_info[1] if record.exc_info else None
        full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC  # its text names no file
        if where not in record.getMessage() and (exc is None or where not in str(exc)) and not full:
            return True
        log.debug("Orbax save: %s", record.getMessage()[:MAX_CAUSE])
        return False

    def _write_error(self, err: Exception, step: int | None) -> CheckpointWriteError:
        text = str(err)
        which = f"step {step}" if step is not None else "a step"
        if "No space left on device" in text or "os_error_code='28'" in text:
            cause = ("no space left on the device. Free space there (or set train.run_dir on a bigger disk) and "
                     "run again with --resume: the checkpoints already written are kept")
        else:
            cause = one_line(err)
        self._failed = CheckpointWriteError(f"checkpoint {which} could not be written to {self.directory}: {cause}")
        return self._failed

    @contextlib.contextmanager
    def _quiet_orbax(self, step: int | None = None) -> Iterator[None]:
        """Keeps Orbax's absl records about this directory out of the log while we read it.

        Dropped: INFO chatter, and WARNING/ERROR records that name a path under the directory
        ("Failed to json parse Metadata file: .../3/_CHECKPOINT_METADATA", logged once per read
        of the steps); those are the symptoms of a broken step, whose error ``restore`` reports
        once. They go to this module's DEBUG log. Other warnings pass through.
        """
        where = str(self.directory)

        def keep(record: logging.LogRecord) -> bool:
            if record.levelno < logging.WARNING:
                return False
            message = record.getMessage()
            if where not in message:
                return True
            log.debug("Orbax%s: %s %s", "" if step is None else f" (step {step})", record.levelname,
                      message[:MAX_CAUSE])
            return False

        absl_logger = logging.getLogger("absl")
        absl_logger.addFilter(keep)
        try:
            yield
        finally:
            absl_logger.removeFilter(keep)

    def _quarantine(self, step: int) -> Path | None:
        """Moves ``directory/<step>`` to ``directory/corrupt/<step>-<unix time>``; returns the new path."""
        src = self.directory / str(step)
        if not src.exists() or jax.process_index() != 0:
            return None
        dst_dir = self.directory / CORRUPT_SUBDIR
        dst_dir.mkdir(exist_ok=True)
        dst = dst_dir / f"{step}-{int(time.time())}"
        src.rename(dst)
        return dst

    # -- public API ------------------------------------------------------------------------

    def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
        """Starts saving ``state`` and ``meta`` as ``step``; returns whether a save was started.

        Skipped (False) when ``step`` is not a multiple of ``save_interval_steps`` unless ``force``,
        and when ``step`` is already on disk (so a forced final save after an interval save of the
        same step is harmless). With ``async_save`` the arrays are copied to host before this
        returns, so the caller may donate or overwrite them; files are written in the background.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
        if not isinstance(meta, dict):
            raise TypeError(f"checkpoint meta must be a dict, got {type(meta).__name__}")
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"checkpoint meta for step {step} must be JSON-serialisable (dict/list/str/int/float/bool/None): {e}"
            ) from e
        for key in (FINGERPRINTS_KEY, FORMAT_KEY):
            if key in meta:
                raise ValueError(f"checkpoint meta key {key!r} is reserved for the arrays' fingerprints")
        manager = self._open()
        if step in manager.all_steps():
            log.info("checkpoint step %d already exists in %s; not saving it again", step, self.directory)
            return False
        if not manager.should_save(step) and not force:
            return False
        # Computed from the same device arrays Orbax copies to host, before the caller may donate them.
        meta = {**meta, FINGERPRINTS_KEY: fingerprint_lib.tree_fingerprints(state), FORMAT_KEY: 1}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        try:  # Orbax raises an earlier background save's failure here, or this one's when synchronous
            return bool(manager.save(step, args=args, force=force))
        except (OSError, ValueError, RuntimeError) as e:
            if isinstance(e, CheckpointWriteError):
                raise
            raise self._write_error(e, step) from None

    def all_steps(self) -> list[int]:
        """Steps on disk, oldest first (not checked for integrity; ``restore`` does that)."""
        if self._manager is None:
            return []
        with self._quiet_orbax():
            self._manager.reload()
            return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest step on disk, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, abstract_state: Any, step: int | None = None,
                required_meta: tuple[str, ...] = ()) -> tuple[int, Any, dict]:
        """Returns ``(step, state, meta)``.

        abstract_state: the pytree to restore into, with ``jax.ShapeDtypeStruct`` leaves (give each
          a ``.sharding`` to restore sharded; ``jax.eval_shape`` of the init function works).
        step: a specific step (no fallback: if it fails, that error is raised), or None for the
          newest step that loads; newer ones that fail are named in a warning and moved aside.
        required_meta: keys the meta must hold; a step without one of them is corrupt (it falls
          back like a step whose arrays do not match their fingerprints).
        """
        if not self.directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory {self.directory} does not exist")
        manager = self._open()
        manager.wait_until_finished()  # a save still in flight must land before we read the disk
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(
                f"no checkpoints in {self.directory}: expected step directories such as "
                f"{self.directory / '100'} written by grpo_jax.io.checkpoint.CheckpointManager.save"
            )
        if step is not None:
            if step not in steps:
                raise FileNotFoundError(
                    f"checkpoint step {step} not found in {self.directory}; available steps: {steps}"
                )
            restored_state, meta = self._restore_step(manager, abstract_state, step, required_meta)
            return step, restored_state, meta

        failures: list[tuple[int, str]] = []  # (step, its one-line cause), newest first
        for candidate in reversed(steps):
            try:
                restored_state, meta = self._restore_step(manager, abstract_state, candidate, required_meta)
            except Exception as e:  # noqa: BLE001 -- any failure means "this step is unusable"
                failures.append((candidate, one_line(e)))
                continue
            for bad_step, cause in failures:
                moved = self._quarantine(bad_step)
                log.warning(
                    "checkpoint step %d (%s) is corrupt or partial: %s; restored step %d instead%s",
                    bad_step, self.directory / str(bad_step), cause, candidate,
                    f"; moved it to {moved}" if moved else "",
                )
            if failures:
                with self._quiet_orbax():
                    manager.reload()
            return candidate, restored_state, meta
        tried = ", ".join(str(s) for s, _ in failures)
        details = "".join(f"\n  step {s} ({self.directory / str(s)}): {cause}" for s, cause in failures)
        raise RuntimeError(
            f"no checkpoint in {self.directory} could be restored; tried steps {tried} (newest first) and "
            "moved or deleted nothing. If every step fails the same way, abstract_state probably does "
            f"not match what was saved (a changed model or optimizer config). Each step's error:{details}"
        )

    def _restore_step(self, manager: ocp.CheckpointManager, abstract_state: Any,
                      step: int, required_meta: tuple[str, ...]) -> tuple[Any, dict]:
        check_json_files(self.directory / str(step))
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore())
        silence_abandoned_reads(self.directory)
        with self._quiet_orbax(step):
            restored = manager.restore(step, args=args)
        meta = restored["meta"]
        if not isinstance(meta, dict):
            raise ValueError(f"meta item of step {step} is {type(meta).__name__}, expected a JSON object")
        check_restored_matches(abstract_state, restored["state"], step)
        meta_file = self.directory / str(step) / "meta" / "metadata"
        meta, verified = verified_meta(meta, restored["state"], meta_file, required_meta)
        if not verified:
            log.warning("checkpoint step %d (%s) was saved before grpo_jax fingerprinted its arrays: restored "
                        "without verifying them", step, meta_file)
        return restored["state"], meta

    @property
    def failed(self) -> bool:
        """Whether a save could not be written (and was reported): later saves are not attempted."""
        return self._failed is not None

    def wait_until_finished(self) -> None:
        """Blocks until any asynchronous save has been written and committed; a save that failed
        raises CheckpointWriteError (once: later calls return, the failure was reported)."""
        if self._manager is None:
            return
        try:
            self._manager.wait_until_finished()
        except (OSError, ValueError, RuntimeError) as e:
            if self._failed is not None:
                return
            raise self._write_error(e, None) from None

    def close(self) -> None:
        """Waits for pending saves and releases Orbax's background resources."""
        if self._manager is not None:
            try:
                self.wait_until_finished()
            finally:
                with contextlib.suppress(Exception):  # after a failed save Orbax's close re-raises it
                    self._manager.close()
                self._manager = None
                logging.getLogger("absl").removeFilter(self._save_noise)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


