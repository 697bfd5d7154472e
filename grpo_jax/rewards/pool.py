"""Worker processes for verification: started once, reused, per-item wall-clock timeouts.

A pathological answer or a crash of the checker must cost one 0.0, never the training run. So:
- items are sent in chunks (one pickled message per chunk, not per item), and each worker sends
  back one value per item as it finishes, which gives every item its own deadline;
- a worker that misses an item's deadline is killed and replaced; that item scores 0.0 and the
  rest of its chunk is requeued; a worker that dies (segfault, os._exit, out of memory) likewise;
- a function that raises inside the worker scores 0.0 for that item.
`call` runs one whole function call (a user reward function's batch) in a worker instead, with an
optional timeout and a stop flag; there an error is raised, not scored, since nothing item-sized
is left to score 0.0.
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
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any


class CallTimeout(TimeoutError):
    """`VerifierPool.call` ran past its timeout; the worker was killed and replaced."""


class CallInterrupted(Exception):
    """`should_stop()` became true while `VerifierPool.call` waited; the worker was killed and replaced."""


class RemoteError(Exception):
    """`VerifierPool.call`'s function raised, could not be loaded, killed its worker, or returned
    something that cannot be pickled back. The message reads after the function's name
    ("raised KeyError: 'answer' ..."); a worker's traceback is appended."""


def _run_call(conn, payload: bytes, memory_mb: int | None) -> None:
    """One `call` message: unpickle (fn, args, kwargs), say "loaded", run, send ("ok", value) or ("error", text)."""
    try:
        fn, args, kwargs = pickle.loads(payload)  # may import fn's module: not counted against the call
    except BaseException as e:  # noqa: BLE001 -- reported to the caller, the worker lives on
        conn.send(("error", f"could not be loaded in its worker process: {type(e).__name__}: {e}"))
        return
    conn.send("loaded")
    try:
        value = fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 -- SystemExit in user code is an error, not a worker exit
        hint = ""
        if isinstance(e, MemoryError) and memory_mb:
            hint = f" (the worker's address space is limited to {memory_mb} MB: VerifierPool(memory_mb=...))"
        text = f"raised {type(e).__name__}: {e}{hint}\ntraceback in its worker process:\n{traceback.format_exc()}"
        conn.send(("error", text))
        return
    try:
        conn.send(("ok", value))  # pickled before anything is written: a failure sends nothing
    except Exception as e:  # noqa: BLE001 -- a generator, an open file...: reported by type
        conn.send(("error", (f"returned a {type(value).__name__}, which cannot be pickled back from its worker "
                             f"process ({type(e).__name__}: {e}); expected a list of floats or None")))


def _worker_main(conn, memory_mb: int | None) -> None:
    """Worker loop: ("map", fn, items) -> one float per item; ("call", payload) -> one result; None stops."""
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
        if msg[0] == "call":
            _run_call(conn, msg[1], memory_mb)
            continue
        _, fn_bytes, items = msg
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
            values = pool.call(user_reward, (prompts, completions), fields, timeout_s=60.0)
    `fn` must be a picklable top-level function returning a float; each item is a tuple of its
    positional arguments. An item that times out, raises, or kills its worker scores 0.0. `call`
    raises instead (see its docstring): it is how compute_rewards runs a user's reward function.
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
                        w.conn.send(("map", fn_bytes, [items[i] for i in idx]))
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

    def call(self, fn: Callable[..., Any], args: Sequence = (), kwargs: Mapping[str, Any] | None = None, *,
             timeout_s: float | None = None, should_stop: Callable[[], bool] | None = None,
             poll_s: float = 0.1) -> Any:
        """fn(*args, **kwargs) in a worker process; its return value.

        `timeout_s` (None: no limit) counts from the moment the worker has unpickled fn and its
        arguments (importing fn's module is start-up, bounded by `startup_timeout_s`). Waits in
        slices of `poll_s` seconds, calling `should_stop()` (if given) after each.
        Raises:
          pickle.PicklingError: fn or an argument cannot be pickled (a lambda, a closure, a lock).
          CallTimeout: past timeout_s; the worker was killed and replaced.
          CallInterrupted: should_stop() became true; the worker was killed and replaced.
          RemoteError: fn raised (the worker's traceback is in the message), could not be loaded,
            killed its worker (replaced), or returned a value that cannot be pickled.
        """
        if self._closed:
            raise RuntimeError("VerifierPool.call called after close()")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"VerifierPool.call: timeout_s must be None or > 0, got {timeout_s}")
        try:
            payload = pickle.dumps((fn, tuple(args), dict(kwargs or {})))
        except Exception as e:  # PicklingError, AttributeError (a local object), TypeError (a lock)
            raise pickle.PicklingError(f"cannot pickle {getattr(fn, '__qualname__', fn)!r} or its arguments "
                                       f"for a worker process: {type(e).__name__}: {e}") from e
        with self._lock:
            return self._call(payload, timeout_s, should_stop, poll_s)

    def _idle_worker(self) -> int:
        """A worker that has said "ready" (start-up done), else the first one."""
        for k, w in enumerate(self._workers):
            if not w.ready and w.proc.is_alive() and w.conn.poll(0):
                try:
                    w.ready = w.conn.recv() == "ready"
                except (EOFError, OSError):
                    self._replace(k)
            if w.ready:
                return k
        return 0

    def _call(self, payload, timeout_s, should_stop, poll_s):
        k = self._idle_worker()
        try:
            self._workers[k].conn.send(("call", payload))
        except (BrokenPipeError, OSError):
            self._replace(k)
            self._workers[k].conn.send(("call", payload))
        w = self._workers[k]
        deadline = time.monotonic() + self.startup_timeout_s  # until "loaded", then timeout_s
        loaded = False
        while True:
            if should_stop is not None and should_stop():
                self._replace(k)
                raise CallInterrupted("should_stop() became true; the worker was killed")
            now = time.monotonic()
            if now >= deadline:
                self._replace(k)
                if not loaded:
                    raise RemoteError(f"did not start in its worker process within startup_timeout_s="
                                      f"{self.startup_timeout_s:g} s (importing its module?); the worker was killed")
                raise CallTimeout(f"ran past {timeout_s:g} s; the worker was killed and replaced")
            if not w.conn.poll(min(poll_s, deadline - now)):
                continue
            try:
                msg = w.conn.recv()
            except (EOFError, OSError):  # the worker died: segfault, os._exit, out of memory, a signal
                w.proc.join(timeout=1)
                code = w.proc.exitcode
                self._replace(k)
                if should_stop is not None and should_stop():  # a SIGTERM to the process group
                    raise CallInterrupted("should_stop() became true; the worker died") from None
                raise RemoteError(f"killed its worker process (exit code {code}); the worker was replaced") from None
            if msg == "ready":
                w.ready = True
            elif msg == "loaded":
                loaded = True
                deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
            elif msg[0] == "ok":
                return msg[1]
            else:
                raise RemoteError(msg[1])

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
