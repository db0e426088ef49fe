"""Agents off the controller's loop: processes that run `run(data, client)`.

    controller: AgentWorkflow --episode(id, row, token)--> AgentHosts --least busy--> process k
        OpenAIEndpoint (the controller's loop) <--HTTP, api_key = token-- the agent's calls
    process k: one thread per episode, each with its own event loop and openai client
               (kept by the thread for its next episode)
        <-- {"result": reward(s)} | {"error", "traceback"} ---
    an episode that ends first (rejected, timed out) --cancel(id)--> process k
    process k dies --> its episodes are rejected (EpisodeError); it is started again

Why: agent code is the user's, and much of it blocks (a synchronous HTTP call,
`time.sleep`, a CPU-heavy tool, LangChain's `invoke`). On the controller's event loop it
would stall admission, routing, failover and the trainer's batches; in a thread it would
still hold the controller's GIL while it computes. Here it holds only its own process, and
within that only its own thread: a blocking episode delays no other episode's calls.
rollout.agent_processes sets how many processes (more for CPU-heavy tools); 0 runs agents
on the controller's loop, as before, e.g. to step through one with a debugger.

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

import argparse
import asyncio
import logging
import numbers
import os
import secrets
import sys
import threading
import traceback
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from areal import rolelog
from areal.comm.rpc import RpcClient, RpcError, RpcServer
from areal.process import die_with_parent
from areal.workflow.api import EpisodeError

log = logging.getLogger("areal.workflow")

KEY_ENV = "AREAL_AGENT_KEY"
_START_TIMEOUT_S = 120.0  # importing the agent's framework (LangChain: seconds) on a busy node
_CANCEL_TIMEOUT_S = 10.0
_RESTART_DELAY_S = 1.0
_MAX_EPISODE_THREADS = 4096  # a thread per episode in flight: max_concurrent x group_size


class AgentError(EpisodeError):
    """The agent raised, or returned what cannot be a reward: the episode is rejected."""


# ---- the agent process --------------------------------------------------------------------


def plain(result: Any) -> Any:
    """The agent's result as msgpack carries it: numbers as floats, a mapping as a dict
    (call_rewards checks its meaning on the controller)."""
    if isinstance(result, numbers.Real) and not isinstance(result, bool):
        return float(result)
    if isinstance(result, Mapping):
        return {str(k): plain(v) for k, v in result.items()}
    return result


class _Host:
    """Serves episodes of one agent: each on its own thread, which keeps its event loop and
    openai client from one episode to the next (a client takes ~5 ms to make)."""

    def __init__(self, run: Any, base_url: str, timeout_s: float):
        self.run = run
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.threads = ThreadPoolExecutor(_MAX_EPISODE_THREADS, thread_name_prefix="episode")
        self.running: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Task]] = {}
        self.cancelled: set[str] = set()  # cancel() that came before its episode started
        self.lock = threading.Lock()
        self.local = threading.local()  # each thread's loop and client

    async def episode(self, id: str, data: dict, token: str) -> dict:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.threads, self._in_thread, id, data, token)

    def _in_thread(self, id: str, data: dict, token: str) -> dict:
        if not hasattr(self.local, "loop"):
            self.local.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.local.loop)  # for code that asks for "the" loop
        loop = self.local.loop
        try:
            return loop.run_until_complete(self._episode(id, data, token))
        finally:  # what the agent started and left running ends with its episode
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))

    def _client(self, token: str) -> Any:
        """This thread's client, with the episode's session token as its API key."""
        import httpx
        import openai

        http = getattr(self.local, "http", None)
        if http is None or http.is_closed:  # a new thread, or the agent closed its client
            # Plain HTTP to the endpoint: no TLS context to load (60 ms a client otherwise).
            self.local.http = httpx.AsyncClient(verify=False, timeout=self.timeout_s)
            self.local.client = openai.AsyncOpenAI(
                base_url=self.base_url, api_key="-", max_retries=0, http_client=self.local.http
            )  # no retries: a retried call would be a second recorded call, or hide an error
        return self.local.client.with_options(api_key=token)

    async def cancel(self, id: str) -> dict:
        with self.lock:
            entry = self.running.get(id)
            if entry is None:
                self.cancelled.add(id)
            else:
                entry[0].call_soon_threadsafe(entry[1].cancel)
        return {}

    async def _episode(self, id: str, data: dict, token: str) -> dict:
        with self.lock:
            if id in self.cancelled:
                self.cancelled.discard(id)
                return {"error": "cancelled", "traceback": ""}
            self.running[id] = (asyncio.get_running_loop(), asyncio.current_task())
        try:
            result = await self.run(data, self._client(token))
            return {"result": plain(result)}
        except asyncio.CancelledError:
            return {"error": "cancelled", "traceback": ""}
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        finally:
            with self.lock:
                del self.running[id]


async def _serve(spec: str, base_url: str, timeout_s: float, key: bytes) -> None:
    from areal.plugins import resolve

    host = _Host(resolve(spec, f"rollout.workflow={spec!r}"), base_url, timeout_s)
    server = RpcServer(key, host="127.0.0.1")
    server.register("episode", host.episode)
    server.register("cancel", host.cancel)
    print(server.address, flush=True)  # the controller reads this line, and no other:
    os.dup2(2, 1)  # the agent's own prints go to the log, never fill an unread pipe
    await server.serve()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Runs agent episodes for a controller.")
    parser.add_argument("--agent", required=True, help='rollout.workflow: "package.module:run"')
    parser.add_argument("--base-url", required=True, help="the OpenAI-compatible endpoint")
    parser.add_argument("--timeout", type=float, required=True, help="seconds per HTTP call")
    parser.add_argument("--name", default="agent0")
    args = parser.parse_args(argv)
    rolelog.setup(args.name)
    for name in ("httpx", "httpx2"):  # one INFO line per call otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    key = bytes.fromhex(os.environ.pop(KEY_ENV))
    asyncio.run(_serve(args.agent, args.base_url, args.timeout, key))


# ---- the controller's side ----------------------------------------------------------------


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
            *[sys.executable, "-m", "areal.workflow.agent_host", "--agent", self.spec,
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


if __name__ == "__main__":
    main()
