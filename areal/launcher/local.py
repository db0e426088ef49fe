"""The local launcher: every role as a subprocess of this one, on this machine.

    launcher --Popen--> inference server k (embedded, or SGLang)   logs/server{k}.log
             --Popen--> reward0, rollout{k}, controller0            logs/{role}{k}.log
             --Popen--> trainer{r}, r < trainer.parallel.dp         (RANK, WORLD_SIZE, ...)
             <-- exit codes (polled) , metrics.jsonl (tailed for the console)

Each child runs in its own process group (so its own children, such as grading pools,
are stopped with it) and gets SIGKILL if the launcher itself dies (PR_SET_PDEATHSIG), so a
run never leaves orphans. The run succeeds when every trainer rank exits 0 (after the last
checkpoint); the other roles are services, stopped then. Any other exit of any role stops
everything and names the role with the tail of its log.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from areal.checkpoint import latest
from areal.comm.registry import Registry
from areal.process import die_with_parent

_TRAINER = "trainer"  # the run is over when every trainer rank exits 0; the rest are services


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"(no log: {e})"


def is_trainer(name: str) -> bool:
    return name.removeprefix(_TRAINER).isdigit()


def trainer_world_env(dp: int) -> dict[str, str]:
    """torch.distributed's rendezvous variables for dp trainer ranks on this machine."""
    return {
        "WORLD_SIZE": str(dp),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        # gloo picks the interface of the hostname, which need not reach 127.0.0.1.
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    }


def exit_reason(rc: int) -> str:
    if rc < 0:
        return f"was killed by {signal.Signals(-rc).name}"
    return f"exited with code {rc}"


class LocalLauncher:
    def __init__(self, cfg):
        self.cfg = cfg
        self.exp_dir = cfg.exp_dir
        self.log_dir = self.exp_dir / "logs"
        self.procs: list[Proc] = []

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        log = self.log_dir / f"{name}.log"
        with open(log, "w") as f:
            popen = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )
        self.procs.append(Proc(name, popen, log))

    def start_all(self) -> None:
        cfg = self.cfg
        registry = Registry(self.exp_dir)
        for k in range(cfg.rollout.n_servers):
            port = free_port()
            self.start(f"server{k}", self.server_command(k, port))
            registry.register("server", k, f"http://127.0.0.1:{port}")
        role = [sys.executable, "-m", "areal.worker", "--exp-dir", str(self.exp_dir), "--role"]
        self.start("reward0", [*role, "reward"])
        for k in range(cfg.rollout.n_servers):
            self.start(f"rollout{k}", [*role, "rollout", "--index", str(k)])
        self.start("controller0", [*role, "controller"])
        dp = cfg.trainer.parallel.dp
        world = trainer_world_env(dp) if dp > 1 else {}
        for r in range(dp):
            rank = {"RANK": str(r), "LOCAL_RANK": str(r)} if dp > 1 else {}
            self.start(f"trainer{r}", [*role, "trainer", "--index", str(r)], {**world, **rank})

    def server_command(self, k: int, port: int) -> list[str]:
        cfg = self.cfg
        if cfg.inference.backend != "embedded":
            raise ValueError(
                f"inference.backend={cfg.inference.backend!r} is not available yet; use embedded"
            )
        # A resumed run's servers start from the checkpoint's weights and version.
        ckpt = latest(self.exp_dir) if cfg.resume else None
        model, version = (str(ckpt.model_dir), ckpt.version) if ckpt else (cfg.model.path, 0)
        args = {
            "--model": model,
            "--port": port,
            "--max-batch-size": cfg.inference.max_batch_size,
            "--num-threads": cfg.inference.num_threads,
            "--seed": cfg.seed + k,
            "--weight-version": version,
        }
        python = cfg.inference.python or sys.executable
        return [python, "-m", "areal.rollout.server", *(str(x) for kv in args.items() for x in kv)]

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

    def run(self) -> int:
        """Start all roles, show progress, stop everything; returns the exit code."""
        progress = Progress(self.exp_dir / "metrics.jsonl", self.cfg.total_train_steps)
        try:
            self.start_all()
            trainers = [p for p in self.procs if is_trainer(p.name)]
            while True:
                progress.poll()
                for p in self.procs:
                    rc = p.popen.poll()
                    if rc is None or (rc == 0 and is_trainer(p.name)):
                        continue
                    progress.close()
                    print(
                        f"\nareal: role {p.name} {exit_reason(rc)}; stopping the run. "
                        f"Last lines of {p.log}:\n{tail(p.log, self.cfg.launcher.log_tail_lines)}",
                        file=sys.stderr,
                    )
                    return 1
                if all(p.popen.poll() == 0 for p in trainers):
                    progress.poll()
                    progress.close()
                    print(f"areal: run finished; metrics in {self.exp_dir / 'metrics.jsonl'}")
                    return 0
                time.sleep(self.cfg.launcher.dead_role_poll_s)
        except KeyboardInterrupt:
            progress.close()
            print("\nareal: interrupted; stopping all roles", file=sys.stderr)
            return 130
        finally:
            self.stop_all()


class Progress:
    """Tails metrics.jsonl: one console line per training step and a progress bar."""

    def __init__(self, path: Path, total_steps: int):
        self.path = path
        self.offset = 0
        self.bar = tqdm(
            total=total_steps, unit="step", dynamic_ncols=True, file=sys.stdout, disable=None
        )

    def poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self.offset)
            data = f.read()
        lines = data.split("\n")
        self.offset += len(data) - len(lines[-1])  # a partial last line waits for its end
        for line in lines[:-1]:
            if line.strip():
                self.bar.write(format_step(json.loads(line)))
                self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def format_step(m: dict) -> str:
    return (
        f"step {m['step']:>4} | version {m['version']:>4} | reward {m['reward/mean']:+6.2f} | "
        f"staleness max {m['staleness/max']} | {m['throughput/train_tokens_per_s']:7.1f} tok/s | "
        f"{m['time']:7.1f}s"
    )
