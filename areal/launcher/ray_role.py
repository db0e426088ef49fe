"""The Ray actor that runs one step of a plan (areal/launcher/ray.py) on the node and GPUs of
the step's bundle: `python -m areal.worker ...` as its child, the same process the local and
SLURM launchers start. Every node imports this module: it imports nothing heavy.

    launcher --run(cmd, env, log)--> RoleActor (Ray worker) --Popen--> areal.worker
             <-- exit code ------------'        the child: own process group, SIGKILLed when
             --signal(sig)--> its group         the actor dies (PR_SET_PDEATHSIG)

The actor is async, so `signal` is served while `run` waits, and every Popen happens on its
one event-loop thread (PR_SET_PDEATHSIG fires when the forking thread ends, not the process).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

from areal.process import die_with_parent

RAY_OWN_ENV = ("OMP_NUM_THREADS",)
"""What Ray sets for its worker from the bundle's CPUs (1 for a token share), not the role's:
a role sets its threads itself (areal/cores.py), as under the other launchers."""


class RoleActor:
    def __init__(self) -> None:
        self.popen: subprocess.Popen | None = None

    async def where(self, exp_dir: str) -> dict:
        """The node and GPUs Ray placed this actor on, the interpreter it runs, and whether
        the experiment directory is there (shared storage)."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "python": sys.executable,
            "sees_exp_dir": os.path.isfile(os.path.join(exp_dir, "config.yaml")),
        }

    async def free_port(self) -> int:
        """A port free on every interface of this node now (trainer rank 0's MASTER_PORT)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    async def run(
        self, cmd: list[str], env: dict[str, str], log: str, append: bool, nice: int
    ) -> int:
        """Run the step to its end at niceness `nice` (the launcher's); returns its exit code
        (-N: killed by signal N)."""
        base = {k: v for k, v in os.environ.items() if k not in RAY_OWN_ENV}
        # Ray starts its workers at nice 15 (RAY_worker_niceness): a role would get a sliver
        # of a busy node's cores. This thread forks the child, which inherits its niceness.
        note = ""
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        if ours != nice:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, nice)
            except OSError as e:
                note = (
                    f"areal: this step runs at nice {ours}, not the launcher's {nice} ({e}): "
                    f"start the Ray nodes with RAY_worker_niceness={nice}\n"
                )
        with open(log, "a" if append else "w") as f:
            f.write(note)
            f.flush()
            self.popen = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # stopping the step stops its children too
                preexec_fn=die_with_parent,
                env={**base, **env},
            )
        # Waited for in a thread (no polling: the actor costs nothing while its step runs).
        return await asyncio.get_running_loop().run_in_executor(None, self.popen.wait)

    async def signal(self, sig: int) -> None:
        """Send `sig` to the step's process group (a no-op once it is gone)."""
        if self.popen is not None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
