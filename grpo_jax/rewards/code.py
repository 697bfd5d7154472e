"""The code reward: a completion's Python run against hidden tests in a sandboxed subprocess.

Seed Part 2's code hacks and what stops each one here:
- hard-coding the tests shown in the prompt: the hidden tests are different inputs;
- early exit (`sys.exit(0)`, `os._exit`): exit codes and stdout are ignored; a test passes only
  when the harness receives its return value and the trainer finds it equal to the expected one;
- printing "passed": stdout goes to a size-capped file nobody reads;
- catching every exception: the harness, not the candidate, calls the functions; a swallowed
  error returns a wrong value;
- editing the test files: there are none; the hidden tests travel over a pipe, and their expected
  values never leave this process;
- objects with a lying `__eq__`: return values are encoded by exact type (int, float, str, bool,
  None, list, tuple, dict) and compared here;
- forging the result: it is written with a random nonce sent to the harness only after the
  candidate's processes are killed, to an fd the candidate closed before its code ran.
Each verdict runs in its own harness process (`_sandbox_harness.py`), walled in as far as the
machine allows; `sandbox_isolation()` reports which walls this machine gives. Limits, and how:
- time: `timeout_s` of wall clock from the candidate's start (RLIMIT_CPU as a second limit), then
  every process it made is killed; the trainer allows the whole verdict `timeout_s + 0.9` s.
- processes: `max_procs` tasks, threads included (RLIMIT_NPROC). Inside the verdict's own user
  namespace the count is the verdict's alone; without one it is shared with every process of the
  candidate's uid, so the cap is set `max_procs` above that uid's count when the verdict starts.
- memory: `memory_mb` of address space per process (RLIMIT_AS), and `memory_mb` in total: every
  25 ms the harness adds up the PSS of all the candidate's processes and what its private /tmp and
  /dev/shm hold, and past the limit kills them all (the verdict scores 0). Between two reads a
  burst can overshoot; the hard bound is then the rlimits' `max_procs * memory_mb`. Where cgroup v2
  is delegated (this process's cgroup, or its parent, is writable and has `memory` and `pids` in
  cgroup.subtree_control), each verdict also gets its own cgroup (memory.max `memory_mb` + 64 MiB
  for the harness, no swap, pids.max, OOM kills the group), so the kernel enforces the total.
- files: `output_bytes` per file (RLIMIT_FSIZE); the private /tmp and /dev/shm are tmpfs of at
  most `memory_mb` each, counted in the total above.
- what it sees: with a user namespace of its own (or as root) and a mount namespace, a minimal
  root: read-only /usr, /etc, the Python install and its sys.path, five devices (null, zero, full,
  random, urandom), its own /proc, and private /tmp and /dev/shm that vanish with the verdict, as
  do SysV and POSIX IPC objects (its own IPC namespace). The project dir, the trainer's cwd (runs,
  data, checkpoints), /home, /root and the host's /tmp and /dev/shm are not in it. No
  network: an empty network namespace, plus a patched socket module. Its own PID namespace: every
  process it forks dies with the verdict.
- who it is: under root, `nobody`; under another user, uid 0 of its own user namespace with every
  capability dropped for good (bounding set, locked securebits, no_new_privs), which is the
  trainer's user outside.
- concurrency: `code_reward_fn` runs up to `max_concurrent` verdicts at once (default: the cores
  this process may use), so N completions that all loop cost ceil(N / max_concurrent) timeouts,
  not N. Peak memory is then up to `max_concurrent * memory_mb`.
Where the machine gives less, it degrades, and a warning says so once:
- no user namespaces, as root: mount, PID, network and IPC namespaces as root (same walls; the
  process cap is shared with every `nobody` process, as above).
- no namespaces at all (not root and no user namespaces; a container whose seccomp profile refuses
  unshare): the candidate is NOT walled off. It can read every file its uid may read (the
  project's source, other runs' files), reach the network but for the patched socket module, and
  write where its uid may. Under root it runs as `nobody`, and what `nobody` created in /tmp,
  /var/tmp and /dev/shm during the verdicts is removed once no verdict runs (other world-writable
  places and SysV IPC objects are not cleaned); under another user nothing is cleaned up. Files
  it writes there are capped per file only, and not counted in the memory total, which still
  holds for its processes; they are still all killed (the harness is their subreaper).
Use a container or VM for stronger walls (seccomp, a kernel of its own).
"""

from __future__ import annotations

import ast
import functools
import itertools
import json
import math
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent import futures

_HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_harness.py")
_FENCE_RE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
MAX_CODE_CHARS = 100_000
_STARTUP_S = 0.9  # harness start-up and walls, on top of the candidate's own time limit


def parse_hidden_tests(hidden_tests: str) -> list[tuple[str, object]]:
    """`assert f(x) == <literal>` statements -> [(call source, expected value)].

    The hidden tests are trusted (written by whoever built the task), but they are parsed, never
    executed here; expected values are Python literals. Raises ValueError naming the bad line.
    """
    try:
        tree = ast.parse(hidden_tests)
    except SyntaxError as e:
        raise ValueError(f"hidden_tests: syntax error on line {e.lineno}: {e.msg}") from e
    tests = []
    for node in tree.body:
        ok = (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
              and isinstance(node.test.ops[0], ast.Eq))
        if not ok:
            raise ValueError(f"hidden_tests line {node.lineno}: expected `assert <call> == <literal>`")
        try:
            expected = ast.literal_eval(node.test.comparators[0])
        except ValueError as e:
            raise ValueError(f"hidden_tests line {node.lineno}: the expected value must be a literal") from e
        tests.append((ast.unparse(node.test.left), expected))
    if not tests:
        raise ValueError("hidden_tests: no `assert <call> == <literal>` statements found")
    return tests


def extract_code(completion: str) -> str | None:
    """The last ```python fenced block, or the whole completion when it has no fence at all."""
    if not isinstance(completion, str) or len(completion) > MAX_CODE_CHARS:
        return None
    blocks = _FENCE_RE.findall(completion)
    if blocks:
        return blocks[-1]
    return None if "```" in completion else completion


def _decode(tagged):
    tag = tagged[0]
    if tag == "n":
        return None
    if tag == "b":
        return bool(tagged[1])
    if tag == "i":
        return int(tagged[1])
    if tag == "f":
        return float(tagged[1])
    if tag == "s":
        return str(tagged[1])
    if tag == "l":
        return [_decode(v) for v in tagged[1]]
    if tag == "t":
        return tuple(_decode(v) for v in tagged[1])
    if tag == "d":
        return {_decode(k): _decode(v) for k, v in tagged[1]}
    raise ValueError(f"unknown tag {tag!r}")


def values_equal(got, expected) -> bool:
    """Strict equality: same container types, bools are not ints, floats to 1e-9 relative."""
    if type(expected) is bool or type(got) is bool:
        return type(got) is type(expected) and got == expected
    if isinstance(expected, (int, float)) and isinstance(got, (int, float)):
        if isinstance(expected, float) or isinstance(got, float):
            return math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12)
        return got == expected
    if type(got) is not type(expected):
        return False
    if isinstance(expected, (list, tuple)):
        return len(got) == len(expected) and all(values_equal(g, e) for g, e in zip(got, expected))
    if isinstance(expected, dict):
        return got.keys() == expected.keys() and all(values_equal(got[k], expected[k]) for k in expected)
    return got == expected


def code_reward(completion: str, hidden_tests: str, *, timeout_s: float = 5.0, memory_mb: int = 512,
                output_bytes: int = 1 << 20, max_procs: int = 64) -> float:
    """Fraction of hidden tests passed by the completion's code, in [0, 1]; 0.0 on any failure.

    `hidden_tests`: Python source of `assert <call> == <literal>` lines (trusted; see
    `parse_hidden_tests`). Limits (module docstring): `timeout_s` wall-clock seconds, `memory_mb`
    MiB per process and in total, `output_bytes` per file, `max_procs` tasks. Never raises on model
    text; raises ValueError for malformed hidden tests.
    """
    tests = parse_hidden_tests(hidden_tests)
    code = extract_code(completion)
    if code is None or not code.strip():
        return 0.0
    lines, _ = _run_sandboxed(code, [call for call, _ in tests], timeout_s=timeout_s, memory_mb=memory_mb,
                              output_bytes=output_bytes, max_procs=max_procs)
    if lines is None or len(lines) != len(tests):
        return 0.0  # the candidate died early, or wrote extra lines into the pipe
    passed = 0
    for line, (_, expected) in zip(lines, tests):
        try:
            msg = json.loads(line)
            if isinstance(msg, dict) and "ok" in msg and values_equal(_decode(msg["ok"]), expected):
                passed += 1
        except (ValueError, TypeError, IndexError, KeyError, RecursionError):
            pass
    return passed / len(tests)


def _hidden_paths() -> list[str]:
    """Never shown to a candidate, even through sys.path: the project dir and the trainer's cwd
    (where runs, data and checkpoints usually live). An installed package's site-packages is not
    the project's: it stays visible, as do the other third-party packages."""
    project = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    hidden = [os.path.realpath(os.getcwd())]
    if os.path.basename(project) not in ("site-packages", "dist-packages"):
        hidden.append(os.path.realpath(project))
    return hidden


_PROBE_CODE = "def probe():\n    return 1\n"


@functools.cache
def sandbox_isolation() -> dict:
    """The walls a verdict gets on this machine, found once by running an honest probe verdict:
    {"isolate", "user_ns", "mount_ns", "pid_ns", "net_ns", "ipc_ns", "minimal_root", "cgroup"}
    (bools) and "nproc" (the RLIMIT_NPROC a candidate gets with the default max_procs).

    Tried in order, the first with a minimal root wins, else the first that works: a user
    namespace of the verdict's own; (as root) namespaces without one, for kernels that grant no
    capabilities inside user namespaces; no namespaces. A warning names what is missing, rather
    than every completion silently scoring 0 or running unwalled.
    """
    tries = [(True, True)] + ([(True, False)] if os.geteuid() == 0 else []) + [(False, False)]
    working, failures = [], []
    for isolate, user_ns in tries:
        lines, report = _run_once(_PROBE_CODE, ["probe()"], isolate=isolate, user_ns=user_ns, sweep=False,
                                  cgroup_parent=_cgroup_parent(), timeout_s=5.0, memory_mb=512,
                                  output_bytes=1 << 20, max_procs=64)
        if lines == ['{"ok": ["i", "1"]}'] and report is not None and "error" not in report:
            report.pop("peak_mb", None)
            working.append({"isolate": isolate, **report})
            if report["minimal_root"]:
                break
        else:
            failures.append(report)
    if not working:
        raise RuntimeError(f"code sandbox: no probe verdict works on this machine ({failures}); the harness "
                           "cannot run")
    best = next((w for w in working if w["minimal_root"]), working[0])
    if not best["minimal_root"]:
        warnings.warn(f"code sandbox: no minimal root on this machine ({best}, failed: {failures}): candidates "
                      "can read the host's files (see grpo_jax/rewards/code.py)", RuntimeWarning)
    return best


def _run_sandboxed(code: str, calls: list[str], **limits) -> tuple[list[str] | None, dict | None]:
    iso = sandbox_isolation()
    return _run_once(code, calls, isolate=iso["isolate"], user_ns=iso["user_ns"],
                     sweep=os.geteuid() == 0 and not iso["minimal_root"],
                     cgroup_parent=_cgroup_parent() if iso["cgroup"] else None, **limits)


# ---------------------------------------------------------------- cgroup v2, where delegated

_CGROUP_FS = "/sys/fs/cgroup"
_HARNESS_MB = 64  # the harness's own interpreter, inside the verdict's cgroup too
_cgroup_ids = itertools.count()


@functools.cache
def _cgroup_parent() -> str | None:
    """A cgroup v2 dir where this process may make child cgroups with memory and pids limits: its
    own cgroup or that one's parent, with `memory` and `pids` in cgroup.subtree_control and
    writable. None on cgroup v1 or hybrid hosts and where nothing is delegated."""
    try:
        with open("/proc/self/cgroup") as f:
            own = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
        if own is None or not os.path.exists(os.path.join(_CGROUP_FS, "cgroup.controllers")):
            return None
    except OSError:
        return None
    here = os.path.normpath(os.path.join(_CGROUP_FS, own.lstrip("/")))
    for d in (here, os.path.dirname(here)) if here != _CGROUP_FS else (here,):
        try:
            with open(os.path.join(d, "cgroup.subtree_control")) as f:
                enabled = set(f.read().split())
        except OSError:
            continue
        if {"memory", "pids"} <= enabled and os.access(d, os.W_OK):
            return d
    return None


def _new_cgroup(parent: str, memory_mb: int, max_procs: int) -> str | None:
    path = os.path.join(parent, f"grpo-sandbox-{os.getpid()}-{next(_cgroup_ids)}")
    try:
        os.mkdir(path)
        for name, value in (("memory.max", (memory_mb + _HARNESS_MB) << 20), ("memory.swap.max", 0),
                            ("memory.oom.group", 1), ("pids.max", max_procs + 4)):
            if name in ("memory.max", "pids.max") or os.path.exists(os.path.join(path, name)):
                with open(os.path.join(path, name), "w") as f:
                    f.write(str(value))
    except OSError:
        _remove_cgroup(path)
        return None
    return path


def _remove_cgroup(path: str) -> None:
    try:
        with open(os.path.join(path, "cgroup.kill"), "w") as f:  # Linux >= 5.14; the PID namespace
            f.write("1")  # has already killed everything where there is one
    except OSError:
        pass
    for _ in range(20):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY while the last processes exit
            time.sleep(0.01)


# ---------------------------------------------------------------- leftovers, without namespaces

_active_lock = threading.Lock()
_active = 0  # verdicts running now, in this process
_since = 0.0  # when the current run of overlapping verdicts began


def _sweep_nobody_files(since: float) -> None:
    """Removes entries of /tmp, /var/tmp and /dev/shm that `nobody` made since `since` (ctime,
    which a candidate cannot set back). Only called when no verdict runs, so no live candidate
    loses a file; used only without a private mount namespace, and only when the candidate runs
    as `nobody` (as root): a candidate running as the trainer's user leaves what it leaves."""
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
                if st.st_uid != 65534 or st.st_ctime < since:
                    continue
                if e.is_dir(follow_symlinks=False):
                    shutil.rmtree(e.path, ignore_errors=True)
                else:
                    os.unlink(e.path)
            except OSError:
                pass


def _run_once(code: str, calls: list[str], *, isolate: bool, user_ns: bool, sweep: bool,
              cgroup_parent: str | None, timeout_s: float, memory_mb: int, output_bytes: int,
              max_procs: int) -> tuple[list[str] | None, dict | None]:
    """Runs the harness once: (its per-call result lines, its report of the walls it got), each
    None if anything went wrong. `sweep`: remove `nobody`'s leftovers once no verdict runs."""
    global _active, _since
    with _active_lock:
        if _active == 0:
            _since = time.time() - 1.0  # ctime has coarse ticks on some filesystems
        _active += 1
    cgroup = _new_cgroup(cgroup_parent, memory_mb, max_procs) if cgroup_parent else None
    try:
        return _run_harness(code, calls, isolate=isolate, user_ns=user_ns, cgroup=cgroup, timeout_s=timeout_s,
                            memory_mb=memory_mb, output_bytes=output_bytes, max_procs=max_procs)
    finally:
        if cgroup:
            _remove_cgroup(cgroup)
        with _active_lock:
            _active -= 1
            if _active == 0 and sweep:
                _sweep_nobody_files(_since)


def _run_harness(code, calls, *, isolate, user_ns, cgroup, timeout_s, memory_mb, output_bytes, max_procs):
    nonce = secrets.token_hex(16)
    result_r, result_w = os.pipe()
    cfg = {"code": code, "calls": calls, "timeout_s": timeout_s, "memory_mb": memory_mb,
           "output_bytes": output_bytes, "max_procs": max_procs, "result_fd": result_w, "isolate": isolate,
           "user_ns": user_ns, "hide": _hidden_paths(), "cgroup": cgroup}
    deadline = time.monotonic() + timeout_s + _STARTUP_S
    report = raw = None
    with tempfile.TemporaryDirectory(prefix="grpo_code_") as workdir:
        os.chmod(workdir, 0o777)  # writable by `nobody`, the user the harness drops to under root
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", _HARNESS], cwd=workdir, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, pass_fds=(result_w,), start_new_session=True,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir, "TMPDIR": workdir,
                     "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
            )
        except OSError:
            os.close(result_r)
            os.close(result_w)
            return None, None
        os.close(result_w)
        try:
            proc.stdin.write((json.dumps(cfg) + "\n").encode())
            proc.stdin.flush()
            ready = _read_line(proc.stdout.fileno(), deadline)
            if ready is None or not ready.startswith(b"ready "):
                return None, None
            report = json.loads(ready[6:])
            proc.stdin.write((nonce + "\n").encode())  # only now: the candidate is dead
            proc.stdin.close()
            raw = _read_all(result_r, deadline, limit=4 * output_bytes)
        except (OSError, ValueError):
            return None, report
        finally:
            os.close(result_r)
            try:  # a harness that delivered exits by itself, reaping its PID 1: no zombie for init
                proc.wait(timeout=max(0.0, min(0.5, deadline - time.monotonic())) if raw is not None else 0)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            if proc.stdout:
                proc.stdout.close()
    try:
        msg = json.loads(raw)
    except (ValueError, TypeError):
        return None, report
    if not isinstance(msg, dict) or msg.get("nonce") != nonce or not isinstance(msg.get("results"), list):
        return None, report
    return [str(x) for x in msg["results"]], report


def _read_line(fd: int, deadline: float) -> bytes | None:
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 64)
        if not chunk:
            return None
        buf += chunk
    return buf.split(b"\n", 1)[0].strip()


def _read_all(fd: int, deadline: float, *, limit: int) -> bytes | None:
    chunks, size = [], 0
    while size <= limit:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
    return None


def code_reward_fn(prompts: Sequence[str], completions: Sequence[str], *, hidden_tests: Sequence[str],
                   timeout_s: float = 5.0, memory_mb: int = 512, max_concurrent: int | None = None,
                   **_) -> list[float]:
    """RewardFn: `code_reward` per completion, with the example's `hidden_tests` field.

    Up to `max_concurrent` verdicts run at once (default: the cores this process may use), so a
    batch whose completions all loop costs ceil(N / max_concurrent) timeouts, not N. Each verdict
    waits on its own harness process; the threads here only wait.
    """
    if len(hidden_tests) != len(completions):
        raise ValueError(f"code_reward_fn: hidden_tests has {len(hidden_tests)} entries, "
                         f"completions {len(completions)}")
    if max_concurrent is None:
        max_concurrent = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if max_concurrent < 1:
        raise ValueError(f"code_reward_fn: max_concurrent must be >= 1, got {max_concurrent}")
    verdict = functools.partial(code_reward, timeout_s=timeout_s, memory_mb=memory_mb)
    if max_concurrent == 1 or len(completions) <= 1:
        return [verdict(c, t) for c, t in zip(completions, hidden_tests)]
    sandbox_isolation()  # the one-time probe, before the threads
    with futures.ThreadPoolExecutor(min(max_concurrent, len(completions)), thread_name_prefix="code_reward") as ex:
        return list(ex.map(verdict, completions, hidden_tests))
