"""RPC over real ZMQ sockets on 127.0.0.1, and the name registry on a temp dir."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import stat
import threading
import time

import numpy as np
import pytest
import zmq
import zmq.asyncio

from areal.comm import wire
from areal.comm.registry import Registry, create_key, load_key
from areal.comm.rpc import RpcClient, RpcError, RpcServer, RpcTimeout, SyncRpcClient

KEY = b"k" * 32


async def echo(**args):
    return args


async def slow(delay: float, value=None):
    await asyncio.sleep(delay)
    return value


async def fail(msg: str):
    raise ValueError(msg)


@contextlib.asynccontextmanager
async def serving(**handlers):
    """A server with these handlers, serving in a task, and a client connected to it."""
    server = RpcServer(KEY)
    for name, fn in handlers.items():
        server.register(name, fn)
    task = asyncio.create_task(server.serve())
    client = RpcClient(server.address, KEY)
    try:
        yield server, client
    finally:
        client.close()
        server.close()
        await asyncio.wait_for(task, 1)


def test_round_trip_with_arrays() -> None:
    async def stats(x: np.ndarray, scale: float) -> dict:
        return {"y": x * scale, "sum": float(x.sum()), "dtype": str(x.dtype)}

    async def main():
        async with serving(stats=stats) as (server, client):
            assert server.address.startswith("tcp://127.0.0.1:")
            x = np.arange(12, dtype=np.float32).reshape(3, 4)
            out = await client.call("stats", x=x, scale=2.0)
            np.testing.assert_array_equal(out["y"], x * 2)
            assert out["y"].dtype == np.float32 and out["y"].shape == (3, 4)
            assert out == {"y": out["y"], "sum": 66.0, "dtype": "float32"}

    asyncio.run(main())


def test_concurrent_calls_finishing_out_of_order_get_their_own_results() -> None:
    finished: list[int] = []

    async def work(i: int, delay: float) -> dict:
        await asyncio.sleep(delay)
        finished.append(i)
        return {"i": i, "square": i * i}

    async def main():
        async with serving(work=work) as (_, client):
            delays = [random.Random(i).uniform(0, 0.2) for i in range(50)]
            results = await asyncio.gather(
                *(client.call("work", i=i, delay=d) for i, d in enumerate(delays))
            )
        assert results == [{"i": i, "square": i * i} for i in range(50)]
        assert finished != sorted(finished)  # the handlers really ran concurrently

    start = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - start < 3.0  # 50 calls of up to 0.2 s each: ~5 s in series


def test_remote_exception_becomes_rpc_error(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="areal.comm")

    async def main():
        async with serving(fail=fail, echo=echo) as (_, client):
            with pytest.raises(RpcError, match="ValueError: bad input 42"):
                await client.call("fail", msg="bad input 42")
            with pytest.raises(RpcError, match="TypeError.*unexpected keyword"):
                await client.call("fail", msg="x", extra=1)
            assert await client.call("echo", a=1) == {"a": 1}  # the server survived both

    asyncio.run(main())
    assert any("'fail' failed" in r.message and r.exc_info for r in caplog.records)


def test_unknown_method_names_it_and_the_known_ones() -> None:
    async def main():
        async with serving(echo=echo, slow=slow) as (_, client):
            with pytest.raises(RpcError, match=r"unknown method 'nope'.*\['echo', 'slow'\]"):
                await client.call("nope")

    asyncio.run(main())


def test_unsendable_result_is_reported_to_the_caller() -> None:
    async def bad():
        return {1, 2}

    async def main():
        async with serving(bad=bad) as (_, client):
            with pytest.raises(RpcError, match="'bad' returned an unsendable"):
                await client.call("bad", timeout=1)

    asyncio.run(main())


def test_timeout_raises_rpc_timeout_and_the_late_reply_is_ignored() -> None:
    async def main():
        async with serving(slow=slow) as (server, client):
            with pytest.raises(RpcTimeout, match=f"'slow' from {server.address}") as info:
                await client.call("slow", timeout=0.05, delay=0.2, value="late")
            assert isinstance(info.value, TimeoutError)
            await asyncio.sleep(0.25)  # the late reply arrives and must be dropped quietly
            assert await client.call("slow", timeout=1, delay=0, value="next") == "next"

    asyncio.run(main())


def test_close_fails_pending_calls() -> None:
    async def main():
        async with serving(slow=slow) as (_, client):
            call = asyncio.create_task(client.call("slow", delay=5))
            await asyncio.sleep(0.05)
            client.close()
            with pytest.raises(RpcError, match="client closed"):
                await call
            with pytest.raises(RpcError, match="client closed"):
                await client.call("slow", delay=0)

    asyncio.run(main())


def test_call_soon_reaches_the_server_logs_failures_and_close_cancels_it(caplog) -> None:
    """Fire and forget: the call arrives; a failure or a timeout is logged, never raised;
    close() cancels one still waiting for its reply, quietly."""
    caplog.set_level(logging.WARNING, logger="areal.comm")

    async def main():
        received: asyncio.Queue = asyncio.Queue()

        async def note(x: int) -> None:
            received.put_nowait(x)

        async with serving(note=note, fail=fail, slow=slow) as (server, client):
            client.call_soon("note", timeout=1, x=7)
            assert await asyncio.wait_for(received.get(), 1) == 7
            failing = client.call_soon("fail", timeout=1, msg="bad input 42")
            late = client.call_soon("slow", timeout=0.05, delay=1)
            # Never raised to anyone: the tasks end with the error, which is logged.
            await asyncio.wait([failing, late], timeout=2)
            assert isinstance(failing.exception(), RpcError)
            assert isinstance(late.exception(), RpcTimeout)
            waiting = client.call_soon("slow", timeout=5, delay=5)
            await asyncio.sleep(0.05)  # sent: waiting for its reply
            unsent = client.call_soon("slow", timeout=5, delay=5)  # not sent yet
            client.close()
            await asyncio.wait_for(asyncio.gather(waiting, unsent, return_exceptions=True), 1)
            assert unsent.cancelled() and waiting.done()
            return server.address

    address = asyncio.run(main())
    logged = [r.getMessage() for r in caplog.records if f" on {address} failed" in r.getMessage()]
    assert len(logged) == 2, logged  # the calls that close() ended say nothing
    assert any("'fail'" in m and "ValueError: bad input 42" in m for m in logged)
    assert any("'slow'" in m and "no reply" in m for m in logged)


def test_forged_and_corrupted_frames_are_dropped_logged_and_counted(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="areal.comm")

    async def main():
        async with serving(echo=echo) as (server, client):
            raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(server.address)
            try:
                request = {"id": 1, "method": "echo", "args": {"x": 1}}
                mac, body = wire.seal(request, KEY)
                await raw.send_multipart(wire.seal(request, b"another experiment's key"))
                await raw.send_multipart([mac, body[:-1] + bytes([body[-1] ^ 1])])
                await raw.send_multipart([body])
                await raw.send_multipart(wire.seal({"id": "x"}, KEY))  # signed but malformed
                # ZMQ keeps order per connection: once this is answered, all four were seen.
                await raw.send_multipart(wire.seal({**request, "id": 2}, KEY))
                reply = wire.unseal(await asyncio.wait_for(raw.recv_multipart(), 1), KEY)
                assert reply == {"id": 2, "ok": True, "result": {"x": 1}, "error": ""}
                assert await raw.poll(100) == 0  # and nothing was answered to the bad ones
            finally:
                raw.close()
            assert server.dropped == 4
            assert await client.call("echo", y=2) == {"y": 2}

    asyncio.run(main())
    drops = [r for r in caplog.records if r.name == "areal.comm" and "dropped" in r.message]
    assert len(drops) == 4 and all(r.levelno == logging.WARNING for r in drops)
    assert all("peer" in r.message for r in drops)
    assert sum("failed its HMAC check" in r.message for r in drops) == 2
    assert sum("expected 2 frames" in r.message for r in drops) == 1


def test_client_drops_forged_replies(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="areal.comm")

    async def main():
        router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        client = RpcClient(f"tcp://127.0.0.1:{port}", KEY)
        try:
            call = asyncio.create_task(client.call("echo", timeout=1))
            peer, *frames = await router.recv_multipart()
            rid = wire.unseal(frames, KEY)["id"]
            forged = {"id": rid, "ok": True, "result": "forged", "error": ""}
            await router.send_multipart([peer, *wire.seal(forged, b"wrong key")])
            real = {"id": rid, "ok": True, "result": "real", "error": ""}
            await router.send_multipart([peer, *wire.seal(real, KEY)])
            assert await call == "real"
            assert client.dropped == 1
        finally:
            client.close()
            router.close()

    asyncio.run(main())
    assert any("failed its HMAC check" in r.message for r in caplog.records)


@contextlib.contextmanager
def server_in_thread(**handlers):
    """An RpcServer serving on its own event loop in a background thread."""
    ready, box = threading.Event(), {}

    async def main():
        box["server"] = server = RpcServer(KEY)
        box["loop"] = asyncio.get_running_loop()
        for name, fn in handlers.items():
            server.register(name, fn)
        ready.set()
        await server.serve()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(2)
    try:
        yield box["server"]
    finally:
        box["loop"].call_soon_threadsafe(box["server"].close)
        thread.join(2)
        assert not thread.is_alive()


def test_sync_client_against_server_in_a_thread() -> None:
    with server_in_thread(echo=echo, slow=slow, fail=fail) as server:
        client = SyncRpcClient(server.address, KEY)
        try:
            out = client.call("echo", timeout=1, x=np.ones((2, 2), dtype=np.int64))
            assert out["x"].dtype == np.int64 and out["x"].sum() == 4
            with pytest.raises(RpcError, match="ValueError: boom"):
                client.call("fail", msg="boom")
            with pytest.raises(RpcTimeout, match=f"'slow' from {server.address}"):
                client.call("slow", timeout=0.05, delay=0.15, value="stale")
            assert client._sock.poll(10_000)  # the stale reply, queued ahead of the next one
            assert client.call("slow", timeout=1, delay=0, value="fresh") == "fresh"
        finally:
            client.close()


def test_registry_register_lookup_unregister(tmp_path) -> None:
    reg = Registry(tmp_path)
    reg.register("rollout", 0, "tcp://10.0.0.1:5000")
    reg.register("rollout", 1, "tcp://10.0.0.2:5000")
    reg.register("rollout", 0, "tcp://10.0.0.1:6000")  # a restarted role replaces its entry
    assert reg.lookup("rollout", 0) == "tcp://10.0.0.1:6000"
    assert reg.lookup_all("rollout", 2, timeout=1) == ["tcp://10.0.0.1:6000", "tcp://10.0.0.2:5000"]
    assert sorted(os.listdir(tmp_path / "registry" / "rollout")) == ["0", "1"]  # no temp files
    reg.unregister("rollout", 1)
    reg.unregister("rollout", 1)  # twice is fine
    with pytest.raises(TimeoutError):
        reg.lookup("rollout", 1, timeout=0)


def test_registry_lookup_waits_for_a_late_registration(tmp_path) -> None:
    reg = Registry(tmp_path)
    timer = threading.Timer(0.2, reg.register, args=("controller", 0, "tcp://h:1"))
    timer.start()
    start = time.monotonic()
    assert reg.lookup("controller", 0, timeout=2) == "tcp://h:1"
    assert time.monotonic() - start >= 0.15
    timer.join()


def test_registry_lookup_timeout_says_where_to_look(tmp_path) -> None:
    with pytest.raises(TimeoutError) as info:
        Registry(tmp_path).lookup("reward", 3, timeout=0.1)
    msg = str(info.value)
    assert "reward 3" in msg and str(tmp_path / "registry" / "reward" / "3") in msg
    assert "failed to start" in msg and str(tmp_path / "logs") in msg


def test_key_file_is_private_and_stable(tmp_path) -> None:
    old_umask = os.umask(0)  # the mode must not depend on a careful umask
    try:
        key = create_key(tmp_path)
    finally:
        os.umask(old_umask)
    path = tmp_path / "registry" / "key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(key) == 32 and load_key(tmp_path) == key
    assert create_key(tmp_path) == key  # a second create returns the existing key
    assert os.listdir(path.parent) == ["key"]


def test_missing_key_says_how_to_create_it(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="python -m areal.train, which creates it"):
        load_key(tmp_path)
