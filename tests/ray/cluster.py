"""A real multi-node Ray cluster on this machine, for tests/ray and benchmarks/ray_vs_local.py.

A head and more nodes, each a `ray start --block` of its own (a worker node joins with
`--address`), on 127.0.0.1, each with a few CPUs and fake GPUs (Ray counts the GPUs it is
told of, as slurm/test_cluster.sh's gres does for SLURM), in a temp dir of its own, with a
small object store and usage stats off. Stopping a node SIGKILLs its raylet (a lost node).
Everything is stopped by the ids of the processes started here and their descendants (never
`ray stop`, which stops every Ray on the machine, another's too), within a deadline.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

READY = "Ray runtime started."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_cli() -> str:
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else (shutil.which("ray") or "ray")


def _table() -> list[tuple[int, int, int]]:
    """(pid, parent, session) of every process."""
    rows = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
            rows.append((int(p.name), int(fields[1]), int(fields[3])))
        except (OSError, ValueError, IndexError):
            continue
    return rows


def descendants(pid: int) -> list[int]:
    """What `pid` started, and what they started, and so on: its descendants, and the
    processes of its session (a raylet's agents stay in it when the raylet dies)."""
    rows = _table()
    out = {p for p, _, sid in rows if sid == pid and p != pid}
    todo = [pid, *out]
    while todo:
        parent = todo.pop()
        for p, ppid, _ in rows:
            if ppid == parent and p not in out:
                out.add(p)
                todo.append(p)
    return sorted(out)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@dataclass
class Node:
    name: str
    proc: subprocess.Popen
    log: Path
    node_id: str = ""
    raylet: int = 0


class RayTestCluster:
    def __init__(self, cpus: int = 2, gpus: int = 1):
        # Short: Ray's unix sockets live under it (a socket path holds ~107 bytes).
        self.dir = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
        self.cpus, self.gpus = cpus, gpus
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[Node] = []

    def _start(self, name: str, *args: str) -> Node:
        log = self.dir / f"{name}.out"
        cmd = [
            _ray_cli(), "start", "--block", *args, "--node-ip-address=127.0.0.1",
            f"--num-cpus={self.cpus}", f"--num-gpus={self.gpus}",
            f"--resources={json.dumps({f'test_{name}': 1})}",
            "--disable-usage-stats", "--object-store-memory=100000000",
        ]  # fmt: skip
        with open(log, "w") as f:
            proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                # Ray's memory monitor off: on a machine shared with other work it kills
                # actors for memory that others use (a real cluster keeps it: a role it
                # kills is a dead role, recovered).
                env={
                    **os.environ,
                    "RAY_USAGE_STATS_ENABLED": "0",
                    "RAY_memory_monitor_refresh_ms": "0",
                },
            )  # fmt: skip
        node = Node(name, proc, log)
        self.nodes.append(node)
        return node

    def _ready(self, node: Node, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            failed = f"ray start {node.name} failed:\n"
            assert node.proc.poll() is None, failed + node.log.read_text()
            if READY in node.log.read_text(errors="replace"):
                for pid in descendants(node.proc.pid):
                    line = cmdline(pid)
                    if "raylet/raylet" in line:
                        node.raylet = pid
                        node.node_id = line.split("--node_id=", 1)[1].split()[0]
                        return
            time.sleep(0.2)
        raise AssertionError(f"ray node {node.name} not ready:\n{node.log.read_text()}")

    def start(self, workers: int = 2) -> RayTestCluster:
        try:
            head = self._start(
                "head", "--head", f"--port={self.port}", f"--temp-dir={self.dir}",
                "--include-dashboard=false", f"--ray-client-server-port={_free_port()}",
            )  # fmt: skip
            self._ready(head)
            for _ in range(workers):
                self.add_worker()
        except BaseException:
            self.stop()
            raise
        return self

    def add_worker(self) -> Node:
        # One at a time: raylets starting together on one host race for ports and log files.
        node = self._start(f"worker{len(self.nodes)}", f"--address={self.address}")
        self._ready(node)
        return node

    def node(self, node_id_prefix: str) -> Node:
        return next(n for n in self.nodes if n.node_id.startswith(node_id_prefix))

    def lose(self, node: Node) -> None:
        """The node is lost: its raylet dies at once (SIGKILL), as when a machine goes."""
        os.kill(node.raylet, signal.SIGKILL)

    def processes(self) -> list[int]:
        """Every running process of the cluster: the `ray start`s and all they started."""
        pids = []
        for node in self.nodes:
            if node.proc.poll() is None:
                pids.append(node.proc.pid)
            pids += descendants(node.proc.pid)
        return [p for p in pids if _running(p)]

    def actor_processes(self) -> list[str]:
        """Ray workers of the cluster that run an actor or a task now (not the idle ones)."""
        titles = [cmdline(p) for p in self.processes()]
        return [t for t in titles if t.startswith("ray::") and "IDLE" not in t and "Agent" not in t]

    def stop(self, deadline_s: float = 3.0) -> None:
        """SIGTERM every process of the cluster, SIGKILL what is left after the deadline."""
        pids = self.processes()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline and any(_running(p) for p in pids):
            time.sleep(0.1)
        for pid in set(pids + self.processes()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for node in self.nodes:
            node.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
