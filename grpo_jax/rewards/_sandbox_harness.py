"""Sandbox harness for `code_reward`; run as `python -I _sandbox_harness.py` in a fresh temp dir.

Standalone on purpose (no grpo_jax imports: `-I` ignores the environment and user site). Protocol:
  stdin line 1: JSON {"code", "calls", "timeout_s", "memory_mb", "output_bytes", "result_fd"}
  -> the harness forks a candidate process, which runs the code and evaluates each hidden call,
     streaming one tagged-JSON line per call back to the harness over a private pipe;
  -> the harness waits (wall-clock limit), kills the candidate's process group, prints "ready";
  stdin line 2: the nonce, sent by the trainer only now, after the candidate is dead, so no
     candidate code ever shares a process or a moment with it;
  -> the harness writes {"nonce", "results"} to `result_fd`, an fd the candidate closed before
     its code ran. The expected values never enter this process: the trainer compares.
The candidate's exit code, stdout and stderr are ignored (its output goes to a size-capped file).
"""

import json
import os
import resource
import select
import signal
import sys
import time


def _encode(value, depth=0):
    """Exact-type tagged encoding: an int subclass with a lying __eq__ is not an int."""
    if depth > 50:
        raise ValueError("too deep")
    t = type(value)
    if value is None:
        return ["n"]
    if t is bool:
        return ["b", value]
    if t is int:
        return ["i", str(value)]
    if t is float:
        return ["f", repr(value)]
    if t is str:
        return ["s", value]
    if t is list or t is tuple:
        return ["l" if t is list else "t", [_encode(v, depth + 1) for v in value]]
    if t is dict:
        return ["d", [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in value.items()]]
    raise TypeError(f"unsupported result type {t.__name__}")


_PRELOAD = ("math", "cmath", "itertools", "functools", "collections", "heapq", "bisect", "re", "string",
            "random", "typing", "fractions", "decimal", "statistics", "operator", "copy", "dataclasses",
            "array", "datetime", "glob", "pathlib", "io", "struct", "hashlib", "enum", "abc")


def _block_network():
    # The real barrier is `unshare -n` (no network namespace) when available; this is a second one.
    import socket

    def _refuse(*args, **kwargs):
        raise OSError("network disabled in the sandbox")

    for name in ("socket", "create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
        setattr(socket, name, _refuse)
    sys.modules["_socket"] = None


def _run_candidate(cfg, write_fd):
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    out = os.open("candidate_output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(cfg["result_fd"])
    mem = cfg["memory_mb"] * 1024 * 1024
    cpu = int(cfg["timeout_s"]) + 1
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["output_bytes"], cfg["output_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _block_network()
    if os.geteuid() == 0:
        # The interpreter's files may be unreadable to `nobody` (e.g. under /root): import the
        # modules solutions commonly use while still root.
        for name in _PRELOAD:
            try:
                __import__(name)
            except ImportError:
                pass
        # Run as `nobody`: the candidate can then write only in its temp dir (and world-writable
        # places), not in the trainer's checkpoints, data or code.
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    write, exit_now, dumps = os.write, os._exit, json.dumps  # bound before candidate code runs
    namespace = {"__name__": "candidate", "__builtins__": __builtins__}
    try:
        exec(compile(cfg["code"], "candidate.py", "exec"), namespace)
    except BaseException:  # noqa: BLE001 -- sys.exit(0) at import is a failure, not a pass
        exit_now(0)
    for call in cfg["calls"]:
        try:
            line = dumps({"ok": _encode(eval(compile(call, "<hidden test>", "eval"), namespace))})
        except BaseException:  # noqa: BLE001 -- a raising (or exiting) call fails that test
            line = dumps({"error": True})
        data = (line + "\n").encode()
        while data:
            data = data[write(write_fd, data):]
    exit_now(0)


def main():
    cfg = json.loads(sys.stdin.readline())
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            _run_candidate(cfg, write_fd)
        finally:
            os._exit(0)
    os.close(write_fd)
    deadline = time.monotonic() + cfg["timeout_s"]
    chunks, size, limit = [], 0, cfg["output_bytes"]
    while size <= limit:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([read_fd], [], [], left)[0]:
            break
        chunk = os.read(read_fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    for target in (-pid, pid):  # the candidate's whole session, then the process itself
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.waitpid(pid, 0)
    lines = b"".join(chunks)[:limit].decode("utf-8", "replace").splitlines()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    nonce = sys.stdin.readline().strip()
    payload = json.dumps({"nonce": nonce, "results": lines}).encode()
    while payload:
        payload = payload[os.write(cfg["result_fd"], payload):]
    os.close(cfg["result_fd"])


if __name__ == "__main__":
    main()
