"""The agent process (areal/workflow/agent_process.py), in process: every async episode on one
loop, plain functions on threads, one connection pool that an agent cannot close for the
others, and a watchdog that names an episode blocking the loop. (Whole agent processes:
tests/system/test_agent_*.py.)"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from areal.workflow.agent_process import _Host

pytest.importorskip("openai")

URL = "http://127.0.0.1:9/v1"  # nothing listens: these agents make no call


def serve(run, episodes: list[tuple[str, dict]], blocked_s: float = 5.0, before=None) -> list:
    """The replies of episodes run concurrently on one host, its watchdog on."""

    async def body():
        host = _Host(run, URL, timeout_s=10.0, blocked_s=blocked_s)
        watchdog = asyncio.create_task(host.watchdog.run())
        try:
            tasks = [asyncio.create_task(host.episode(i, d, token=i)) for i, d in episodes]
            if before is not None:
                await before(host)
            replies = await asyncio.gather(*tasks)
            await asyncio.sleep(blocked_s)  # the watchdog sees the loop run again
            return replies, host.watchdog.stalls
        finally:
            watchdog.cancel()
            await host.runner.aclose()

    return asyncio.run(body())


async def _loop_of(data, client):
    await asyncio.sleep(0.01)
    return {"loop": id(asyncio.get_running_loop()), "key": client.api_key}


def test_async_episodes_share_one_loop_and_each_client_carries_its_token():
    replies, stalls = serve(_loop_of, [(f"t{i}", {}) for i in range(6)], blocked_s=0.5)
    loops = {r["result"]["loop"] for r in replies}
    assert len(loops) == 1 and stalls == 0
    assert [r["result"]["key"] for r in replies] == [f"t{i}" for i in range(6)]


def _sync(data, client):
    start = time.monotonic()
    time.sleep(0.6)  # e.g. requests.get, LangChain's invoke
    return {
        "start": start,
        "end": time.monotonic(),
        "thread": threading.get_ident(),
        "sync": type(client).__name__ == "OpenAI" and client.api_key == data["token"],
    }


def test_a_plain_function_runs_on_a_thread_with_a_synchronous_client():
    replies, stalls = serve(_sync, [("a", {"token": "a"}), ("b", {"token": "b"})], blocked_s=0.5)
    a, b = (r["result"] for r in replies)
    assert a["sync"] and b["sync"] and a["thread"] != b["thread"]
    assert max(a["start"], b["start"]) < min(a["end"], b["end"])  # they slept at once
    assert stalls == 0  # and the loop ran on


async def _closes(data, client):
    if data["close"]:
        async with client:  # closes the client, as the openai docs show
            pass
        return 0.0
    await asyncio.sleep(0.05)
    return float(client.is_closed())


def test_an_agent_closing_its_client_closes_nothing_of_the_others():
    replies, _ = serve(_closes, [("a", {"close": True}), ("b", {"close": False})], 0.1)
    assert [r["result"] for r in replies] == [0.0, 0.0]


async def _blocks(data, client):
    time.sleep(0.8)  # a blocking call in an async agent
    return 1.0


def test_the_watchdog_names_the_episode_that_blocks_the_loop(caplog):
    with caplog.at_level(logging.WARNING, logger="areal.workflow"):
        replies, stalls = serve(_blocks, [("a", {"prompt": "3+4="})], blocked_s=0.2)
    assert replies == [{"result": 1.0}] and stalls == 1
    blocked, resumed = (r.getMessage() for r in caplog.records)
    assert (
        "has not run for" in blocked and "episode 1 (data {'prompt': '3+4='}), one of 1" in blocked
    )
    assert f"{__file__}:" in blocked and "in _blocks" in blocked and "def run(data" in blocked
    assert "runs again after" in resumed


async def _waits(data, client):
    await asyncio.sleep(30)
    return 1.0


def test_a_cancelled_episode_ends_and_a_cancel_before_its_start_is_kept():
    async def cancel(host):
        await asyncio.sleep(0.05)
        await host.cancel("a")

    start = time.monotonic()
    replies, _ = serve(_waits, [("a", {})], 0.1, before=cancel)
    assert replies == [{"error": "cancelled", "traceback": ""}]
    assert time.monotonic() - start < 5

    async def early():
        host = _Host(_waits, URL, timeout_s=10.0)
        await host.cancel("b")
        return await host.episode("b", {}, token="b")

    assert asyncio.run(early()) == {"error": "cancelled", "traceback": ""}
