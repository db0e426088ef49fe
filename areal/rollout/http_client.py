"""The HTTP I/O every inference client shares: one aiohttp session, health, errors.

    SGLangClient ─┐                       ┌─ JSON (or text) of a 200 answer
                  ├─ HttpClient._call ────┼─ RuntimeError: HTTP status + the server's message
    VLLMClient  ──┘   (Bearer key)        └─ ServerDied: refused, reset or closed mid-call

A session belongs to the event loop that made it: a client used from a new loop makes a new
one. There is no connection limit: the staleness gate bounds how many requests are in flight.

A closed idle connection is not a dead server. A server closes a connection that stayed idle
for its keep-alive (uvicorn, under vLLM and SGLang: 5 s; the embedded server: 75 s unless
configured), and a request sent on it just then fails at once (ServerDisconnectedError,
or ClientOSError "Can not write request body") although the server is fine. So idle
connections are kept for KEEPALIVE_S only, shorter than the servers', and a request that fails
on a reused connection before any answer came is sent again on a fresh connection. A fresh
connection the server accepted and then closed before answering is not the verdict either:
under load a request can reach a server after its keep-alive has closed even a new
connection (seen with a 0.1 s keep-alive on two busy cores), so it is sent on a new one up to
FRESH_TRIES times. A dead server refuses the next connection, so ServerDied still comes at
once: on a refused connection, on a failure after the answer began, or after FRESH_TRIES.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp

from areal.rollout.auth import auth_header
from areal.rollout.inference import ServerDied
from areal.rollout.sglang_api import error_message

log = logging.getLogger("areal.rollout")

_HEALTH_POLL_S = 0.2
FRESH_TRIES = 3
"""Fresh connections a request that met closed ones is sent on before ServerDied."""
KEEPALIVE_S = 2.0
"""Seconds an idle connection is kept for the next request: under uvicorn's 5 s (vLLM,
SGLang) by more than a scheduling hiccup, so the client drops it before the server does."""


class HttpClient:
    """Async calls to one server; subclasses add the routes of their engine's API."""

    def __init__(self, base_url: str, timeout: float = 3600, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.api_key = api_key
        """Sent as `Authorization: Bearer` with every call (None: the server is open)."""
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def health(self) -> bool:
        """GET /health answers 200 (False, never an error, when the server is down)."""
        try:
            session = await self._get_session()
            timeout = aiohttp.ClientTimeout(total=5)
            async with session.get(self.base_url + "/health", timeout=timeout) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def wait_healthy(self, timeout: float, proc: subprocess.Popen | None = None) -> None:
        """Poll /health until 200; raise at once if proc (the server's process) exits."""
        deadline = time.monotonic() + timeout
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(
                    f"the inference server process exited with code {proc.returncode} "
                    f"before {self.base_url} became healthy; see its log"
                )
            if await self.health():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.base_url} was not healthy after {timeout:.0f} s")
            await asyncio.sleep(_HEALTH_POLL_S)

    async def close(self) -> None:
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None
        self._loop = None

    async def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = self._new_session(keepalive=True)
            self._loop = loop
        return self._session

    def _new_session(self, keepalive: bool) -> aiohttp.ClientSession:
        """The client's session (keepalive: idle connections kept for KEEPALIVE_S), or one
        whose connections each serve one request."""
        if keepalive:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        else:
            connector = aiohttp.TCPConnector(limit=0, force_close=True)
        return aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            headers=auth_header(self.api_key),
        )

    async def _call(
        self, method: str, path: str, body: Any, ok_statuses: tuple[int, ...] = (200,)
    ) -> Any:
        """JSON (or text) of the answer; RuntimeError with the server's message otherwise,
        ServerDied when the connection is refused, reset after the answer began, or closed
        before it on FRESH_TRIES fresh connections in a row (module docstring)."""
        session = await self._get_session()
        try:
            status, raw = await self._send(session, method, path, body)
        except _ClosedBeforeAnswer as closed:
            # Most often sent on an idle connection the server had just closed: not an answer
            # from the server, so again on connections of its own.
            for attempt in range(1, FRESH_TRIES + 1):
                log.info("%s %s%s: its connection was closed before the answer (%r); sending "
                         "it on a fresh one (%d/%d)", method, self.base_url, path, closed.cause,
                         attempt, FRESH_TRIES)  # fmt: skip
                async with self._new_session(keepalive=False) as fresh:
                    try:
                        status, raw = await self._send(fresh, method, path, body)
                        break
                    except _ClosedBeforeAnswer as e:
                        closed = e
            else:
                raise ServerDied(self.base_url, f"{method} {path}", closed.cause) from closed.cause
        try:
            content: Any = json.loads(raw) if raw.strip() else None
        except ValueError:
            content = raw.decode(errors="replace")
        if status not in ok_statuses:
            raise RuntimeError(
                f"{method} {self.base_url}{path} returned HTTP {status}: {error_message(content)}"
            )
        return content

    async def _send(
        self, session: aiohttp.ClientSession, method: str, path: str, body: Any
    ) -> tuple[int, bytes]:
        """(status, body) of one request; _ClosedBeforeAnswer when its connection (a new one
        the server accepted, or a reused one) was closed before an answer began, ServerDied on
        any other connection failure (refused, reset after the answer began)."""
        answered = False
        try:
            async with session.request(method, self.base_url + path, json=body) as resp:
                answered = True
                return resp.status, await resp.read()
        except aiohttp.ServerTimeoutError:
            raise  # slow, not dead: an asyncio.TimeoutError for the caller
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            if not answered and not isinstance(e, aiohttp.ClientConnectorError):
                raise _ClosedBeforeAnswer(e) from e
            raise ServerDied(self.base_url, f"{method} {path}", e) from e
        except (aiohttp.ClientConnectionError, ConnectionError) as e:
            raise ServerDied(self.base_url, f"{method} {path}", e) from e


class _ClosedBeforeAnswer(Exception):
    """A request's connection was closed before any answer: the server closed it (idle), or
    died; the next connection tells which."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(repr(cause))
        self.cause = cause


class AdapterGate:
    """The LoRA adapter a client's requests name, swapped without a request naming a name
    the server no longer serves, or running on an adapter older than its version's tag.

    A request names its adapter when the server receives it (even while generation is
    paused); so while a swap runs, new requests wait (`sending`), and the swap first aborts
    until every request sent under the old name has answered (`drain`): the worker resumes
    those under the new name, once it is registered."""

    def __init__(self) -> None:
        self.adapter: str | None = None
        """The adapter's served name (None: the base model)."""
        self._open = asyncio.Event()
        self._open.set()
        self._sending = 0

    @contextlib.asynccontextmanager
    async def sending(self) -> AsyncIterator[str | None]:
        """Around one request: waits for a swap to end; yields the adapter to name."""
        await self._open.wait()
        self._sending += 1
        try:
            yield self.adapter
        finally:
            self._sending -= 1

    @contextlib.asynccontextmanager
    async def swapping(self) -> AsyncIterator[None]:
        """Around a swap: requests wait until it ends (failed or not)."""
        self._open.clear()
        try:
            yield
        finally:
            self._open.set()

    async def drain(self, abort_all: Callable[[], Awaitable[Any]]) -> None:
        """Inside swapping(): abort until no request sent before it is left on the server."""
        while self._sending:
            await abort_all()
            await asyncio.sleep(0.02)
