"""What every launcher shares: start each step of a plan, watch exit codes, stop them all.

    launcher --start(step)--> role process (a subprocess, the srun that runs it on a node, or
                              the Ray actor that runs it on its node)
             <-- exit codes (polled every launcher.dead_role_poll_s), metrics.jsonl (tailed)

A launcher differs only in `command` (how a step's command line is run: directly, or
wrapped in srun) and, for Ray, in `spawn` (what starts it) and `begin_attempt` (placing the
plan before each attempt). The run succeeds when every trainer rank exits 0 (after the last
checkpoint); the other roles are services, stopped then. A dead inference server is
restarted in its place, up to inference.max_restarts times (its rollout worker routes
around it meanwhile and reloads the latest weights into it). Any other death (a trainer
rank, the controller, a rollout worker, a reward service) stops every role and restarts
the whole run from its latest checkpoint, exactly as `resume=true` would, up to
recover.max_restarts times (the console says so; metrics count it in recover/restarts);
after that, or with no way to resume, it stops everything and names the role with the
tail of its log. A role that raised (rather than being killed or losing its node) before
the run's first step, or raised the same error at the same step as before the last restart,
is a bug, not a fault: the run stops at once instead of spending its restarts on it.
SIGTERM (scancel, kill) and Ctrl-C stop everything too.
"""

from __future__ import annotations

import abc
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import NoReturn, Protocol

from areal.comm.registry import Registry
from areal.config import ExperimentConfig
from areal.controller.failures import NO_PROGRESS_EXIT, REPORT_MARK
from areal.cores import ledger_path
from areal.launcher.plan import Plan, Step
from areal.launcher.progress import Progress, StartWaits
from areal.loggers import MetricSink, make_loggers
from areal.process import RESTARTS_ENV, die_with_parent


class RoleProcess(Protocol):
    """What a launcher started for one step: the role's process and its children."""

    lost: str | None
    """Why the step ended without an exit code of its own (its node was lost), if it did."""

    def poll(self) -> int | None:
        """The exit code, or None while the role runs."""

    def signal(self, sig: int) -> None:
        """Send `sig` to the role and its children (a no-op once they are gone)."""

    def wait(self, timeout: float | None) -> bool:
        """Wait up to `timeout` seconds (None: until it ends); True when it has ended."""


class PopenRole:
    """A step run as a child of the launcher, in its own process group."""

    lost = None

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float | None) -> bool:
        try:
            self.popen.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False


@dataclass
class Proc:
    step: Step
    handle: RoleProcess
    log: Path
    restarts: int = 0

    @property
    def name(self) -> str:
        return self.step.name


def tail(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"(no log: {e})"


_ERROR = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Exit)\b.*$")
_VOLATILE = re.compile(r"0x[0-9a-f]+|\d{4,}")


def error_line(log: Path) -> str | None:
    """The last `SomeError: message` line of a role's log, its addresses, ports and ids
    masked (they differ between attempts of one bug); None without one."""
    for line in reversed(tail(log, 200).splitlines()):
        if _ERROR.match(line.strip()):
            return _VOLATILE.sub("#", line.strip())
    return None


def exit_reason(rc: int) -> str:
    if rc < 0:
        return f"was killed by {signal.Signals(-rc).name}"
    return f"exited with code {rc}"


def no_progress_report(log: Path) -> str:
    """The controller's report of a run that cannot make progress: its log from the mark."""
    text = log.read_text(errors="replace")
    start = text.rfind(REPORT_MARK)
    return text[start:].rstrip() if start >= 0 else tail(log, 60)


def worker_command(exp_dir: Path, step: Step) -> list[str]:
    return [
        sys.executable,
        "-m",
        "areal.worker",
        "--role",
        step.role,
        "--index",
        str(step.index),
        "--exp-dir",
        str(exp_dir),
    ]


class _Terminated(Exception):
    """SIGTERM arrived (scancel, kill): stop every role like Ctrl-C does."""


def _raise_terminated(signum: int, frame: FrameType | None) -> NoReturn:
    raise _Terminated


class Launcher(abc.ABC):
    def __init__(self, cfg: ExperimentConfig, plan: Plan):
        self.cfg = cfg
        self.plan = plan
        self.exp_dir = cfg.exp_dir
        self.log_dir = self.exp_dir / "logs"
        self.procs: list[Proc] = []
        self.recoveries = 0
        """Times the whole run was restarted from its latest checkpoint."""
        self.last_failure: tuple[str, str | None, int] | None = None
        """(role, error line, step) of the exit that caused the last restart."""

    @abc.abstractmethod
    def command(self, step: Step, cmd: list[str]) -> tuple[list[str], dict[str, str]]:
        """The command line that runs `cmd` for `step`, and its extra environment."""

    def exit_reason(self, p: Proc, rc: int) -> str:
        return f"was lost: {p.handle.lost}" if p.handle.lost else exit_reason(rc)

    def begin_attempt(self) -> None:  # noqa: B027 (a hook: most launchers place nothing)
        """Before the steps of each attempt (the first and each recovery) start."""

    def start_failure(self, p: Proc) -> str | None:
        """Why step p could never start (a restart would fail the same way), if so."""
        return None

    def start(self, step: Step, restarts: int = 0) -> Proc:
        log = self.log_dir / f"{step.name}.log"
        cmd, env = self.command(step, worker_command(self.exp_dir, step))
        env = {"PYTHONUNBUFFERED": "1", RESTARTS_ENV: str(self.recoveries), **step.env, **env}
        # A restart keeps the earlier log.
        return Proc(step, self.spawn(step, cmd, env, log, append=bool(restarts)), log, restarts)

    def spawn(
        self, step: Step, cmd: list[str], env: dict[str, str], log: Path, append: bool
    ) -> RoleProcess:
        """Start `cmd` (with the launcher's environment plus `env`) writing to `log`."""
        with open(log, "a" if append else "w") as f:
            popen = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # Its own process group: stopping a step stops its children (grading pools).
                start_new_session=True,
                preexec_fn=die_with_parent,
                env={**os.environ, **env},
            )
        return PopenRole(popen)

    def restart_server(self, i: int, rc: int) -> None:
        p = self.procs[i]
        print(
            f"\nareal: role {p.name} {self.exit_reason(p, rc)}; restarting it "
            f"({p.restarts + 1}/{self.cfg.inference.max_restarts}). Last lines of {p.log}:\n"
            f"{tail(p.log, self.cfg.launcher.log_tail_lines)}",
            file=sys.stderr,
            flush=True,
        )
        # What the dead server left in its group (vLLM's engine processes) goes too.
        p.handle.signal(signal.SIGKILL)
        self.procs[i] = self.start(p.step, p.restarts + 1)

    def stop_all(self, grace_s: float = 10.0) -> None:
        for p in self.procs:
            if p.handle.poll() is None:
                p.handle.signal(signal.SIGTERM)
        deadline = time.time() + grace_s
        for p in self.procs:
            p.handle.wait(max(0.0, deadline - time.time()))
        for p in self.procs:
            # The group too: a role's own children (grading pools) must not outlive it.
            p.handle.signal(signal.SIGKILL)
            p.handle.wait(None)
        # The core ledger's name: the first role to leave removes it, but not a killed one.
        with contextlib.suppress(OSError):
            os.unlink(ledger_path(self.exp_dir))

    def run(self, resume: Callable[[int], None] | None = None) -> int:
        """Start all steps, show progress, stop everything; returns the exit code.
        `resume(n)` readies the experiment directory for the n-th recovery (as resume=true
        does); without it a dead role stops the run."""
        sink = MetricSink(make_loggers(self.cfg))  # TensorBoard, W&B: off the main loop
        progress = Progress(self.exp_dir / "metrics.jsonl", self.cfg.total_train_steps, sink)
        waits = self.start_waits(progress)
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
        # SIGINT (Ctrl-C) stops the run even when this process started with it ignored, as a
        # background job of a non-interactive shell does: Python then installs no handler.
        previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            self.begin_attempt()
            self.procs = [self.start(step) for step in self.plan.steps]
            waits.begin()
            mark = progress.read
            while True:
                progress.poll()
                waits.poll(progress.read > mark)
                dead = self._dead_role()
                if dead is not None:
                    p, rc = dead
                    if rc == NO_PROGRESS_EXIT and p.step.role == "controller":
                        # Episodes only fail: a restart from the checkpoint would fail the same way.
                        progress.close()
                        print("\n" + no_progress_report(p.log), file=sys.stderr, flush=True)
                        return 1
                    if (why := self.start_failure(p)) is not None:
                        progress.close()
                        print(f"\nareal: {why}; stopping the run", file=sys.stderr, flush=True)
                        return 1
                    if (why := self.same_failure(p, rc, progress)) is not None:
                        progress.close()
                        self._report(p, rc, f"{why}: a restart would fail the same way, so "
                                     "stopping the run")  # fmt: skip
                        return 1
                    if resume is None or self.recoveries >= self.cfg.recover.max_restarts:
                        progress.close()
                        self._report(p, rc, "stopping the run")
                        return 1
                    self.recoveries += 1
                    self._report(
                        p, rc, "restarting the run from its latest checkpoint "
                        f"({self.recoveries}/{self.cfg.recover.max_restarts})",
                    )  # fmt: skip
                    self.stop_all()
                    resume(self.recoveries)
                    progress.rewind()
                    self.begin_attempt()
                    self.procs = [self.start(step) for step in self.plan.steps]
                    waits.begin()
                    mark = progress.read
                    continue
                trainers = [p for p in self.procs if p.step.role == "trainer"]
                if all(p.handle.poll() == 0 for p in trainers):
                    progress.poll()
                    progress.close()
                    print(f"areal: run finished; metrics in {self.exp_dir / 'metrics.jsonl'}")
                    return 0
                time.sleep(self.cfg.launcher.dead_role_poll_s)
        except KeyboardInterrupt:
            progress.close()
            print("\nareal: interrupted; stopping all roles", file=sys.stderr, flush=True)
            return 130
        except _Terminated:
            progress.close()
            print("\nareal: terminated; stopping all roles", file=sys.stderr, flush=True)
            return 143
        finally:
            self.stop_all()
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)

    def start_waits(self, progress: Progress) -> StartWaits:
        """What the console names while the run starts (launcher/progress.py)."""
        registry = Registry(self.exp_dir)
        c = self.cfg
        return StartWaits(
            lambda role, k: registry.path(role, k).exists(),
            [
                (s.role, s.index)
                for s in self.plan.steps
                if s.role in ("rollout", "reward", "controller")
            ],
            f"the first batch ({c.trainer.batch_size} prompts x {c.rollout.group_size} samples "
            "generated and graded), then the trainer's first step",
            progress.write,
        )

    def same_failure(self, p: Proc, rc: int, progress: Progress) -> str | None:
        """Why role p's exit looks like a bug, not a fault, if it does: it raised (a signal
        or a lost node is a fault) before the run's first step, or raised the error it
        raised before the last restart, at the same step."""
        if rc <= 0 or p.handle.lost:
            self.last_failure = None
            return None
        progress.poll()  # the lines written just before the exit count
        error = error_line(p.log)
        step = progress.times[-1][0] if progress.times else 0
        if step == 0 and self.recoveries == 0:
            return "it failed before the run's first step completed"
        failure = (p.name, error, step)
        if error is not None and failure == self.last_failure:
            return f"it failed with the same error at step {step} as before the last restart"
        self.last_failure = failure
        return None

    def _dead_role(self) -> tuple[Proc, int] | None:
        """A role whose exit ends this attempt (a server is restarted in place instead)."""
        for i, p in enumerate(self.procs):
            rc = p.handle.poll()
            if rc is None or (rc == 0 and p.step.role == "trainer"):
                continue
            restartable = self.start_failure(p) is None
            if (
                p.step.role == "server"
                and restartable
                and p.handle.lost is None  # a server whose node is gone cannot restart there
                and p.restarts < self.cfg.inference.max_restarts
            ):
                self.restart_server(i, rc)
                continue
            return p, rc
        return None

    def _report(self, p: Proc, rc: int, what: str) -> None:
        print(
            f"\nareal: role {p.name} {self.exit_reason(p, rc)}; {what}. "
            f"Last lines of {p.log}:\n{tail(p.log, self.cfg.launcher.log_tail_lines)}",
            file=sys.stderr,
            flush=True,
        )
