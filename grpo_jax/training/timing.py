"""When dispatched device work finished, without the host waiting for it.

JAX dispatches asynchronously: a jitted call returns at once and the device runs it later, in
order. The trainer keeps the device busy by dispatching the next piece of work before it reads the
last one's results, so "how long did the update take" cannot be measured by the host blocking on
it. `ReadyAt(arrays)` starts a daemon thread that blocks on the arrays and records when they became
ready; the main thread reads that time later (`ReadyAt.time`), after the fact. A `PhaseTiming` pairs
it with when the phase was dispatched: the typed handle a step record keeps for each phase.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import jax


class ReadyAt:
    """The perf_counter() time at which every array of one pytree became ready.

    Watch arrays nothing donates (metrics, log-probs), not params: a donated buffer is deleted."""

    def __init__(self, arrays):
        self._time: float | None = None
        self._error: Exception | None = None

        def wait():
            try:
                jax.block_until_ready(arrays)
            except Exception as e:  # noqa: BLE001 - the main thread sees the error when it reads
                self._error = e
            self._time = time.perf_counter()

        self._thread = threading.Thread(target=wait, name="ready", daemon=True)
        self._thread.start()

    def time(self) -> float:
        """When the arrays became ready (waits for them if they are not yet); their error, if any."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._time


@dataclasses.dataclass(frozen=True)
class PhaseTiming:
    """One phase's device work: when the host dispatched it, and when it was ready (None: the
    phase dispatched no device work, so it ended when it was dispatched)."""

    dispatched_at: float
    ready: ReadyAt | None

    def ended_at(self) -> float:
        return self.ready.time() if self.ready is not None else self.dispatched_at
