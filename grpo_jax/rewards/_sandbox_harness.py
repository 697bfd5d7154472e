"""Sandbox harness for `code_reward`; run as `python -I _sandbox_harness.py` in a fresh temp dir.

Standalone on purpose (no grpo_jax imports: `-I` ignores the environment and user site). Protocol:
  stdin line 1: JSON {"code", "calls", "timeout_s", "memory_mb", "output_bytes", "max_procs",
     "result_fd", "isolate", "user_ns", "hide", "cgroup"}
  -> the harness joins the verdict's cgroup (when given), walls itself in (when `isolate`: see
     `_isolate`), then forks a candidate process, which runs the code and evaluates each hidden
     call, streaming one tagged-JSON line per call back to the harness over a private pipe;
  -> the harness waits (wall-clock limit, total memory checked every 25 ms), kills every process
     the candidate made, prints "ready <JSON report of the walls it got>";
  stdin line 2: the nonce, sent by the trainer only now, after the candidate is dead, so no
     candidate code ever shares a process or a moment with it;
  -> the harness writes {"nonce", "results"} to `result_fd`, an fd the candidate closed before
     its code ran. The expected values never enter this process: the trainer compares.
The candidate's exit code, stdout and stderr are ignored (its output goes to a size-capped file).
"""

import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

NOBODY = 65534
_POLL_S = 0.025  # how often the total memory is checked while the candidate runs
_CLONE_NEWNS, _CLONE_NEWIPC, _CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
_CLONE_NEWPID, _CLONE_NEWNET = 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 1, 2, 4, 8, 32
_MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC, _MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
_MS_RELATIME, _MS_STRICTATIME = 1 << 21, 1 << 24
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_SECUREBITS = 1, 4, 24, 28
_PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 36, 38
_SECBITS_LOCKED_NOROOT = 0xEF  # NOROOT, NO_SETUID_FIXUP, NO_CAP_AMBIENT_RAISE and KEEP_CAPS, all locked
# What the minimal root shows the candidate, besides the Python install and its sys.path: the OS.
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_DEVICES = ("null", "zero", "full", "random", "urandom")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


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
    # The real barrier is the harness's own network namespace (no interfaces) when it could make
    # one; this is a second one.
    import socket

    def _refuse(*args, **kwargs):
        raise OSError("network disabled in the sandbox")

    for name in ("socket", "create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
        setattr(socket, name, _refuse)
    sys.modules["_socket"] = None


# ---------------------------------------------------------------- walls (namespaces, minimal root)

def _call(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src, target, fstype, flags, data=None):
    enc = (lambda s: s.encode() if s is not None else None)
    _call(_libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _enter_user_namespace():
    """A user namespace of this verdict's own; True when it is in place with its ids mapped.

    Why: RLIMIT_NPROC counts a uid's processes per user namespace, so the candidate's process cap
    is then this verdict's alone (not shared with other verdicts or other `nobody` processes), and
    the namespace's root may mount and unshare without being root on the host. As root, host uids 0
    and 65534 map to themselves (the candidate still runs as `nobody`); otherwise the caller's uid
    maps to 0. Only a process outside the new namespace may write its maps: a helper child does.
    """
    uid, gid = os.geteuid(), os.getegid()
    r, w = os.pipe()
    helper = os.fork()
    if helper == 0:
        try:
            os.close(w)
            os.read(r, 1)  # the harness has unshared (or failed to)
            proc = f"/proc/{os.getppid()}"
            if uid == 0:
                maps = (f"0 0 1\n{NOBODY} {NOBODY} 1\n", f"0 0 1\n{NOBODY} {NOBODY} 1\n")
            else:
                _write(f"{proc}/setgroups", "deny")  # required before an unprivileged gid_map
                maps = (f"0 {uid} 1\n", f"0 {gid} 1\n")
            _write(f"{proc}/uid_map", maps[0])
            _write(f"{proc}/gid_map", maps[1])
            os._exit(0)
        except BaseException:  # noqa: BLE001
            os._exit(1)
    os.close(r)
    unshared = _libc.unshare(_CLONE_NEWUSER) == 0
    os.write(w, b"x")
    os.close(w)
    _, status = os.waitpid(helper, 0)
    if unshared and status != 0:
        raise OSError("user namespace made but its ids could not be mapped")
    return unshared


def _bind(src, dst, *, read_only=True):
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    _mount(src, dst, None, _MS_BIND | _MS_REC)
    if read_only:
        # A remount must keep the source's locked flags (nosuid, nodev, noexec, atime) or fail.
        kept = os.statvfs(src).f_flag & (_MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_NOATIME | _MS_NODIRATIME)
        kept |= _MS_RELATIME if os.statvfs(src).f_flag & 4096 else 0  # ST_RELATIME
        if not kept & (_MS_NOATIME | _MS_RELATIME):
            kept |= _MS_STRICTATIME
        _mount(None, dst, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | kept)


def _root_plan(hide):
    """[(path, "link" | "bind" | "mask")], parents first: the system dirs, the Python install and
    its sys.path bound read-only; an empty read-only tmpfs over each hidden path that one of them
    would show (a project under /usr/src, an old-style editable install on sys.path)."""
    shown = {p: "link" if os.path.islink(p) else "bind" for p in _SYSTEM_DIRS if os.path.lexists(p)}
    for p in (sys.base_prefix, sys.prefix, *sys.path):
        if os.path.isdir(p):
            shown.setdefault(os.path.realpath(p), "bind")
    plan = sorted({**shown, **{h: "mask" for h in hide}}.items(), key=lambda item: len(item[0]))
    kept = []
    for path, kind in plan:
        above = [k for k in kept if k[1] != "link" and (path == k[0] or path.startswith(k[0].rstrip("/") + "/"))]
        nearest = above[-1][1] if above else None
        if (kind == "mask") == (nearest in (None, "mask")):
            continue  # already visible (a bind below a bind), or nothing to hide (a mask not below one)
        kept.append((path, kind))
    return kept


def _build_root(new, hide, tmpfs_mb):
    """A minimal root at `new`: read-only system dirs and Python, a few devices, a fresh /proc, and
    private /tmp and /dev/shm tmpfs (`tmpfs_mb` each) that vanish with the mount namespace."""
    _mount("tmpfs", new, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=4m,mode=755")
    # The private /tmp and /dev/shm first: a Python install under /tmp (a venv in a CI checkout
    # there) is then bound inside the private /tmp, instead of the tmpfs hiding it or its mount
    # point making /tmp exist already (which stopped the whole root: "File exists").
    for d in ("/tmp", "/dev/shm"):
        os.makedirs(new + d)
        _mount("tmpfs", new + d, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={tmpfs_mb}m,mode=1777")
    for path, kind in _root_plan(hide):
        if kind == "link":
            os.symlink(os.readlink(path), new + path)  # merged /usr: /bin -> usr/bin
        elif kind == "bind":
            _bind(path, new + path)
        else:
            _mount("tmpfs", new + path, "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV, "size=4k,mode=755")
    for name in _DEVICES:
        _bind(f"/dev/{name}", f"{new}/dev/{name}", read_only=False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{new}/dev/{name}")
    os.makedirs(new + "/proc")
    try:
        _mount("proc", new + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    except OSError:  # a container may refuse a fresh proc: show the existing one instead
        _bind("/proc", new + "/proc", read_only=False)
    os.makedirs(new + "/tmp/work")
    os.chmod(new + "/tmp/work", 0o777)  # writable by `nobody`
    _mount(None, new, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV, "size=4m,mode=755")
    os.chroot(new)
    os.chdir("/tmp/work")


def _isolate(cfg, report):
    """Walls the harness (and so the candidate) in, as far as this machine allows; fills `report`.

    1. a user namespace of its own (`_enter_user_namespace`), unless refused or cfg["user_ns"] is
       False (root on a kernel that grants no capabilities inside one: mount and unshare as root);
    2. new mount, PID, network and IPC namespaces (each kept only if the kernel allows it);
    3. a fork: the child is PID 1 of the new PID namespace, and every process the candidate makes
       dies with it; the parent only waits and passes the exit on;
    4. a minimal root (`_build_root`) in the private mount namespace; SysV and POSIX IPC objects
       die with the IPC namespace.
    Returns in the child (PID 1); the parent never returns.
    """
    try:
        report["user_ns"] = cfg.get("user_ns", True) and _enter_user_namespace()
    except OSError:
        report["user_ns"] = False
        report["error"] = "unmapped user namespace"
        return
    if not report["user_ns"] and os.geteuid() != 0:
        return  # without a user namespace, only root may make the others
    got = 0
    for flag in (_CLONE_NEWNS, _CLONE_NEWPID, _CLONE_NEWNET, _CLONE_NEWIPC):
        if _libc.unshare(flag) == 0:
            got |= flag
    report.update(mount_ns=bool(got & _CLONE_NEWNS), pid_ns=bool(got & _CLONE_NEWPID),
                  net_ns=bool(got & _CLONE_NEWNET), ipc_ns=bool(got & _CLONE_NEWIPC))
    if got & _CLONE_NEWPID:
        child = os.fork()
        if child:
            # Keeps no pipe open: the trainer sees EOF as soon as PID 1 is done.
            for fd in (0, 1, cfg["result_fd"]):
                os.close(fd)
            _, status = os.waitpid(child, 0)
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # dies with the parent
    if got & _CLONE_NEWNS:
        new = os.getcwd()  # the trainer's per-verdict temp dir, used as the mount point
        try:
            _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing we mount reaches the host
            _build_root(new, cfg["hide"], cfg["memory_mb"])
            report["minimal_root"] = True
        except OSError as e:
            report["error"] = f"minimal root: {e}"
            _libc.umount2(new.encode(), 2)  # MNT_DETACH: back to the host's view, cwd unchanged
    os.environ.update(HOME=os.getcwd(), TMPDIR=os.getcwd())


# ---------------------------------------------------------------- the candidate's own limits

def _uid_mapped(uid):
    try:
        with open("/proc/self/uid_map") as f:
            return any(int(a) <= uid < int(a) + int(n) for a, _, n in (line.split() for line in f))
    except (OSError, ValueError):
        return False


def _tasks_of_uid(uid):
    """How many tasks (threads included: RLIMIT_NPROC counts them) run as `uid` now."""
    n = 0
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                n += int(fields["Threads"])
        except (OSError, ValueError, KeyError):
            pass
    return n


def _drop_capabilities():
    """No capabilities at all, for good (no exec of a setuid file or of anything as uid 0 brings
    them back). Used when the candidate must stay uid 0 of an unprivileged user namespace."""
    _libc.prctl(_PR_SET_SECUREBITS, _SECBITS_LOCKED_NOROOT, 0, 0, 0)
    for cap in range(64):
        _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last capability: fine
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    _call(_libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    with open("/proc/self/status") as f:
        if any(line.startswith("CapEff:") and int(line.split()[1], 16) for line in f):
            raise OSError("capabilities still effective")


def _run_candidate(cfg, write_fd, nproc, own_user_ns):
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
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    _block_network()
    if os.geteuid() == 0:
        # The interpreter's files may be unreadable to `nobody` (e.g. under /root) when there is no
        # minimal root: import the modules solutions commonly use while still root.
        for name in _PRELOAD:
            try:
                __import__(name)
            except ImportError:
                pass
        if _uid_mapped(NOBODY):
            # Run as `nobody`: the candidate can then write only in its temp dir (and world-writable
            # places), not in the trainer's checkpoints, data or code.
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            if own_user_ns:
                # A uid change makes a process undumpable, and this process's memory map still
                # belongs to the host's user namespace, where the harness has no capabilities:
                # dumpable again, the harness (root of this verdict's namespace) may read its
                # memory use. No other verdict's candidate can reach it from its own namespace.
                _libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
        else:
            _drop_capabilities()  # uid 0 of our own user namespace only: the trainer's user outside
    _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    write, exit_now, dumps = os.write, os._exit, json.dumps  # bound before candidate code runs
    namespace = {"__name__": "candidate", "__builtins__": __builtins__}
    try:
        exec(compile(cfg["code"], "candidate.py", "exec"), namespace)  # noqa: S102 -- the sandbox's job
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


# ---------------------------------------------------------------- watching and killing

def _descendants():
    """Every live process below this one (orphans come back to us: we are PID 1 or a subreaper)."""
    found, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        proc = "/proc/self" if pid == os.getpid() else f"/proc/{pid}"  # /proc may show host PIDs
        try:
            tids = os.listdir(f"{proc}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"{proc}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def _memory_bytes(tmpfs_dirs):
    """PSS of every candidate process plus what its private tmpfs hold; None if unreadable (a
    process that hides its memory counts as over the limit)."""
    total = 0
    for pid in _descendants():
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:")), 0)
        except (FileNotFoundError, ProcessLookupError):
            continue
        except OSError:
            return None
    for d in tmpfs_dirs:
        st = os.statvfs(d)
        total += (st.f_blocks - st.f_bfree) * st.f_frsize
    return total


def _kill_all(pid):
    """SIGKILLs the candidate and everything it made, and reaps them (within 1 s: a fork bomb
    outside a PID namespace keeps forking until its last process is dead)."""
    give_up = time.monotonic() + 1.0
    while time.monotonic() < give_up:
        if os.getpid() == 1:
            targets = [-1]  # in our own PID namespace: every process of it but us
        else:  # its session, then each descendant (escapees from the session come back to us)
            targets = [-pid, *_descendants()]
        for target in targets:
            try:
                os.kill(target, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while True:  # reap; killed processes are zombies until then
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                return
        if not _descendants():
            return
        time.sleep(0.001)


def main():
    cfg = json.loads(sys.stdin.readline())
    report = {"user_ns": False, "mount_ns": False, "pid_ns": False, "net_ns": False, "ipc_ns": False,
              "minimal_root": False, "cgroup": False}
    if cfg.get("cgroup"):
        try:
            _write(os.path.join(cfg["cgroup"], "cgroup.procs"), "0")  # us, and all we fork from now on
            report["cgroup"] = True
        except OSError:
            pass
    # RLIMIT_NPROC counts per uid and user namespace: the count is this verdict's own inside a new
    # user namespace (plus this harness and its parent, when the candidate shares their uid);
    # outside one, it is shared with every process of the uid, so the cap sits above today's count.
    own_count = cfg.get("isolate") and cfg.get("user_ns", True)  # expected: the trainer's probe found out
    baseline = 0 if own_count else _tasks_of_uid(NOBODY if os.geteuid() == 0 else os.geteuid())
    if cfg.get("isolate"):
        _isolate(cfg, report)
    if report["user_ns"]:  # a candidate that stays uid 0 there shares the count with us (and our parent)
        nproc = cfg["max_procs"] + (0 if _uid_mapped(NOBODY) else 1 + report["pid_ns"])
    else:
        nproc = cfg["max_procs"] + baseline
    report["nproc"] = nproc
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    tmpfs_dirs = ("/tmp", "/dev/shm") if report["minimal_root"] else ()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            _run_candidate(cfg, write_fd, nproc, report["user_ns"])
        finally:
            os._exit(0)
    os.close(write_fd)
    deadline = time.monotonic() + cfg["timeout_s"]
    limit_bytes = cfg["memory_mb"] * 1024 * 1024
    chunks, size, limit, peak = [], 0, cfg["output_bytes"], 0
    while size <= limit:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        if select.select([read_fd], [], [], min(left, _POLL_S))[0]:
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        used = _memory_bytes(tmpfs_dirs)
        peak = max(peak, used or 0)
        if used is None or used > limit_bytes:
            report["memory_exceeded"] = True
            chunks = []  # a verdict that broke the limit passes nothing, like a MemoryError would
            break
    _kill_all(pid)
    report["peak_mb"] = round(peak / 2**20, 1)
    lines = b"".join(chunks)[:limit].decode("utf-8", "replace").splitlines()
    sys.stdout.write("ready " + json.dumps(report) + "\n")
    sys.stdout.flush()
    nonce = sys.stdin.readline().strip()
    payload = json.dumps({"nonce": nonce, "results": lines}).encode()
    while payload:
        payload = payload[os.write(cfg["result_fd"], payload):]
    os.close(cfg["result_fd"])


if __name__ == "__main__":
    main()
