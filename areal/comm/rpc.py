"""Asynchronous request/reply between roles: ZMQ ROUTER servers, DEALER clients.

    RpcClient.call ------ sealed {"id", "method", "args"} -----> RpcServer.serve
      (a future per id)           DEALER -> ROUTER                 (a task per request:
    RpcClient._receive <- sealed {"id", "ok", "result", "error"} -- await handler(**args))

Every frame is sealed with the experiment key (see wire.py); one that fails the check is
dropped, logged and counted, never answered. Each request runs in its own task, so a slow
handler never holds up the others, and many calls share one client socket, matched by id.

| loop                 | waits for                | unblocked by                      |
|----------------------|--------------------------|-----------------------------------|
| RpcServer.serve      | a request frame          | any client's call; close()        |
| RpcClient.call       | its reply future         | _receive; its timeout; close()    |
| RpcClient._receive   | a reply frame            | the server's reply; close()       |
| a call_soon task     | its call                 | as RpcClient.call                 |
| SyncRpcClient.call   | poll on its socket       | the reply; its timeout            |
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from areal.comm import net, wire

log = logging.getLogger("areal.comm")

_REQUEST = {"id": int, "method": str, "args": dict}
_REPLY = {"id": int, "ok": bool, "error": str}  # plus "result", of any type


class RpcError(Exception):
    """The remote handler failed, the method is unknown, or the client was closed."""


class RpcTimeout(TimeoutError):
    """No reply arrived within the call's timeout."""


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    # Closing must never hang on undelivered messages to a dead peer.
    sock.setsockopt(zmq.LINGER, 0)
    # Unlimited queues: at the default HWM of 1000 a ROUTER silently drops replies to a slow
    # peer and a DEALER blocks; our queues are bounded by the callers' own concurrency.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    # Keepalive notices peers that vanished without closing (a killed node), and stops
    # idle connections being cut by firewalls between cluster nodes.
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 60)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 10)
    return sock


class _Endpoint:
    """What servers and clients share: the key, and dropping frames that fail the check."""

    def __init__(self, key: bytes) -> None:
        self.dropped = 0
        self.bytes_in = 0
        """Bytes of the frames received, HMAC included (the data plane's accounting)."""
        self.bytes_out = 0
        """Bytes of the frames sent."""
        self._key = key

    def _seal(self, obj: Any) -> list[bytes]:
        frames = wire.seal(obj, self._key)
        self.bytes_out += sum(len(f) for f in frames)
        return frames

    def _open(self, frames: list[bytes], fields: dict[str, type], peer: str) -> dict | None:
        """The message in frames, or None (logged and counted) if it fails unseal or its form."""
        self.bytes_in += sum(len(f) for f in frames)
        try:
            msg = wire.unseal(frames, self._key)
            if not isinstance(msg, dict) or any(
                not isinstance(msg.get(f), kind) for f, kind in fields.items()
            ):
                raise wire.WireError(f"message is not of the form {list(fields)}: {msg!r:.200}")
            return msg
        except wire.WireError as e:
            self.dropped += 1
            log.warning("dropped a frame from %s: %s", peer, e)
            return None


class RpcServer(_Endpoint):
    """Serves registered async functions to RpcClients; binds at construction."""

    def __init__(self, key: bytes, host: str | None = None, port: int = 0) -> None:
        """Binds host:port; host None = this node's usual interface (see net.py), and the
        address peers should use (`self.address`) names the advertised host."""
        super().__init__(key)
        self._sock = _socket(zmq.asyncio.Context.instance(), zmq.ROUTER)
        bind = host or net.bind_host()
        if port == 0:
            port = self._sock.bind_to_random_port(f"tcp://{bind}")
        else:
            self._sock.bind(f"tcp://{bind}:{port}")
        self.address = f"tcp://{host or net.advertised_host()}:{port}"
        self._methods: dict[str, Callable[..., Awaitable[Any]]] = {}
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    def register(self, name: str, fn: Callable[..., Awaitable[Any]]) -> None:
        """Serve `await fn(**args)` as `name`."""
        self._methods[name] = fn

    async def serve(self) -> None:
        """Answer requests until close() or cancellation."""
        try:
            while True:
                peer, *frames = await self._sock.recv_multipart()
                request = self._open(frames, _REQUEST, f"peer {peer.hex()} of {self.address}")
                if request is not None:
                    task = asyncio.create_task(self._handle(peer, request))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
        except asyncio.CancelledError:
            if not self._closed:  # close() cancels the pending recv: a normal end
                raise
        finally:
            for task in list(self._tasks):
                task.cancel()

    async def _handle(self, peer: bytes, request: dict) -> None:
        method, reply = request["method"], {"id": request["id"], "ok": False, "result": None}
        fn = self._methods.get(method)
        if fn is None:
            reply["error"] = f"unknown method {method!r}; this server has {sorted(self._methods)}"
        else:
            try:
                reply.update(ok=True, result=await fn(**request["args"]), error="")
            except Exception as e:
                log.warning("rpc handler %r failed", method, exc_info=True)
                reply["error"] = f"{type(e).__name__}: {e}"
        try:
            frames = self._seal(reply)
        except wire.WireError as e:  # a result that cannot travel is the handler's bug
            reply.update(ok=False, result=None, error=f"{method!r} returned an unsendable {e}")
            frames = self._seal(reply)
        if not self._closed:
            await self._sock.send_multipart([peer, *frames])

    def close(self) -> None:
        """Stop serving: serve() returns and in-flight handlers are cancelled."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        self._sock.close(linger=0)


class RpcClient(_Endpoint):
    """Concurrent calls to one RpcServer from one event loop, over one DEALER socket."""

    def __init__(self, address: str, key: bytes) -> None:
        super().__init__(key)
        self.address = address
        self._sock = _socket(zmq.asyncio.Context.instance(), zmq.DEALER)
        self._sock.connect(address)
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._receiver: asyncio.Task | None = None
        self._soon: set[asyncio.Task] = set()  # held: asyncio keeps only weak references
        self._closed = False

    async def call(self, method: str, timeout: float | None = None, **args: Any) -> Any:
        """Run `method(**args)` on the server and return its result."""
        if self._closed:
            raise RpcError("client closed")
        if self._receiver is None:
            self._receiver = asyncio.create_task(self._receive())
        rid = next(self._ids)
        self._pending[rid] = future = asyncio.get_running_loop().create_future()
        try:
            request = {"id": rid, "method": method, "args": args}
            await self._sock.send_multipart(self._seal(request))
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            msg = f"no reply to {method!r} from {self.address} within {timeout:g} s"
            raise RpcTimeout(msg) from None
        finally:
            self._pending.pop(rid, None)

    def call_soon(self, method: str, timeout: float, **args: Any) -> asyncio.Task:
        """Call `method(**args)` without waiting for it: for notices whose reply nobody
        reads. A failure is logged, never raised; close() cancels the calls still waiting.
        Returns the call's task (held here until done; nobody needs to await it)."""
        task = asyncio.create_task(self.call(method, timeout=timeout, **args))
        self._soon.add(task)
        task.add_done_callback(functools.partial(self._soon_done, method))
        return task

    def _soon_done(self, method: str, task: asyncio.Task) -> None:
        self._soon.discard(task)
        # After close() a call ends cancelled, or failed "client closed" where wait_for
        # (before 3.12) turns the cancel into its future's result: either way, not news.
        if not task.cancelled() and task.exception() is not None and not self._closed:
            log.warning("%r on %s failed: %s", method, self.address, task.exception())

    async def _receive(self) -> None:
        try:
            while True:
                reply = self._open(await self._sock.recv_multipart(), _REPLY, self.address)
                future = None if reply is None else self._pending.get(reply["id"])
                if future is None or future.done():  # dropped, or its caller timed out
                    continue
                if reply["ok"]:
                    future.set_result(reply.get("result"))
                else:
                    future.set_exception(RpcError(reply["error"]))
        except zmq.ZMQError as e:  # the socket broke: fail the waiting calls now, not at timeout
            self._fail_pending(RpcError(f"receiving from {self.address} failed: {e}"))

    def _fail_pending(self, err: RpcError) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(err)
        self._pending.clear()

    def close(self) -> None:
        """Close the socket, fail every call still waiting with RpcError, and cancel the
        call_soon calls still waiting."""
        self._closed = True
        if self._receiver is not None:
            self._receiver.cancel()
        for task in list(self._soon):
            task.cancel()
        self._fail_pending(RpcError("client closed"))
        self._sock.close(linger=0)


class SyncRpcClient(_Endpoint):
    """Blocking calls, one at a time, for code without an event loop (the trainer)."""

    def __init__(self, address: str, key: bytes) -> None:
        super().__init__(key)
        self.address = address
        self._sock = _socket(zmq.Context.instance(), zmq.DEALER)
        self._sock.connect(address)
        self._ids = itertools.count()

    def call(self, method: str, timeout: float | None = None, **args: Any) -> Any:
        """Run `method(**args)` on the server and return its result."""
        rid = next(self._ids)
        self._sock.send_multipart(self._seal({"id": rid, "method": method, "args": args}))
        deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
        while True:
            left_s = deadline - time.monotonic()
            if not self._sock.poll(None if timeout is None else max(0, int(1000 * left_s))):
                raise RpcTimeout(f"no reply to {method!r} from {self.address} within {timeout:g} s")
            reply = self._open(self._sock.recv_multipart(), _REPLY, self.address)
            # Skip dropped frames and late replies to earlier calls that timed out.
            if reply is None or reply["id"] != rid:
                continue
            if reply["ok"]:
                return reply.get("result")
            raise RpcError(reply["error"])

    def close(self) -> None:
        self._sock.close(linger=0)
