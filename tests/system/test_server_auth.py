"""An embedded server with the run's API key (SGLang's --api-key semantics) and weight roots:
a request without `Authorization: Bearer KEY` gets 401 and is logged with a count; weights
load only from under the roots; `areal.eval --server-url` sends the key it is given."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from areal.models.tiny import make_tiny_model
from areal.rollout.client import SGLangClient
from tests.system.conftest import copy_weights, embedded_server

KEY = "k" * 32
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("auth")
    model = make_tiny_model(base / "allowed/model", warmup_steps=0)
    return {"base": base, "model": model, "allowed": base / "allowed", "log": base / "s.log"}


@pytest.fixture(scope="module")
def server(dirs):
    roots = ("--weights-root", str(dirs["allowed"]))
    with embedded_server(dirs["model"], dirs["log"], *roots, api_key=KEY) as url:
        yield url


async def status(method: str, url: str, headers: dict | None = None, **kw) -> int:
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.request(method, url, **kw) as resp:
            return resp.status


def test_requests_without_the_key_get_401_and_are_counted(server, dirs):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    wrong = {"Authorization": "Bearer " + "x" * 32}

    async def go():
        return [
            await status("POST", server + "/generate", json=body),
            await status("POST", server + "/generate", wrong, json=body),
            await status("POST", server + "/update_weights_from_disk", json={"model_path": "/"}),
            await status("GET", server + "/get_server_info"),
            await status("GET", server + "/health"),  # a liveness probe needs no key
            await status("GET", server + "/get_server_info", {"Authorization": f"Bearer {KEY}"}),
        ]

    assert asyncio.run(go()) == [401, 401, 401, 401, 200, 200]
    log = dirs["log"].read_text()
    assert "unauthorized request 4: GET /get_server_info" in log
    assert "wrong key" in log and "no Authorization header" in log and KEY not in log

    async def with_client():
        client = SGLangClient(server, timeout=60, api_key=KEY)
        try:
            return await client.generate([1, 2, 3], {"max_new_tokens": 3, "ignore_eos": True})
        finally:
            await client.close()

    assert len(asyncio.run(with_client()).output_ids) == 3


def test_weights_load_only_from_under_its_roots(server, dirs):
    inside = copy_weights(dirs["model"], dirs["allowed"] / "v1", lambda t: None)
    outside = copy_weights(dirs["model"], dirs["base"] / "elsewhere", lambda t: None)
    (dirs["allowed"] / "link").symlink_to(outside)  # a link out of the root is outside too

    async def go():
        client = SGLangClient(server, timeout=60, api_key=KEY)
        try:
            refused = []
            for path in (outside, dirs["allowed"] / "link", dirs["allowed"] / "../elsewhere"):
                with pytest.raises(RuntimeError) as info:
                    await client.update_weights_from_disk(str(path), 7)
                refused.append(str(info.value))
            held = (await client.server_info())["weight_version"]
            await client.update_weights_from_disk(str(inside), 1)
            return refused, held, (await client.server_info())["weight_version"]
        finally:
            await client.close()

    refused, held, loaded = asyncio.run(go())
    assert all("is not under any directory this server loads weights from" in r for r in refused)
    assert str(held) == "0" and str(loaded) == "1"


def test_eval_with_server_url_sends_the_key(server, dirs, tmp_path):
    def run_eval(*extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "areal.eval", "--model", str(dirs["model"])]
        cmd += ["--data", str(ROOT / "tests/data/math_sample.json"), "--n-samples", "2"]
        cmd += ["--k", "1,2", "--max-new-tokens", "4", "--max-problems", "2"]
        cmd += ["--server-url", server, "--output", str(tmp_path / "r.json"), *extra]
        env = {k: v for k, v in os.environ.items() if k != "AREAL_API_KEY"}
        return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)

    denied = run_eval()
    assert denied.returncode == 1 and "HTTP 401" in denied.stderr, denied.stderr[-2000:]
    ok = run_eval("--api-key", KEY)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads((tmp_path / "r.json").read_text())["reward_counts"]["graded"] == 4
