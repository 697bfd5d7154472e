"""Worker processes for verification: started once, reused, per-item wall-clock timeouts.

A pathological answer or a crash of the checker must cost one 0.0, never the training run. So:
- items are sent in chunks (one pickled message per chunk, not per item), and each worker sends
  back one value per item as it finishes, which gives every item its own deadline;
- a worker that misses an item's deadline is killed and replaced; that item scores 0.0 and the
  rest of its chunk is requeued; a worker that dies (segfault, os._exit, out of memory) likewise;
- a function that raises inside the worker scores 0.0 for that item.
Workers use the "spawn" start method: the trainer process runs JAX threads, and forking a
multithreaded process can deadlock.
"""

from __future__ import annotations

import collections
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Sequence


def _worker_main(conn, memory_mb: int | None) -> None:
    """Worker loop: receive (fn, items), send one float per item; None stops the worker."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    if memory_mb:
        import resource

        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send("ready")  # item deadlines start only now: start-up (imports) is not an item's time
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        fn_bytes, items = msg
        try:
            fn = pickle.loads(fn_bytes)  # may import fn's module: not counted against an item
        except Exception as e:  # noqa: BLE001 -- an unimportable fn: every item scores 0.0
            print(f"VerifierPool worker: cannot load the function: {e!r}", file=sys.stderr)
            fn = None
        conn.send("loaded")
        for item in items:
            try:
                value = float(fn(*item))
                if math.isnan(value):
                    value = 0.0
            except BaseException:  # noqa: BLE001 -- SystemExit/MemoryError in a check is a 0.0
                value = 0.0
            conn.send(value)


class _Worker:
    def __init__(self, ctx, memory_mb):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, memory_mb), daemon=True)
        self.proc.start()
        child.close()
        self.chunk: list[int] = []  # indices of the items sent and not yet answered
        self.deadline = math.inf
        self.ready = False  # set when the worker's "ready" message arrives

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class VerifierPool:
    """A reusable pool of verifier processes with a per-item timeout.

    Usage:
        with VerifierPool(num_workers=2, timeout_s=2.0) as pool:
            scores = pool.map(math_reward, [(completion, answer), ...])
    `fn` must be a picklable top-level function returning a float; each item is a tuple of its
    positional arguments. An item that times out, raises, or kills its worker scores 0.0.
    """

    def __init__(self, num_workers: int | None = None, *, timeout_s: float = 2.0, memory_mb: int | None = 2048,
                 max_chunk: int = 64, startup_timeout_s: float = 120.0):
        if num_workers is None:
            num_workers = max(1, min(8, (os.cpu_count() or 2) - 1))
        if num_workers < 1:
            raise ValueError(f"VerifierPool: num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"VerifierPool: timeout_s must be > 0, got {timeout_s}")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.max_chunk = max_chunk
        self.startup_timeout_s = startup_timeout_s
        self.restarts = 0  # workers replaced after a timeout or crash (for logging)
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._workers = [_Worker(self._ctx, memory_mb) for _ in range(num_workers)]
        self._closed = False

    def _replace(self, k: int) -> None:
        self._workers[k].kill()
        self._workers[k] = _Worker(self._ctx, self.memory_mb)
        self.restarts += 1

    def map(self, fn: Callable[..., float], items: Sequence[tuple]) -> list[float]:
        """fn(*item) for every item, in order; 0.0 for an item that timed out, raised or crashed."""
        if self._closed:
            raise RuntimeError("VerifierPool.map called after close()")
        items = list(items)
        if not items:
            return []
        with self._lock:
            return self._map(fn, items)

    def _map(self, fn, items) -> list[float]:
        n = len(items)
        fn_bytes = pickle.dumps(fn)  # pickled once per map; fails here, loudly, for a lambda
        results: list[float | None] = [None] * n
        chunk = max(1, min(self.max_chunk, math.ceil(n / (4 * self.num_workers))))
        pending = collections.deque(list(range(i, min(i + chunk, n))) for i in range(0, n, chunk))
        done = 0
        while done < n:
            # Hand chunks to idle workers. A worker whose pipe is broken is replaced, chunk requeued.
            for k, w in enumerate(self._workers):
                if not w.chunk and pending:
                    idx = pending.popleft()
                    try:
                        w.conn.send((fn_bytes, [items[i] for i in idx]))
                    except (BrokenPipeError, OSError):
                        pending.appendleft(idx)
                        self._replace(k)
                        continue
                    w.chunk = idx
                    # Until the worker says "loaded" (fn unpickled, its module imported) the clock
                    # is the start-up one; each item then gets timeout_s from the previous answer.
                    w.deadline = time.monotonic() + self.startup_timeout_s
            busy = [w for w in self._workers if w.chunk]
            if not busy:
                continue
            wait_s = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            ready = mp_connection.wait([w.conn for w in busy], timeout=wait_s)
            now = time.monotonic()
            for k, w in enumerate(self._workers):
                if not w.chunk:
                    continue
                if w.conn in ready:
                    try:
                        value = w.conn.recv()
                    except (EOFError, OSError):  # the worker died mid-item: that item scores 0.0
                        value = None
                    if value in ("ready", "loaded"):
                        w.ready = True
                        w.deadline = now + self.timeout_s
                        continue
                    if value is not None:
                        results[w.chunk.pop(0)] = float(value)
                        done += 1
                        w.deadline = now + self.timeout_s
                        continue
                elif now < w.deadline:
                    continue
                # Crashed, or past the deadline: current item scores 0.0, the rest go back in the queue.
                results[w.chunk.pop(0)] = 0.0
                done += 1
                if w.chunk:
                    pending.appendleft(w.chunk)
                w.chunk = []
                self._replace(k)
        return [float(r) for r in results]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for w in self._workers:
            w.proc.join(timeout=2)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(timeout=2)
            w.conn.close()

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- interpreter shutdown
            pass
