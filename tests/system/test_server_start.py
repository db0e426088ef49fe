"""Starting inference servers: the standalone embedded server, start failures that explain
themselves (command line and log tail), and a server killed under a pending request."""

from __future__ import annotations

import asyncio
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal.comm.net import free_port
from areal.models.tiny import make_tiny_model
from areal.rollout.client import SGLangClient
from areal.rollout.inference import ServerDied
from areal.rollout.launch import (
    ServerStartError,
    start_embedded_server,
    start_server_process,
    wait_for_server,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", warmup_steps=0)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=20)


def test_help_names_every_option():
    out = subprocess.run(
        [sys.executable, "-m", "areal.rollout.server", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0
    for option in ("--model", "--port", "--host", "--max-batch-size", "--weight-version"):
        assert option in out.stdout


def test_standalone_server_then_killed_mid_request(model_dir, tmp_path):
    """`python -m areal.rollout.server --model DIR --port N` serves alone; when it dies under
    a pending generate, the client fails at once with ServerDied naming the URL."""
    port = free_port("127.0.0.1")
    cmd = [sys.executable, "-m", "areal.rollout.server", "--model", str(model_dir)]
    cmd += ["--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    proc = start_server_process(cmd, tmp_path / "server.log")

    async def body():
        client = SGLangClient(url, timeout=120)
        try:
            await wait_for_server(client, 90, tmp_path / "server.log", proc)
            params = {"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True}
            out = await client.generate([1, 2, 3], params)
            assert len(out.output_ids) == 5 and out.weight_version == 0
            long = {"max_new_tokens": 100_000, "temperature": 1.0, "ignore_eos": True}
            pending = asyncio.create_task(client.generate([1, 2, 3], long, rid="doomed"))
            deadline = time.monotonic() + 30
            while (await client.server_info())["num_running_reqs"] < 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(ServerDied) as info:
                await asyncio.wait_for(pending, 30)
            assert time.monotonic() - started < 15
            assert url in str(info.value) and "POST /generate" in str(info.value)
            assert isinstance(info.value, ConnectionError) and info.value.url == url
            # A call to the dead server: refused, the same error.
            with pytest.raises(ServerDied, match="POST /flush_cache"):
                await client.flush_cache()
        finally:
            await client.close()

    try:
        asyncio.run(body())
    finally:
        _stop(proc)


def test_server_that_exits_at_once_shows_command_and_log(tmp_path):
    log = tmp_path / "server.log"
    proc, url = start_embedded_server(tmp_path / "no_model_here", log)

    async def body():
        client = SGLangClient(url)
        try:
            started = time.monotonic()
            with pytest.raises(ServerStartError) as info:
                await wait_for_server(client, 60, log, proc)
            assert time.monotonic() - started < 30
            return str(info.value)
        finally:
            await client.close()

    try:
        message = asyncio.run(body())
    finally:
        _stop(proc)
    assert "exited with code 1" in message
    assert f"server command: {shlex.join(proc.args)}" in message
    assert f"cannot load the model from {tmp_path / 'no_model_here'}" in message


def test_server_never_healthy_shows_command_and_log(tmp_path):
    log = tmp_path / "server.log"
    script = "print('loading shards 3/7', flush=True); import time; time.sleep(60)"
    cmd = [sys.executable, "-c", script]
    proc = start_server_process(cmd, log)
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"

    async def body():
        client = SGLangClient(url)
        try:
            deadline = time.monotonic() + 30
            while "loading shards" not in log.read_text():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            with pytest.raises(ServerStartError) as info:
                await wait_for_server(client, 1.0, log, proc)
            return str(info.value)
        finally:
            await client.close()

    try:
        message = asyncio.run(body())
    finally:
        _stop(proc)
    assert f"{url} was not healthy after 1 s" in message
    assert f"server command: {shlex.join(cmd)}" in message
    assert message.rstrip().endswith("loading shards 3/7")
