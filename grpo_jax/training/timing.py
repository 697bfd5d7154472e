"""When dispatched device work finished, without the host waiting for it.

JAX dispatches asynchronously: a jitted call returns at once and the device runs it later, in
order. The trainer keeps the device busy by dispatching the next piece of work before it reads the
last one's results, so "how long did the update take" cannot be measured by the host blocking on
it. `ReadyTimes.watch(name, arrays)` starts a daemon thread that blocks on the arrays and records
when they became ready; the main thread reads that time later (`ready_at`), after the fact.
"""

from __future__ import annotations

import threading
import time

import jax


class ReadyTimes:
    """perf_counter() timestamps at which watched arrays became ready, by name."""

    def __init__(self):
        self._threads: dict[str, threading.Thread] = {}
        self._times: dict[str, float] = {}
        self._errors: dict[str, Exception] = {}

    def watch(self, name: str, arrays) -> None:
        """Records when every array in the pytree `arrays` is computed (returns at once). Watch
        arrays nothing donates (metrics, log-probs), not params: a donated buffer is deleted."""

        def wait():
            try:
                jax.block_until_ready(arrays)
            except Exception as e:  # noqa: BLE001 - the main thread sees the error when it reads
                self._errors[name] = e
            self._times[name] = time.perf_counter()

        thread = threading.Thread(target=wait, name=f"ready:{name}", daemon=True)
        self._threads[name] = thread
        thread.start()

    def __contains__(self, name: str) -> bool:
        return name in self._threads

    def ready_at(self, name: str) -> float:
        """The time `name`'s arrays became ready (waits for them if they are not yet)."""
        self._threads.pop(name).join()
        if name in self._errors:
            raise self._errors.pop(name)
        return self._times.pop(name)
