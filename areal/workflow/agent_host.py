"""The controller's side of the agent processes: start them, send them episodes, restart them.

    controller: AgentWorkflow --episode(id, row, token)--> AgentHosts --least busy--> process k
        OpenAIEndpoint (the controller's loop) <--HTTP, api_key = token-- the agent's calls
        <-- {"result": reward(s)} | {"error", "traceback"} --- process k
    an episode that ends first (rejected, timed out) --cancel(id)--> process k
    process k dies --> its episodes are rejected (EpisodeError); it is started again

Each process k is `python -m areal.workflow.agent_process` (areal/workflow/agent_process.py:
its one event loop, threads for plain functions, connection pool and watchdog).

Why processes: agent code is the user's, and much of it blocks (a synchronous HTTP call,
`time.sleep`, a CPU-heavy tool, LangChain's `invoke`). On the controller's event loop it
would stall admission, routing, failover and the trainer's batches; in a process it holds
only that process. rollout.agent_processes sets how many processes (more for CPU-heavy
tools); 0 runs agents on the controller's loop, e.g. to step through one with a debugger.

The agent reaches the model only through the endpoint, over HTTP, as any OpenAI client
does; what crosses to the process is the row and the session token, and what comes back
is the reward(s): msgpack frames over ZMQ, signed with a key made for the process.

| waits for                          | unblocked by                                       |
|------------------------------------|----------------------------------------------------|
| a process's address (start)        | its first stdout line; its exit; a deadline        |
| an episode's reply                 | the episode's end; the process's death             |
| a host when all are restarting     | one of them started again                          |
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sys
from dataclasses import dataclass, field
from typing import Any

from areal.comm.rpc import RpcClient, RpcError
from areal.process import die_with_parent
from areal.workflow.agent_process import KEY_ENV
from areal.workflow.api import EpisodeError

log = logging.getLogger("areal.workflow")

_START_TIMEOUT_S = 120.0  # importing the agent's framework (LangChain: seconds) on a busy node
_CANCEL_TIMEOUT_S = 10.0
_RESTART_DELAY_S = 1.0


class AgentError(EpisodeError):
    """The agent raised, or returned what cannot be a reward: the episode is rejected."""


@dataclass
class _Process:
    proc: asyncio.subprocess.Process
    rpc: RpcClient
    busy: int = 0
    died: str = ""
    """Why it is gone ("" while it serves)."""
    watch: asyncio.Task | None = field(default=None, repr=False)


class AgentHosts:
    """rollout.agent_processes processes running one agent; episodes go to the least busy."""

    def __init__(self, spec: str, n: int, base_url: str, timeout_s: float):
        self.spec = spec
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.procs: list[_Process | None] = [None] * n
        self.changed = asyncio.Condition()
        """Notified when a process (re)starts."""
        self._closing = False
        self.restarts = 0
        """Processes started again after dying, since the workflow's last stats()."""

    async def start(self) -> None:
        """Start every process; RuntimeError (with its exit status) if one cannot start
        (the others are then stopped by close(), which the workflow's aclose calls)."""
        results = await asyncio.gather(
            *(self._start(k) for k in range(len(self.procs))), return_exceptions=True
        )
        for error in results:
            if isinstance(error, BaseException):
                raise error

    async def run(self, data: dict, token: str) -> Any:
        """The agent's result for one episode; EpisodeError if it raised or its process died."""
        async with self.changed:
            await self.changed.wait_for(lambda: any(self.procs))
            p = min(filter(None, self.procs), key=lambda p: p.busy)
            p.busy += 1
        try:
            reply = await p.rpc.call("episode", id=token, data=data, token=token)
        except asyncio.CancelledError:
            # Its calls are refused from now on; stop the agent too (if the cancel is lost,
            # its calls fail anyway: the session is closed).
            p.rpc.call_soon("cancel", _CANCEL_TIMEOUT_S, id=token)
            raise
        except RpcError as e:
            raise EpisodeError(p.died or f"the agent process failed: {e}") from e
        finally:
            p.busy -= 1
        if "error" in reply:
            raise AgentError(f"{reply['error']}\nThe agent's traceback:\n{reply['traceback']}")
        return reply["result"]

    async def close(self) -> None:
        self._closing = True
        for p in filter(None, self.procs):
            p.rpc.close()
            if p.proc.returncode is None:
                p.proc.kill()
            await p.proc.wait()

    async def _start(self, k: int) -> None:
        key = secrets.token_bytes(32)
        env = {
            **os.environ,
            KEY_ENV: key.hex(),
            # The agent imports what the controller could import (its cwd, PYTHONPATH).
            "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path),
            "PYTHONUNBUFFERED": "1",
        }
        proc = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "areal.workflow.agent_process", "--agent", self.spec,
              "--base-url", self.base_url, "--timeout", str(self.timeout_s), "--name", f"agent{k}"],
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            preexec_fn=die_with_parent,
        )  # fmt: skip
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), _START_TIMEOUT_S)
        except asyncio.TimeoutError:
            line = b""
        if not line.startswith(b"tcp://"):
            if proc.returncode is None:
                proc.kill()
            rc = await proc.wait()
            raise RuntimeError(
                f"agent process {k} ({self.spec}) exited with status {rc} before it served "
                f"(or took over {_START_TIMEOUT_S:g} s): its error is in the controller's log"
            )
        p = _Process(proc, RpcClient(line.decode().strip(), key))
        p.watch = asyncio.create_task(self._watch(k, p))
        async with self.changed:
            self.procs[k] = p
            self.changed.notify_all()

    async def _watch(self, k: int, p: _Process) -> None:
        """A dead process's episodes are rejected at once, and it is started again."""
        rc = await p.proc.wait()
        if self._closing:
            return
        p.died = f"agent process {k} died (exit status {rc}) while running this episode"
        log.warning("agent process %d died (exit status %s); starting it again", k, rc)
        self.procs[k] = None
        p.rpc.close()  # fails its calls in flight: their episodes are rejected
        while not self._closing:
            await asyncio.sleep(_RESTART_DELAY_S)
            try:
                await self._start(k)
                self.restarts += 1
                return
            except RuntimeError as e:
                log.warning("%s; trying again", e)
