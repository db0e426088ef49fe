"""RPC clients without sockets, for roles that share one process (areal/inline.py).

InProcessRpc   an RpcClient (call, call_soon, close) whose methods run on the caller's
               loop, arguments and results round-tripped through the wire's msgpack
BlockingRpc    a SyncRpcClient for another thread: runs an InProcessRpc call on the
               roles' loop and waits for it, or for the roles' failure
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from areal.comm.rpc import RpcError, RpcTimeout
from areal.comm.wire import pack, unpack


class InProcessRpc:
    """An RpcClient stand-in (call, call_soon, close) that runs the methods on the caller's
    event loop. As over the wire: arguments and results travel through pack/unpack, each
    call's method runs in its own task, which a caller's timeout or cancellation leaves
    running (the controller abandons a generate explicitly), and a failing method raises
    RpcError (its cause chained, for the debugger)."""

    def __init__(self, methods: dict[str, Callable[..., Awaitable[Any]]], address: str) -> None:
        self.methods = methods
        self.address = address
        self._soon: set[asyncio.Task] = set()
        self._handlers: set[asyncio.Task] = set()

    async def call(self, method: str, timeout: float | None = None, **args: Any) -> Any:
        fn = self.methods.get(method)
        if fn is None:
            raise RpcError(f"unknown method {method!r}; {self.address} has {sorted(self.methods)}")
        handler = asyncio.create_task(fn(**unpack(pack(args))))
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)
        try:
            result = await asyncio.wait_for(asyncio.shield(handler), timeout)
        except asyncio.TimeoutError:
            msg = f"no reply to {method!r} from {self.address} within {timeout:g} s"
            raise RpcTimeout(msg) from None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise RpcError(f"{type(e).__name__}: {e}") from e
        return unpack(pack(result))

    def call_soon(self, method: str, timeout: float, **args: Any) -> asyncio.Task:
        task = asyncio.create_task(self.call(method, timeout=timeout, **args))
        self._soon.add(task)
        task.add_done_callback(self._soon.discard)
        return task

    def close(self) -> None:
        """Cancel the call_soon calls and the methods still running (as RpcServer.close)."""
        for task in [*self._soon, *self._handlers]:
            task.cancel()


class BlockingRpc:
    """The trainer's SyncRpcClient stand-in: runs an InProcessRpc call on the roles' loop
    (another thread's) and waits; raises the roles' failure instead of waiting forever."""

    def __init__(
        self,
        rpc: InProcessRpc,
        loop: asyncio.AbstractEventLoop,
        failure: Callable[[], BaseException | None],
    ) -> None:
        self.rpc = rpc
        self.loop = loop
        self.failure = failure
        """The roles' failure, once they have one (None while they run)."""

    def call(self, method: str, timeout: float | None = None, **args: Any) -> Any:
        future = asyncio.run_coroutine_threadsafe(self.rpc.call(method, timeout, **args), self.loop)
        # No deadline of its own: a get_batch waits as long as generation takes; what ends
        # a wait that will never be answered is the roles' failure (e.g. NoProgress).
        while True:
            try:
                return future.result(timeout=0.2)
            except FutureTimeout:
                failure = self.failure()
                if failure is not None:
                    future.cancel()
                    raise failure from None

    def close(self) -> None:
        pass
