"""Run one untrusted Python program with limits: `run_python(source, stdin, limits)`.

    grader (pool process) --fork--> [setuid nobody, rlimits, new session]
                                      --exec--> bwrap (new user/pid/net/ipc/uts ns, only
                                                 /usr + the program's directory mounted)
                                                  --> python -I -S prog.py  < stdin file
                                                                            > stdout file

What each layer stops (docs/guides/tasks.md, "Sandbox", says the same for users):
- an unprivileged uid of its own (SANDBOX_UID_BASE + the grader's pid: no real user has
  it, and concurrent sandboxes never share one) with no supplementary groups: it cannot
  read the experiment's key (a 0600 root file) or write anything it does not own;
  RLIMIT_NPROC then counts (Linux ignores it for root), per uid, so a fork bomb stops at
  `max_procs` without starving the other graders;
- rlimits: CPU seconds, address space (memory bomb), file size (the stdout file too, so
  huge output is cut by SIGXFSZ), open files, no core dumps;
- its own session / process group, killed as a whole at the wall-clock limit; bwrap's
  pid namespace dies with its first process, so even a daemonised child goes with it;
- bwrap (when installed): no network (empty net namespace), no view of the rest of the
  file system, no other processes to signal, and its writable directories are 16 MiB
  tmpfs mounts (files cannot fill the disk or the memory). Without bwrap, `unshare` gives
  the network and pid namespaces when user namespaces work; the file system stays visible
  (read what anyone may read, write in /tmp, write files to disk until time is up).

The program's environment is fixed and minimal in every mode (`program_env`): PATH, LANG
and HOME (its own directory); nothing of the grader's environment, which on a cluster holds
tokens (W&B, Hugging Face, cloud credentials), reaches it.

Results come back as plain bytes read from a file the sandbox wrote: nothing from the
program is ever unpickled or evaluated here.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Far above login users (< 60000), systemd's dynamic users (< 65536) and the usual
# subordinate-uid ranges of rootless containers (100000 + 65536 n).
SANDBOX_UID_BASE = 2_000_000_000
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


@dataclasses.dataclass(frozen=True)
class Limits:
    time_s: float = 6.0
    """Wall-clock seconds per run; CPU seconds are capped at the same (rounded up)."""
    memory_mb: int = 1024
    # Worst case a fork-and-allocate bomb holds max_procs x memory_mb: keep the product
    # well under the machine's memory.
    """Address space of each process (RLIMIT_AS)."""
    output_bytes: int = 1 << 20
    """Largest stdout kept; a program writing more is killed (RLIMIT_FSIZE)."""
    disk_mb: int = 16
    """Size of its writable directories (bwrap only: elsewhere just RLIMIT_FSIZE per file)."""
    max_procs: int = 8
    """Processes of one sandbox at most, bwrap's two included (RLIMIT_NPROC)."""


@dataclasses.dataclass(frozen=True)
class Run:
    stdout: bytes
    returncode: int
    timed_out: bool


def program_env(home: str) -> dict[str, str]:
    """The whole environment of a sandboxed program: nothing is inherited."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home}


def sandbox_uid() -> int:
    return SANDBOX_UID_BASE + os.getpid()


def _world_executable(path: str) -> bool:
    """True when any user can reach and run `path` (every parent dir o+x, file o+x)."""
    p = Path(path).resolve()
    if not p.is_file() or not os.stat(p).st_mode & stat.S_IXOTH:
        return False
    return all(os.stat(d).st_mode & stat.S_IXOTH for d in p.parents)


@functools.cache
def interpreter() -> str:
    """A Python the sandbox's uid may run: ours if others can reach it, else the system's."""
    if os.geteuid() != 0 or _world_executable(sys.executable):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if _world_executable(candidate):
            return candidate
    raise RuntimeError(
        f"no Python interpreter runnable by other users: {sys.executable} sits in a directory "
        "others cannot enter; install a system python3 (apt-get install python3)"
    )


@functools.cache
def mode() -> str:
    """'bwrap', 'unshare' or 'plain': the strongest isolation that works on this machine.

    AREAL_SANDBOX=unshare|plain picks a weaker one (to test the fallbacks).
    """
    forced = os.environ.get("AREAL_SANDBOX", "")
    if forced:
        if forced not in ("bwrap", "unshare", "plain"):
            raise ValueError(f"AREAL_SANDBOX={forced!r}: use bwrap, unshare or plain")
        return forced
    for name, argv in (("bwrap", _bwrap_argv), ("unshare", _unshare_argv)):
        if shutil.which(name) is None:
            continue
        with tempfile.TemporaryDirectory() as d:
            os.chmod(d, 0o755)
            try:
                probe = subprocess.run(
                    [*argv(d), interpreter(), "-I", "-S", "-c", "print(6*7)"],
                    preexec_fn=functools.partial(_drop_privileges, sandbox_uid()),
                    capture_output=True,
                    timeout=10,
                )
            except (OSError, subprocess.SubprocessError):
                continue
            if probe.returncode == 0 and probe.stdout.strip() == b"42":
                return name
    return "plain"


def _bwrap_argv(workdir: str, names: tuple[str, ...] = (), disk_mb: int = 16) -> list[str]:
    # Only /usr (and the interpreter's prefix when it lies outside /usr) is visible,
    # read-only. The program's directory is a small tmpfs holding read-only binds of its
    # files: memory-backed and size-capped, so writing files can neither fill the disk nor
    # eat the machine's memory.
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session"]
    argv += ["--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev"]
    for link in ("lib", "lib64", "bin", "sbin"):
        if os.path.islink(f"/{link}"):
            argv += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
        elif os.path.isdir(f"/{link}"):
            argv += ["--ro-bind", f"/{link}", f"/{link}"]
    prefix = sys.base_prefix
    if interpreter() == sys.executable and not prefix.startswith("/usr"):
        argv += ["--ro-bind", prefix, prefix]
    size = str(disk_mb << 20)
    argv += ["--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/sandbox"]
    for name in names:
        argv += ["--ro-bind", f"{workdir}/{name}", f"/sandbox/{name}"]
    argv += ["--chdir", "/sandbox"]
    return argv


def _unshare_argv(workdir: str) -> list[str]:
    del workdir
    return ["unshare", "--user", "--net", "--pid", "--ipc", "--fork", "--kill-child"]


def _drop_privileges(uid: int) -> None:
    """Between fork and exec: drop root for the sandbox's uid and die with the grader."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    # After setuid: a credential change clears the parent-death signal.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _limit(limits: Limits, uid: int, nproc: int) -> None:
    cpu = int(limits.time_s) + 1
    memory = limits.memory_mb << 20
    for res, value in (
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_AS, memory),
        (resource.RLIMIT_FSIZE, limits.output_bytes),
        (resource.RLIMIT_NPROC, nproc),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(res, (value, value))
    _drop_privileges(uid)


def run_python(source: str, stdin: str, limits: Limits, files: dict[str, str] | None = None) -> Run:
    """Run `source` as prog.py with `stdin`; extra `files` are written beside it."""
    workdir = tempfile.mkdtemp(prefix="areal-sandbox-")
    try:
        root = Path(workdir)
        (root / "prog.py").write_text(source)
        for name, text in (files or {}).items():
            (root / name).write_text(text)
        if os.geteuid() == 0:
            os.chown(workdir, sandbox_uid(), sandbox_uid())  # its only writable place
        _become_subreaper()
        m = mode()
        inside = "/sandbox" if m == "bwrap" else workdir
        if m == "bwrap":
            names = ("prog.py", *(files or {}))
            # --clearenv too: bwrap itself must not hand on anything we did not set.
            argv = _bwrap_argv(workdir, names, limits.disk_mb) + ["--clearenv"]
            argv += [a for k, v in program_env(inside).items() for a in ("--setenv", k, v)]
        else:
            argv = _unshare_argv(workdir) if m == "unshare" else []
        argv += [interpreter(), "-I", "-S", "-B", f"{inside}/prog.py"]
        # stdin and stdout are files we opened, outside the sandbox's directory: the
        # program cannot swap them, and RLIMIT_FSIZE caps what it writes to stdout.
        with tempfile.TemporaryFile() as fin, tempfile.TemporaryFile() as fout:
            fin.write(stdin.encode())
            fin.seek(0)
            proc = subprocess.Popen(
                argv,
                stdin=fin,
                stdout=fout,
                stderr=subprocess.DEVNULL,
                cwd=workdir,
                env=program_env(inside),
                start_new_session=True,
                # The uid is computed here: in the child, getpid() is the child's own.
                preexec_fn=functools.partial(_limit, limits, sandbox_uid(), _nproc(limits)),
                close_fds=True,
            )
            timed_out = False
            try:
                proc.wait(timeout=limits.time_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(proc)
            _reap_orphans()
            fout.seek(0)
            out = fout.read(limits.output_bytes + 1)
        return Run(stdout=out, returncode=proc.returncode, timed_out=timed_out)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _nproc(limits: Limits) -> int:
    """RLIMIT_NPROC counts every process of the uid: the sandbox's own when we are root,
    the user's (all of them) otherwise, so a non-root user's limit sits above their count."""
    if os.geteuid() == 0:
        return limits.max_procs
    me = os.geteuid()
    mine = sum(1 for e in os.scandir("/proc") if e.name.isdigit() and _owner(e) == me)
    return mine + limits.max_procs


def _owner(entry: os.DirEntry) -> int:
    try:
        return entry.stat().st_uid
    except OSError:
        return -1


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the program's whole process group, then reap its first process."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@functools.cache
def _become_subreaper() -> None:
    # bwrap's first process in the new pid namespace can outlive bwrap by a moment; as an
    # orphan it would go to the machine's init, which in containers often never reaps it,
    # and every such zombie keeps counting against the sandbox uid's RLIMIT_NPROC. As a
    # subreaper, this process inherits those orphans and reaps them itself.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _reap_orphans(wait_s: float = 1.0) -> None:
    """Reap our children that run as the sandbox's uid (orphans inherited as subreaper)."""
    uid = sandbox_uid()
    deadline = time.monotonic() + wait_s
    while True:
        left = 0
        for pid in _sandbox_children(uid):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            left += done == 0
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.005)


def _sandbox_children(uid: int) -> list[int]:
    """Children of this process owned by `uid`, found in /proc (no other subprocess's)."""
    me, pids = os.getpid(), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:  # fields after "(comm)": state ppid
            pids.append(int(entry.name))
    return pids
