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
Limits: wall clock and CPU time, address space (RLIMIT_AS), output size (RLIMIT_FSIZE), a fresh
temp dir as cwd, `python -I`, no network (`unshare -n` when available, plus a patched socket), an
own PID namespace when available (escaped children die with the harness), and, when the trainer
runs as root, the candidate runs as `nobody`. Not isolated: reading world-readable files, and
writing where the trainer's own (non-root) user may write; use a container for stronger walls.
"""

from __future__ import annotations

import ast
import functools
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
import time
from collections.abc import Sequence

_HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_harness.py")
_FENCE_RE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
MAX_CODE_CHARS = 100_000
_STARTUP_S = 5.0  # interpreter start-up, on top of the candidate's own time limit


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


@functools.cache
def _isolation_prefix() -> tuple[str, ...]:
    """`unshare` flags that work here: no network, own PID namespace (kills escaped children)."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    for flags in (("-n", "-p", "-f", "--kill-child"), ("-n",), ("-r", "-n")):
        try:
            ok = subprocess.run([exe, *flags, "true"], capture_output=True, timeout=5).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return (exe, *flags)
    return ()


def code_reward(completion: str, hidden_tests: str, *, timeout_s: float = 5.0, memory_mb: int = 512,
                output_bytes: int = 1 << 20) -> float:
    """Fraction of hidden tests passed by the completion's code, in [0, 1]; 0.0 on any failure.

    `hidden_tests`: Python source of `assert <call> == <literal>` lines (trusted; see
    `parse_hidden_tests`). Never raises on model text; raises ValueError for malformed hidden tests.
    """
    tests = parse_hidden_tests(hidden_tests)
    code = extract_code(completion)
    if code is None or not code.strip():
        return 0.0
    lines = _run_sandboxed(code, [call for call, _ in tests], timeout_s=timeout_s, memory_mb=memory_mb,
                           output_bytes=output_bytes)
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


def _run_sandboxed(code: str, calls: list[str], *, timeout_s: float, memory_mb: int,
                   output_bytes: int) -> list[str] | None:
    """Runs the harness; returns its per-call result lines, or None if anything went wrong."""
    nonce = secrets.token_hex(16)
    result_r, result_w = os.pipe()
    cfg = {"code": code, "calls": calls, "timeout_s": timeout_s, "memory_mb": memory_mb,
           "output_bytes": output_bytes, "result_fd": result_w}
    deadline = time.monotonic() + timeout_s + _STARTUP_S
    with tempfile.TemporaryDirectory(prefix="grpo_code_") as workdir:
        os.chmod(workdir, 0o777)  # writable by `nobody`, the user the harness drops to under root
        try:
            proc = subprocess.Popen(
                [*_isolation_prefix(), sys.executable, "-I", _HARNESS], cwd=workdir, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, pass_fds=(result_w,), start_new_session=True,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir, "TMPDIR": workdir},
            )
        except OSError:
            os.close(result_r)
            os.close(result_w)
            return None
        os.close(result_w)
        try:
            proc.stdin.write((json.dumps(cfg) + "\n").encode())
            proc.stdin.flush()
            if _read_line(proc.stdout.fileno(), deadline) != b"ready":
                return None
            proc.stdin.write((nonce + "\n").encode())  # only now: the candidate is dead
            proc.stdin.close()
            raw = _read_all(result_r, deadline, limit=4 * output_bytes)
        except (OSError, ValueError):
            return None
        finally:
            os.close(result_r)
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
        return None
    if not isinstance(msg, dict) or msg.get("nonce") != nonce or not isinstance(msg.get("results"), list):
        return None
    return [str(x) for x in msg["results"]]


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
                   **_) -> list[float]:
    """RewardFn: `code_reward` per completion, with the example's `hidden_tests` field."""
    if len(hidden_tests) != len(completions):
        raise ValueError(f"code_reward_fn: hidden_tests has {len(hidden_tests)} entries, "
                         f"completions {len(completions)}")
    return [code_reward(c, t) for c, t in zip(completions, hidden_tests)]
