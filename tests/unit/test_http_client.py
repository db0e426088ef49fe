"""HttpClient against real HTTP servers on loopback: a connection the server closed while it
sat idle is not a dead server, a failure on a fresh connection is.

The server runs on a thread of its own, so the test can block the client's event loop
until the server's FIN has arrived (past its keep-alive): the client then has not yet read
it when it sends, which is how a busy rollout worker meets a closed connection.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web

from areal.rollout import http_client
from areal.rollout.http_client import HttpClient
from areal.rollout.inference import ServerDied


class LoopbackServer:
    """An aiohttp server on its own thread: POST /generate answers {"n": requests so far};
    `peers` holds the client port of each request (one port per connection)."""

    def __init__(self, keepalive_s: float = 75.0, answer: bool = True) -> None:
        self.keepalive_s = keepalive_s
        self.answer = answer
        self.peers: list[int] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = self._run(self._start())

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    async def _start(self) -> int:
        if not self.answer:  # reads the request, closes the connection without a word

            async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                self.peers.append(writer.get_extra_info("peername")[1])
                await reader.read(1)
                writer.close()

            self.server = await asyncio.start_server(drop, "127.0.0.1", 0)
            return self.server.sockets[0].getsockname()[1]

        async def generate(request: web.Request) -> web.Response:
            self.peers.append(request.transport.get_extra_info("peername")[1])
            await request.read()
            return web.json_response({"n": len(self.peers)})

        app = web.Application()
        app.router.add_post("/generate", generate)
        self.runner = web.AppRunner(app, keepalive_timeout=self.keepalive_s)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return self.runner.addresses[0][1]

    async def _stop(self) -> None:
        if self.answer:
            await self.runner.cleanup()
        else:
            self.server.close()
            await self.server.wait_closed()

    def stop(self) -> None:
        if self.thread.is_alive():
            self._run(self._stop())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def closed_by_peer(local_port: int, remote_port: int) -> bool:
    """The kernel holds this end of a loopback connection in CLOSE_WAIT: the peer's FIN has
    arrived and this process has not read it (Linux's /proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, remote, state = line.split()[1:4]
        ports = int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)
        if ports == (local_port, remote_port):
            return state == "08"  # TCP_CLOSE_WAIT
    return False


@pytest.fixture
def servers():
    made: list[LoopbackServer] = []

    def make(**kwargs) -> LoopbackServer:
        made.append(LoopbackServer(**kwargs))
        return made[-1]

    yield make
    for s in made:
        s.stop()


def test_the_client_drops_idle_connections_before_uvicorn_does():
    # uvicorn (vLLM's and SGLang's server) closes a connection idle for 5 s.
    assert http_client.KEEPALIVE_S <= 2.5


def test_a_request_on_a_connection_the_server_closed_is_sent_again(servers, caplog):
    server = servers(keepalive_s=0.2)
    client = HttpClient(server.url)

    async def main() -> list:
        first = await client._call("POST", "/generate", {})
        # A busy loop (no await) until the server has closed the idle connection.
        deadline = time.monotonic() + 10
        while not closed_by_peer(server.peers[0], server.port):
            assert time.monotonic() < deadline, "the server kept the idle connection"
            time.sleep(0.01)
        second = await client._call("POST", "/generate", {})
        await client.close()
        return [first, second]

    with caplog.at_level("DEBUG", logger="areal.rollout"):
        assert asyncio.run(main()) == [{"n": 1}, {"n": 2}]
    assert "was closed before the answer" in caplog.text, "the closed one was not met"
    assert len(set(server.peers)) == 2  # the second request came on a fresh connection


def test_a_server_that_closes_fresh_connections_unanswered_is_dead_after_a_few(servers):
    """Accepted and closed, again and again: not a keep-alive race but a broken server."""
    server = servers(answer=False)
    client = HttpClient(server.url)

    async def main() -> None:
        try:
            await client._call("POST", "/generate", {})
        finally:
            await client.close()

    with pytest.raises(ServerDied, match="ServerDisconnectedError"):
        asyncio.run(main())
    assert len(server.peers) == 1 + http_client.FRESH_TRIES  # and no more


def test_a_server_gone_while_its_connection_sat_idle_is_dead(servers):
    server = servers()
    client = HttpClient(server.url)

    async def main() -> None:
        await client._call("POST", "/generate", {})
        server.stop()  # blocks this loop: the client has not read the FIN when it sends
        try:
            await client._call("POST", "/generate", {})
        finally:
            await client.close()

    # Sent again on a fresh connection, which is refused: that failure is the verdict.
    with pytest.raises(ServerDied, match="ClientConnectorError"):
        asyncio.run(main())


def test_idle_connections_are_reused_within_the_keepalive_only(servers, monkeypatch):
    monkeypatch.setattr(http_client, "KEEPALIVE_S", 0.3)
    server = servers()  # keeps connections 75 s
    client = HttpClient(server.url)

    async def main() -> None:
        # Idle gaps are what is under test: within, past, within the client's 0.3 s.
        for gap in (0, 0.05, 0.6, 0.05):
            time.sleep(gap)
            await client._call("POST", "/generate", {})
        await client.close()

    asyncio.run(main())
    a, b, c, d = server.peers
    assert a == b and b != c and c == d
