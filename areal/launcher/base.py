"""What every launcher shares: start each step of a plan, watch exit codes, stop them all.

    launcher --start(step)--> role process (a subprocess, or the srun that runs it on a node)
             <-- exit codes (polled every launcher.dead_role_poll_s), metrics.jsonl (tailed)

A launcher differs only in `command` (how a step's command line is run: directly, or
wrapped in srun). The run succeeds when every trainer rank exits 0 (after the last
checkpoint); the other roles are services, stopped then. A dead inference server is
restarted in its place, up to inference.max_restarts times (its rollout worker routes
around it meanwhile and reloads the latest weights into it). Any other death (a trainer
rank, the controller, a rollout worker, a reward service) stops every role and restarts
the whole run from its latest checkpoint, exactly as `resume=true` would, up to
recover.max_restarts times (the console says so; metrics count it in recover/restarts);
after that, or with no way to resume, it stops everything and names the role with the
tail of its log. SIGTERM (scancel, kill) and Ctrl-C stop everything too.
"""

from __future__ import annotations

import abc
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import NoReturn

from areal.config import ExperimentConfig
from areal.controller.failures import NO_PROGRESS_EXIT, REPORT_MARK
from areal.launcher.plan import Plan, Step
from areal.launcher.progress import Progress
from areal.loggers import MetricSink, make_loggers
from areal.process import RESTARTS_ENV, die_with_parent


@dataclass
class Proc:
    step: Step
    popen: subprocess.Popen
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

    @abc.abstractmethod
    def command(self, step: Step, cmd: list[str]) -> tuple[list[str], dict[str, str]]:
        """The command line that runs `cmd` for `step`, and its extra environment."""

    def exit_reason(self, rc: int) -> str:
        return exit_reason(rc)

    def start_failure(self, p: Proc) -> str | None:
        """Why step p could never start (a restart would fail the same way), if so."""
        return None

    def start(self, step: Step, restarts: int = 0) -> Proc:
        log = self.log_dir / f"{step.name}.log"
        cmd, env = self.command(step, worker_command(self.exp_dir, step))
        with open(log, "a" if restarts else "w") as f:  # a restart keeps the earlier log
            popen = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # Its own process group: stopping a step stops its children (grading pools).
                start_new_session=True,
                preexec_fn=die_with_parent,
                env={
                    **os.environ,
                    "PYTHONUNBUFFERED": "1",
                    RESTARTS_ENV: str(self.recoveries),
                    **step.env,
                    **env,
                },  # fmt: skip
            )
        return Proc(step, popen, log, restarts)

    def restart_server(self, i: int, rc: int) -> None:
        p = self.procs[i]
        print(
            f"\nareal: role {p.name} {self.exit_reason(rc)}; restarting it "
            f"({p.restarts + 1}/{self.cfg.inference.max_restarts}). Last lines of {p.log}:\n"
            f"{tail(p.log, self.cfg.launcher.log_tail_lines)}",
            file=sys.stderr,
            flush=True,
        )
        try:  # what the dead server left in its group (vLLM's engine processes) goes too
            os.killpg(p.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.procs[i] = self.start(p.step, p.restarts + 1)

    def stop_all(self, grace_s: float = 10.0) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                try:
                    os.killpg(p.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.time() + grace_s
        for p in self.procs:
            try:
                p.popen.wait(max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            # The group too: a role's own children (grading pools) must not outlive it.
            try:
                os.killpg(p.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.popen.wait()

    def run(self, resume: Callable[[int], None] | None = None) -> int:
        """Start all steps, show progress, stop everything; returns the exit code.
        `resume(n)` readies the experiment directory for the n-th recovery (as resume=true
        does); without it a dead role stops the run."""
        sink = MetricSink(make_loggers(self.cfg))  # TensorBoard, W&B: off the main loop
        progress = Progress(self.exp_dir / "metrics.jsonl", self.cfg.total_train_steps, sink)
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            self.procs = [self.start(step) for step in self.plan.steps]
            while True:
                progress.poll()
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
                    self.procs = [self.start(step) for step in self.plan.steps]
                    continue
                trainers = [p for p in self.procs if p.step.role == "trainer"]
                if all(p.popen.poll() == 0 for p in trainers):
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

    def _dead_role(self) -> tuple[Proc, int] | None:
        """A role whose exit ends this attempt (a server is restarted in place instead)."""
        for i, p in enumerate(self.procs):
            rc = p.popen.poll()
            if rc is None or (rc == 0 and p.step.role == "trainer"):
                continue
            restartable = self.start_failure(p) is None
            if (
                p.step.role == "server"
                and restartable
                and p.restarts < self.cfg.inference.max_restarts
            ):
                self.restart_server(i, rc)
                continue
            return p, rc
        return None

    def _report(self, p: Proc, rc: int, what: str) -> None:
        print(
            f"\nareal: role {p.name} {self.exit_reason(rc)}; {what}. "
            f"Last lines of {p.log}:\n{tail(p.log, self.cfg.launcher.log_tail_lines)}",
            file=sys.stderr,
            flush=True,
        )
