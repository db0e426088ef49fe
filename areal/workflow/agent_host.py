"""Agents off the controller's loop: processes that run `run(data, client)`.

    controller: AgentWorkflow --episode(id, row, token)--> AgentHosts --least busy--> process k
        OpenAIEndpoint (the controller's loop) <--HTTP, api_key = token-- the agent's calls
    process k: ONE event loop, on which
        the RPC server          --> each episode as a task of the loop (async def run),
                                    or on a thread of its own (def run: a plain function)
        a heartbeat task        <-- a watchdog thread warns when the loop stops ticking,
                                    naming the episode that blocks it and where
        one connection pool     --> each episode's openai client: a copy whose api_key is
                                    the episode's session token
        <-- {"result": reward(s)} | {"error", "traceback"} ---
    an episode that ends first (rejected, timed out) --cancel(id)--> process k
    process k dies --> its episodes are rejected (EpisodeError); it is started again

Why one loop: asyncio code is written for one. Frameworks and SDKs cache async clients,
sessions and locks at module level (LangChain's HTTP client per base_url, a module-level
`openai.AsyncOpenAI`, an aiohttp session), and such an object fails on any loop but the one
it was first used on ("bound to a different event loop"). So every async episode of a
process runs on the same loop, and the episode's identity travels with the calls: the
client handed over carries the session token as its API key, and a client the agent keeps
across episodes must send the token of the episode it serves
(`shared.with_options(api_key=client.api_key)`).

Why processes: agent code is the user's, and much of it blocks (a synchronous HTTP call,
`time.sleep`, a CPU-heavy tool, LangChain's `invoke`). On the controller's event loop it
would stall admission, routing, failover and the trainer's batches; here it holds only its
own process. Within the process, a plain `def run(data, client)` runs on a thread (with a
synchronous `openai.OpenAI`) and delays no other episode; an `async def run` that blocks
stalls the other episodes of its process, which the watchdog reports (LOOP_BLOCKED_S).
rollout.agent_processes sets how many processes (more for CPU-heavy tools); 0 runs agents
on the controller's loop, e.g. to step through one with a debugger.

The agent reaches the model only through the endpoint, over HTTP, as any OpenAI client
does; what crosses to the process is the row and the session token, and what comes back
is the reward(s): msgpack frames over ZMQ, signed with a key made for the process.

| waits for                          | unblocked by                                       |
|------------------------------------|----------------------------------------------------|
| a process's address (start)        | its first stdout line; its exit; a deadline        |
| an episode's reply                 | the episode's end; the process's death             |
| a host when all are restarting     | one of them started again                          |
| the watchdog, for the next tick    | the heartbeat task (the loop ran)                  |
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import itertools
import logging
import numbers
import os
import secrets
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from areal import rolelog
from areal.comm.rpc import RpcClient, RpcError, RpcServer
from areal.process import die_with_parent
from areal.workflow.api import EpisodeError

log = logging.getLogger("areal.workflow")

KEY_ENV = "AREAL_AGENT_KEY"
LOOP_BLOCKED_S = 5.0
"""The watchdog warns when an agent process's loop has not run for this long."""
_START_TIMEOUT_S = 120.0  # importing the agent's framework (LangChain: seconds) on a busy node
_CANCEL_TIMEOUT_S = 10.0
_RESTART_DELAY_S = 1.0
_MAX_EPISODE_THREADS = 4096  # plain-function agents: a thread per episode in flight


class AgentError(EpisodeError):
    """The agent raised, or returned what cannot be a reward: the episode is rejected."""


# ---- running an agent's episodes (in its process, or on the controller's loop) -------------


def is_async_agent(run: Any) -> bool:
    """`async def run` runs as a task of the loop; a plain function runs on a thread."""
    return inspect.iscoroutinefunction(run)


def plain(result: Any) -> Any:
    """The agent's result as msgpack carries it: numbers as floats, a mapping as a dict
    (call_rewards checks its meaning on the controller)."""
    if isinstance(result, numbers.Real) and not isinstance(result, bool):
        return float(result)
    if isinstance(result, Mapping):
        return {str(k): plain(v) for k, v in result.items()}
    return result


async def _never_closed() -> None:
    """An agent's `client.close()` (or `async with client:`) closes the shared pool of every
    episode: it does nothing instead."""


def _async_pool(timeout_s: float) -> Any:
    """The async episodes' one HTTP pool: aiohttp's, through httpx-aiohttp (what openai's
    DefaultAioHttpClient is). httpx's own pool scans every connection for each request it
    queues or releases and closes idle ones past 20: with configs/multi_turn.yaml's 64
    episodes in flight that scan took the agent process's whole core, the server generated
    in bursts ~2 s apart, and a step took 2.4-3.7 s; on aiohttp's, 1.1 s."""
    import httpx

    try:
        from httpx_aiohttp import HttpxAiohttpClient
    except ImportError:
        log.warning(
            "httpx-aiohttp is not installed: agents use httpx's connection pool, which costs "
            "a core with many episodes in flight; pip install httpx-aiohttp"
        )
        return httpx.AsyncClient(verify=False, timeout=timeout_s)
    return HttpxAiohttpClient(verify=False, timeout=timeout_s)


class AgentRunner:
    """Runs one agent's episodes on the running loop: `async def run` as a task of the loop,
    a plain `def run` on a thread of its own. Each episode is handed an openai client whose
    API key is its session token, a copy of one client per kind (one connection pool for all
    episodes, made on first use: ~5 ms, 60 ms more with a TLS context)."""

    def __init__(self, run: Any, base_url: str, timeout_s: float):
        self.run = run
        self.is_async = is_async_agent(run)
        self.base_url = base_url
        self.timeout_s = timeout_s
        self._client: Any = None
        self._http: Any = None
        self._threads: ThreadPoolExecutor | None = None

    async def __call__(self, data: dict, token: str) -> Any:
        """The agent's result for one episode (it raises what the agent raises)."""
        client = self._the_client().with_options(api_key=token)
        if self.is_async:
            return await self.run(data, client)
        if self._threads is None:
            self._threads = ThreadPoolExecutor(_MAX_EPISODE_THREADS, thread_name_prefix="episode")
        result = await asyncio.get_running_loop().run_in_executor(
            self._threads, self.run, data, client
        )
        if inspect.isawaitable(result):  # e.g. a lambda around an async function
            raise TypeError(
                f"the agent {self.run!r:.80} is a plain function that returned an awaitable: "
                "declare it `async def run(data, client)`"
            )
        return result

    def _the_client(self) -> Any:
        if self._client is None:
            import httpx
            import openai

            # Plain HTTP to the endpoint: no TLS context to load. No retries: a retried call
            # would be a second recorded call, or hide an error.
            if self.is_async:
                http = _async_pool(self.timeout_s)
                http.aclose = _never_closed
                make = openai.AsyncOpenAI
            else:
                http = httpx.Client(verify=False, timeout=self.timeout_s)
                http.close = lambda: None
                make = openai.OpenAI
            self._client = make(
                base_url=self.base_url, api_key="-", max_retries=0, http_client=http
            )
            self._http = http
        return self._client

    async def aclose(self) -> None:
        if self._http is not None:  # the shared pool: closed here only
            if self.is_async:
                await type(self._http).aclose(self._http)
            else:
                type(self._http).close(self._http)
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)


class LoopWatchdog:
    """Warns when the running loop has not ticked for `after_s`, naming what blocks it.

    A heartbeat task on the loop notes the time every after_s / 5; a thread reads it. An
    async agent that blocks (a synchronous HTTP call, `time.sleep`, a CPU-bound tool)
    stalls every episode of its process, and nothing on the loop can notice: the thread
    logs the episode that runs (`describe(task)`) and the agent's line, once per stall, and
    how long the stall lasted when the loop runs again."""

    def __init__(self, describe: Callable[[asyncio.Task | None], str], after_s: float):
        self.describe = describe
        self.after_s = after_s
        self.stalls = 0
        """Stalls warned about so far."""
        self._tick = time.monotonic()

    async def run(self) -> None:
        """The heartbeat, and its watching thread, until cancelled."""
        loop = asyncio.get_running_loop()
        done = threading.Event()
        args = (loop, threading.get_ident(), done)
        threading.Thread(target=self._watch, args=args, name="loop-watchdog", daemon=True).start()
        try:
            while True:
                self._tick = time.monotonic()
                await asyncio.sleep(self.after_s / 5)
        finally:
            done.set()

    def _watch(self, loop: asyncio.AbstractEventLoop, ident: int, done: threading.Event) -> None:
        warned_at = None  # the tick of the stall warned about
        while not done.wait(self.after_s / 5):
            tick = self._tick
            if warned_at is not None and tick != warned_at:
                log.warning("the agent process's event loop runs again after %.1f s",
                            tick - warned_at)  # fmt: skip
                warned_at = None
            if warned_at is None and time.monotonic() - tick >= self.after_s:
                warned_at = tick
                self.stalls += 1
                where = _blocked_at(sys._current_frames().get(ident))
                log.warning(
                    "the agent process's event loop has not run for %.1f s: %s blocks it%s. "
                    "Every episode of this process waits meanwhile: in an async agent, await "
                    "async calls (ainvoke, AsyncOpenAI) and run blocking code with `await "
                    "asyncio.to_thread(...)`, or write the agent as a plain "
                    "`def run(data, client)`, which runs on a thread of its own",
                    time.monotonic() - tick, self.describe(asyncio.current_task(loop)), where,
                )  # fmt: skip


def _blocked_at(frame: Any) -> str:
    """' at FILE:LINE in FUNC' of the agent's own frame in the blocked thread's stack (the
    outermost frame below AgentRunner.__call__), and of the innermost one if deeper."""
    if frame is None:
        return ""
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    caller = AgentRunner.__call__.__code__
    agent = next((f for f in stack if f.f_back and f.f_back.f_code is caller), None)

    def at(f: Any) -> str:
        return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"

    text = f" at {at(agent)}" if agent is not None else ""
    if stack[0] is not agent:
        text += f" (innermost: {at(stack[0])})"
    return text


# ---- the agent process --------------------------------------------------------------------


@dataclass
class _Running:
    n: int
    """The process's episode number (1, 2, ...), for the log."""
    data: str
    task: asyncio.Task


class _Host:
    """Serves episodes of one agent on the process's loop (AgentRunner), answers cancels,
    and watches the loop."""

    def __init__(
        self, run: Any, base_url: str, timeout_s: float, blocked_s: float = LOOP_BLOCKED_S
    ):
        self.runner = AgentRunner(run, base_url, timeout_s)
        self.running: dict[str, _Running] = {}
        self.cancelled: set[str] = set()  # cancel() that came before its episode started
        self.count = itertools.count(1)
        self.watchdog = LoopWatchdog(self._describe, blocked_s)

    async def episode(self, id: str, data: dict, token: str) -> dict:
        if id in self.cancelled:
            self.cancelled.discard(id)
            return {"error": "cancelled", "traceback": ""}
        self.running[id] = _Running(next(self.count), f"{data!r:.80}", asyncio.current_task())
        try:
            return {"result": plain(await self.runner(data, token))}
        except asyncio.CancelledError:
            return {"error": "cancelled", "traceback": ""}
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        finally:
            del self.running[id]

    async def cancel(self, id: str) -> dict:
        """Stops the episode (a plain function's thread runs on to its end; its calls are
        refused, its session being closed)."""
        entry = self.running.get(id)
        if entry is None:
            self.cancelled.add(id)
        else:
            entry.task.cancel()
        return {}

    def _describe(self, task: asyncio.Task | None) -> str:
        """Which episode `task` (the loop's current task, read from the watchdog's thread)
        is; the names of the others running."""
        running = list(self.running.values())  # another thread's dict: copy, then read
        mine = [r for r in running if r.task is task]
        if mine:
            who = f"episode {mine[0].n} (data {mine[0].data})"
        else:
            who = "a task the agent left running" if task is not None else "the process"
        return f"{who}, one of {len(running)} running,"


async def _serve(spec: str, base_url: str, timeout_s: float, key: bytes) -> None:
    from areal.plugins import resolve

    host = _Host(resolve(spec, f"rollout.workflow={spec!r}"), base_url, timeout_s)
    watchdog = asyncio.create_task(host.watchdog.run())
    server = RpcServer(key, host="127.0.0.1")
    server.register("episode", host.episode)
    server.register("cancel", host.cancel)
    print(server.address, flush=True)  # the controller reads this line, and no other:
    os.dup2(2, 1)  # the agent's own prints go to the log, never fill an unread pipe
    try:
        await server.serve()
    finally:
        watchdog.cancel()
        await host.runner.aclose()


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
