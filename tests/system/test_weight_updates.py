"""Weight loads that fail, against a real embedded server: a load that outlives
inference.update_timeout_s is retried (the server frozen with SIGSTOP), and a server that
refuses a version inference.update_retries times counts as dead: its samples come back
unfinished and its worker, unable to bring it to the latest version, finally gives up."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest

from areal.models.tiny import make_tiny_model
from areal.rollout.launch import start_embedded_server
from areal.rollout.worker import RolloutWorker
from tests.system.conftest import READY, copy_weights
from tests.system.test_run import _wait_for

SAMPLING = {"max_new_tokens": 4, "ignore_eos": True, "temperature": 1.0}


@pytest.fixture
def served(tmp_path):
    """A server that loads weights only from under tmp_path/allowed; the model's copies."""
    model = make_tiny_model(tmp_path / "allowed/v0", warmup_steps=0)
    inside = copy_weights(model, tmp_path / "allowed/v1", lambda t: t["model.norm.weight"].mul_(2))
    outside = copy_weights(model, tmp_path / "outside", lambda t: None)
    log = tmp_path / "server.log"
    roots = ("--weights-root", str(tmp_path / "allowed"))
    proc, url = start_embedded_server(model, log, "--weight-version", "0", *roots)
    try:
        _wait_for(lambda: READY.format(url=url) in log.read_text(), 120, "the server")
        yield proc, url, inside, outside
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=30)


def test_a_load_past_the_update_timeout_is_retried(served, caplog):
    proc, url, inside, _ = served
    caplog.set_level(logging.WARNING, logger="areal.rollout")

    async def body():
        worker = RolloutWorker(url, update_timeout_s=1.0, update_retries=3)
        try:
            os.kill(proc.pid, signal.SIGSTOP)  # frozen: no answer to the first attempt
            asyncio.get_running_loop().call_later(2.5, os.kill, proc.pid, signal.SIGCONT)
            return await asyncio.wait_for(worker.update_weights(1, str(inside)), 60)
        finally:
            await worker.client.close()

    assert asyncio.run(body()) == {"version": 1, "loaded": True, "alive": True}
    assert "loading version 1, attempt 1/3 failed: no answer within 1 s" in caplog.text
    assert "attempt 3/3" not in caplog.text


def test_a_server_that_keeps_refusing_counts_as_dead(served, caplog):
    _, url, _, outside = served
    caplog.set_level(logging.WARNING, logger="areal.rollout")

    async def body():
        fatal = asyncio.get_running_loop().create_future()
        worker = RolloutWorker(
            url, update_retries=2, update_timeout_s=30, recovery_timeout_s=5,
            on_fatal=fatal.set_result,
        )  # fmt: skip
        try:
            before = await worker.generate(0, [1, 2, 3], 2, SAMPLING, 0)
            reply = await asyncio.wait_for(worker.update_weights(1, str(outside)), 60)
            after = await worker.generate(1, [1, 2, 3], 2, SAMPLING, 0)
            return before, reply, after, await asyncio.wait_for(fatal, 60)
        finally:
            await worker.client.close()

    before, reply, after, fatal = asyncio.run(body())
    assert all(t["finish_reason"] == "length" for t in before)
    assert reply == {"version": 0, "loaded": False, "alive": False}
    assert "loading version 1, attempt 2/2 failed" in caplog.text
    assert "is not under any directory this server loads weights from" in caplog.text
    assert "is down (it refused version 1 2 times" in caplog.text
    # Down: new samples come back unfinished, for the controller to resume elsewhere.
    assert all(t["finish_reason"] == "" and len(t["output_ids"]) == 0 for t in after)
    # It never holds the latest version: recovery gives up, and the worker's process ends.
    assert isinstance(fatal, TimeoutError)
