"""An agent process: runs one agent's episodes, `run(data, client)`, for the controller.

Started by the controller's AgentHosts (areal/workflow/agent_host.py) as
`python -m areal.workflow.agent_process`; its first stdout line is its address.

    process k: ONE event loop, on which
        the RPC server          --> each episode as a task of the loop (async def run),
                                    or on a thread of its own (def run: a plain function)
        a heartbeat task        <-- a watchdog thread warns when the loop stops ticking,
                                    naming the episode that blocks it and where
        one connection pool     --> each episode's openai client: a copy whose api_key is
                                    the episode's session token
        <-- {"result": reward(s)} | {"error", "traceback"} --- to the controller
    cancel(id) from the controller --> the episode's task is cancelled

AgentRunner also runs agents on the controller's loop when rollout.agent_processes=0.

Why one loop: asyncio code is written for one. Frameworks and SDKs cache async clients,
sessions and locks at module level (LangChain's HTTP client per base_url, a module-level
`openai.AsyncOpenAI`, an aiohttp session), and such an object fails on any loop but the one
it was first used on ("bound to a different event loop"). So every async episode of a
process runs on the same loop, and the episode's identity travels with the calls: the
client handed over carries the session token as its API key, and a client the agent keeps
across episodes must send the token of the episode it serves
(`shared.with_options(api_key=client.api_key)`).

Within the process, a plain `def run(data, client)` runs on a thread (with a synchronous
`openai.OpenAI`) and delays no other episode; an `async def run` that blocks stalls the
other episodes of its process, which the watchdog reports (LOOP_BLOCKED_S).

| waits for                          | unblocked by                                       |
|------------------------------------|----------------------------------------------------|
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
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from areal import rolelog
from areal.comm.rpc import RpcServer

log = logging.getLogger("areal.workflow")

KEY_ENV = "AREAL_AGENT_KEY"
"""The environment variable by which the controller hands the process its RPC key."""
LOOP_BLOCKED_S = 5.0
"""The watchdog warns when an agent process's loop has not run for this long."""
_MAX_EPISODE_THREADS = 4096  # plain-function agents: a thread per episode in flight


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


if __name__ == "__main__":
    main()
