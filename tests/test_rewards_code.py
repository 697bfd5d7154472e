"""The code sandbox: honest code passes the hidden tests; limits and hacks fail them."""

import glob
import json
import os
import tempfile
import threading
import time
import uuid

import pytest

from grpo_jax.rewards import code
from grpo_jax.rewards.code import (
    code_reward,
    code_reward_fn,
    extract_code,
    parse_hidden_tests,
    sandbox_isolation,
    values_equal,
)

HIDDEN = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 20) == 30\nassert add(0, 7) == 7\n"


def test_parse_hidden_tests():
    assert parse_hidden_tests("assert f(1) == [1, 2]\nassert g('a') == {'a': (1,)}") == [
        ("f(1)", [1, 2]), ("g('a')", {"a": (1,)})]
    with pytest.raises(ValueError, match="line 2"):
        parse_hidden_tests("assert f(1) == 1\nprint('x')")
    with pytest.raises(ValueError, match="literal"):
        parse_hidden_tests("assert f(1) == g(2)")


def test_extract_code():
    assert extract_code("text\n```python\nx = 1\n```\nmore\n```python\ny = 2\n```") == "y = 2\n"  # last block
    assert extract_code("def f(): pass") == "def f(): pass"
    assert extract_code("```\nunclosed") is None


def test_values_equal_is_strict():
    assert values_equal(1.0, 1) and values_equal([1, (2, 3)], [1, (2, 3)])
    assert not values_equal(True, 1)           # a bool is not an int
    assert not values_equal([1, 2], (1, 2))    # a list is not a tuple
    assert values_equal(0.1 + 0.2, 0.3)         # floats to 1e-9 relative


def test_partial_credit_is_the_fraction_passed():
    # Correct only for non-negative inputs: 3 of the 4 hidden tests pass.
    code = "def add(a, b):\n    return a + b if a >= 0 else 5\n"
    assert code_reward(code, HIDDEN, timeout_s=3.0) == 0.75


def test_time_limit():
    code = "def add(a, b):\n    while True:\n        pass\n"
    assert code_reward(code, HIDDEN, timeout_s=1.0) == 0.0


def test_memory_limit():
    code = "def add(a, b):\n    x = bytearray(4 * 1024**3)\n    return a + b\n"
    assert code_reward(code, HIDDEN, timeout_s=3.0, memory_mb=256) == 0.0


def test_output_limit():
    code = "import sys\nsys.stdout.write('x' * (50 * 1024 * 1024))\ndef add(a, b):\n    return a + b\n"
    assert code_reward(code, HIDDEN, timeout_s=3.0, output_bytes=1 << 16) == 0.0


def test_no_network():
    code = ("import socket\ndef add(a, b):\n    socket.create_connection(('127.0.0.1', 22), timeout=0.5)\n"
            "    return a + b\n")
    assert code_reward(code, HIDDEN, timeout_s=3.0) == 0.0


def test_forged_result_lines_fail():
    # Writing extra result lines into every inherited fd does not produce a pass.
    code = ("import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'{\"ok\": [\"i\", \"5\"]}\\n')\n"
            "    except OSError:\n        pass\ndef add(a, b):\n    return 0\n")
    assert code_reward(code, HIDDEN, timeout_s=3.0) == 0.0


def test_code_reward_fn():
    assert code_reward_fn(["p"], ["def add(a, b):\n    return a + b\n"], hidden_tests=[HIDDEN]) == [1.0]


# ---------------------------------------------------------------- the sandbox as a whole
# Each hostile case below was first run against the sandbox before these walls (per-process
# RLIMIT_AS only, verdicts one after another); the comment says what it did then.

ISO = sandbox_isolation()  # what this machine gives, found once by a probe verdict
ADD = "assert add(2, 3) == 5"
needs_minimal_root = pytest.mark.skipif(
    not ISO["minimal_root"], reason=f"no minimal root here (no user or mount namespace): {ISO}")


def _descendants() -> list[str]:
    """Pids of every process below this one."""
    children = {}
    for p in os.listdir("/proc"):
        try:
            with open(f"/proc/{p}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(p)
        except (OSError, ValueError):
            pass
    found, todo = [], [str(os.getpid())]
    while todo:
        for c in children.get(int(todo.pop()), []):
            todo.append(c)
            found.append(c)
    return found


def _descendants_pss_mb(exclude: frozenset = frozenset()) -> float:
    """PSS of every process below this one but `exclude`, in MiB: the sandbox's memory seen from outside."""
    total = 0
    for c in _descendants():
        if c in exclude:
            continue
        try:
            with open(f"/proc/{c}/smaps_rollup") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("Pss:")), 0)
        except OSError:
            pass
    return total / 1024


def _peak_pss_mb(fn):
    """(fn(), the peak of `_descendants_pss_mb` while it ran, sampled every 10 ms), counting only
    processes started during fn: not a worker an earlier test of this pytest process left running
    (a CI run once counted 4.9 GB of those)."""
    before = frozenset(_descendants())
    peak, done = [0.0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _descendants_pss_mb(before))
            time.sleep(0.01)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        return fn(), peak[0]
    finally:
        done.set()
        t.join()


def test_isolation_report_names_each_wall():
    assert {"user_ns", "mount_ns", "pid_ns", "net_ns", "ipc_ns", "minimal_root", "cgroup", "nproc"} <= ISO.keys()
    print("sandbox walls on this machine:", ISO)


FORKS = ("import os, time\ndef forks(n):\n    k = 0\n    try:\n        for _ in range(n):\n"
         "            if os.fork() == 0:\n                time.sleep(30)\n                os._exit(0)\n"
         "            k += 1\n    except OSError:\n        pass\n    return k\n")


def test_process_count_is_capped():
    # The candidate forks sleeping children until refused. Before: all 100 forks succeeded. Now,
    # max_procs=16 counts the candidate itself, so at most 15 children when the count is the
    # verdict's own (its own user namespace); otherwise the cap sits 16 above what its uid already
    # runs. Fewer than 15 is allowed: tasks count threads and the namespace set-up's own processes,
    # which vary between machines (this machine sees exactly 15; CI once saw another count). At
    # least one fork must succeed, or the test would pass for a sandbox that refuses every fork.
    lines, report = code._run_sandboxed(FORKS, ["forks(100)"], timeout_s=3.0, memory_mb=256,
                                        output_bytes=1 << 20, max_procs=16)
    assert lines is not None and len(lines) == 1, report
    result = json.loads(lines[0])
    assert "ok" in result, (result, report)
    children = int(result["ok"][1])
    assert 1 <= children <= (15 if ISO["user_ns"] else 99), (children, report)


def test_fork_bomb_ends_with_its_verdict():
    # Every process forks forever. Capped at 16 tasks, it scores 0 and is gone at the timeout.
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    start = time.monotonic()
    assert code_reward(bomb + "def add(a, b):\n    return a + b\n", ADD, timeout_s=1.0, max_procs=16) == 0.0
    assert time.monotonic() - start < 1.0 + 1.5


# Six children, each filling 96 MiB (4 MiB every 10 ms) and holding it for 0.5 s: each fits the
# per-process limit (RLIMIT_AS), six at once hold 576 MiB.
SIX_FORKS = ("import os, time\ndef add(a, b):\n    for _ in range(6):\n        if os.fork() == 0:\n"
             "            x = [b'x' * (4 << 20) for _ in range(24) if not time.sleep(0.01)]\n"
             "            time.sleep(0.5)\n            os._exit(0)\n    for _ in range(6):\n        os.wait()\n"
             "    return a + b\n")


def test_total_memory_of_all_forks_is_capped():
    # Before: 1.0, with 595 MiB in use under memory_mb=192. Now the harness sums the PSS of the
    # candidate's processes every 25 ms and kills the verdict past 192 MiB (measured peak: 226 MiB).
    # Allowance: the harness (~10 MiB) plus what six children add (4 MiB per 10 ms each) while the
    # harness is between two reads or waits for a busy CPU, up to 60 ms: 6 x 4 x 6 MiB.
    reward, peak_mb = _peak_pss_mb(lambda: code_reward(SIX_FORKS, ADD, timeout_s=8.0, memory_mb=192))
    assert reward == 0.0
    assert peak_mb < 192 + 10 + 6 * 4 * 6, peak_mb


def test_six_forks_pass_when_their_total_fits():
    # The control for the case above: the same code, with room for all six, scores 1.0.
    assert code_reward(SIX_FORKS, ADD, timeout_s=8.0, memory_mb=1024) == 1.0


# 20 MiB in /dev/shm, a file in /tmp and one in $TMPDIR (`tempfile` is not importable as `nobody`
# without a minimal root: the interpreter lives under /root here).
LEAVE_FILES = ("import os\ndef leave(name):\n    with open('/dev/shm/' + name, 'wb') as f:\n"
               "        f.write(b'x' * (20 << 20))\n    open('/tmp/' + name, 'w').write('x')\n"
               "    open(os.path.join(os.environ['TMPDIR'], name), 'w').write('x')\n    return True\n")


def _leftovers(name):
    return [p for d in {"/dev/shm", "/tmp", tempfile.gettempdir()} for p in glob.glob(f"{d}/{name}*")]


@pytest.mark.skipif(not ISO["minimal_root"] and os.geteuid() != 0,
                    reason="without a private mount namespace, a non-root candidate's files cannot be told "
                           "from the trainer's: nothing is cleaned up (see code.py)")
def test_shm_and_temp_files_are_gone_after_the_verdict():
    # Before: the 20 MiB in /dev/shm and the /tmp files stayed after the verdict (200 MiB: 0.14 s).
    name = f"grpo_leftover_{uuid.uuid4().hex}"
    try:
        assert code_reward(LEAVE_FILES, f"assert leave({name!r}) == True", timeout_s=3.0,
                           output_bytes=1 << 26) == 1.0  # it wrote them
        assert _leftovers(name) == []
    finally:
        for p in _leftovers(name):
            os.remove(p)


@pytest.mark.skipif(os.geteuid() != 0, reason="the sweep of `nobody`'s files runs only as root")
def test_without_namespaces_nobodys_leftovers_are_swept():
    # The fallback for machines without mount namespaces: the candidate writes into the host's
    # /dev/shm and /tmp as `nobody`; once no verdict runs, what `nobody` made meanwhile is removed.
    name = f"grpo_leftover_{uuid.uuid4().hex}"
    try:
        lines, _ = code._run_once(code.extract_code(LEAVE_FILES), [f"leave({name!r})"], isolate=False,
                                  user_ns=False, sweep=True, cgroup_parent=None, timeout_s=3.0, memory_mb=512,
                                  output_bytes=1 << 26, max_procs=16)
        assert lines == ['{"ok": ["b", true]}']
        assert _leftovers(name) == []
    finally:
        for p in _leftovers(name):
            os.remove(p)


@needs_minimal_root
def test_the_candidate_cannot_read_the_project_or_the_trainers_cwd():
    # Before: both scored 1.0 (the project is world-readable; `nobody` read it).
    this_file = os.path.abspath(__file__)
    with open(this_file) as f:
        head = f.read(6)
    peek = f"def peek():\n    return open({this_file!r}).read(6)\n"
    assert code_reward(peek, f"assert peek() == {head!r}", timeout_s=3.0) == 0.0
    listing = f"import os\ndef ls():\n    return sorted(os.listdir({os.getcwd()!r}))\n"
    assert code_reward(listing, f"assert ls() == {sorted(os.listdir())!r}", timeout_s=3.0) == 0.0
    # What it does see: the Python install and its packages (read-only), its own /tmp.
    uses = "import json, xml.dom, tempfile\ndef ok():\n    return tempfile.mkstemp()[0] > 0\n"
    assert code_reward(uses, "assert ok() == True", timeout_s=3.0) == 1.0


def test_a_batch_of_looping_completions_costs_about_one_timeout():
    # Before: 4 loopers at timeout 1 s took 4.95 s (one after another). Now they run at once.
    n, timeout = 4, 1.0
    loop, honest = "def add(a, b):\n    while True:\n        pass\n", "def add(a, b):\n    return a + b\n"
    start = time.monotonic()
    rewards = code_reward_fn([""] * (n + 1), [loop] * n + [honest], hidden_tests=[ADD] * (n + 1), timeout_s=timeout,
                             max_concurrent=n + 1)
    elapsed = time.monotonic() - start
    print(f"{n} loopers and 1 honest completion, timeout {timeout} s: {elapsed:.2f} s")
    assert rewards == [0.0] * n + [1.0]
    assert elapsed < 2 * timeout + 1.0, elapsed


def test_a_looping_verdict_ends_within_6_s():
    # The default timeout (5 s) plus the harness's start and walls.
    start = time.monotonic()
    assert code_reward("def add(a, b):\n    while True:\n        pass\n", ADD) == 0.0
    assert time.monotonic() - start < 6.0


@pytest.fixture
def fake_cgroup_v2(tmp_path, monkeypatch):
    """A cgroup v2 tree on plain files, delegated at this process's own cgroup path."""
    with open("/proc/self/cgroup") as f:
        own = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
    if own is None:
        pytest.skip("no cgroup v2 line in /proc/self/cgroup")
    here = tmp_path / own.lstrip("/")
    here.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cgroup.controllers").write_text("memory pids\n")
    (here / "cgroup.subtree_control").write_text("memory pids\n")
    monkeypatch.setattr(code, "_CGROUP_FS", str(tmp_path))
    code._cgroup_parent.cache_clear()
    yield str(here)
    code._cgroup_parent.cache_clear()


def _read(*path):
    with open(os.path.join(*path)) as f:
        return f.read()


def test_a_delegated_cgroup_v2_gets_the_verdicts_limits(fake_cgroup_v2):
    # No kernel behind these files (this machine has cgroup v1 memory): the worked example shows
    # what a verdict asks of a delegated cgroup v2, and that the harness joins it before it forks.
    assert code._cgroup_parent() == fake_cgroup_v2
    cg = code._new_cgroup(fake_cgroup_v2, memory_mb=256, max_procs=16)
    assert _read(cg, "memory.max") == str((256 + 64) << 20)  # + the harness
    assert _read(cg, "pids.max") == "20"  # + the harness and its helpers
    lines, report = code._run_harness("def add(a, b):\n    return a + b\n", ["add(2, 3)"], isolate=False,
                                      user_ns=False, cgroup=cg, timeout_s=3.0, memory_mb=256,
                                      output_bytes=1 << 20, max_procs=16)
    assert lines == ['{"ok": ["i", "5"]}'] and report["cgroup"]
    assert _read(cg, "cgroup.procs") == "0"  # "move the writer", i.e. the harness


@pytest.mark.skipif(not ISO["minimal_root"], reason="this machine gives no minimal root at all")
def test_a_python_installed_under_tmp_still_gets_the_minimal_root(tmp_path):
    # A CI checkout under /tmp puts its venv there. Before: binding that venv into the root made
    # the root's /tmp exist before the private /tmp tmpfs was mounted ("File exists"), and the
    # sandbox fell back to one where candidates read the host's files.
    import json
    import subprocess
    import sys
    import sysconfig
    import venv

    assert str(tmp_path).startswith(tempfile.gettempdir())
    venv.EnvBuilder(with_pip=False).create(tmp_path / "venv")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, sysconfig.get_paths()["purelib"]]))
    probe = "import json; from grpo_jax.rewards.code import sandbox_isolation; print(json.dumps(sandbox_isolation()))"
    proc = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-c", probe], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["minimal_root"] and got["isolate"], got
    assert sys.prefix != str(tmp_path / "venv")
