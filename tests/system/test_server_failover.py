"""A dead inference server: its samples resume elsewhere, it comes back, nothing is lost.

The worker test drives the real rollout worker against real server processes and kills
one mid-generation; the run test kills a server of a two-server run under the launcher. A
server alive but closing idle connections quickly is never taken for a dead one.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

from transformers import AutoTokenizer

from areal.checkpoint import latest
from areal.comm.wire import unpack
from areal.config import load_config
from areal.data.dataset import load_rows
from areal.models.tiny import chat_prompt_ids, make_tiny_model
from areal.rollout.auth import api_key, auth_header
from areal.rollout.launch import start_embedded_server
from areal.rollout.worker import RolloutWorker
from areal.trajectory import Trajectory
from tests.system.conftest import READY, copy_weights
from tests.system.test_run import (
    _wait_for,
    cmdline,
    launched,
    processes_mentioning,
    read_metrics,
    run_train,
)

N_NEW = 200
SAMPLING = {"max_new_tokens": N_NEW, "ignore_eos": True, "temperature": 1.0}


def start_server(model_dir: Path, log_path: Path):
    proc, url = start_embedded_server(model_dir, log_path, "--weight-version", "0")
    _wait_for(lambda: READY.format(url=url) in log_path.read_text(), 90, f"server at {url}")
    return proc, url


async def wait_generated(worker: RolloutWorker, n: int, timeout: float = 60) -> None:
    target = (await worker.client.server_info())["total_generated_tokens"] + n
    deadline = asyncio.get_running_loop().time() + timeout
    while (await worker.client.server_info())["total_generated_tokens"] < target:
        assert asyncio.get_running_loop().time() < deadline, f"{n} tokens not generated"
        await asyncio.sleep(0.01)


def test_worker_returns_partial_samples_of_a_dead_server_and_recovers(tmp_path):
    model = make_tiny_model(tmp_path / "v0", warmup_steps=0)
    v1 = copy_weights(model, tmp_path / "v1", lambda t: t["model.norm.weight"].mul_(3.0))
    v2 = copy_weights(model, tmp_path / "v2", lambda t: t["model.norm.weight"].mul_(0.4))
    prompt = chat_prompt_ids(AutoTokenizer.from_pretrained(model), "What is 1 plus 2?")
    first, url = start_server(model, tmp_path / "first.log")
    current = {"url": url}
    procs = [first]

    async def body():
        worker = RolloutWorker(url, find_server=lambda: current["url"])
        try:
            running = asyncio.create_task(worker.generate(3, prompt, 4, SAMPLING, 0))
            # A server's tokens reach the worker when a request ends: an update's abort
            # hands back what each sample has so far; a killed server's tokens are lost.
            await wait_generated(worker, 40)
            await worker.update_weights(1, str(v1))
            await wait_generated(worker, 40)
            first.send_signal(signal.SIGKILL)
            partial = [Trajectory.from_wire(w) for w in await asyncio.wait_for(running, 30)]
            # The server is down: weights asked for now are loaded once it is back.
            reply = await worker.update_weights(2, str(v2))
            refused = [
                Trajectory.from_wire(w) for w in await worker.generate(4, prompt, 2, SAMPLING, 0)
            ]
            # The launcher's part: a new server process, on another port.
            proc, current["url"] = start_server(model, tmp_path / "second.log")
            procs.append(proc)
            back = await asyncio.wait_for(worker.wait_ready(), 60)
            resumed = await worker.generate(
                3, prompt, 0, SAMPLING, 0, partial=[t.to_wire() for t in partial]
            )
            return partial, reply, refused, back, [Trajectory.from_wire(w) for w in resumed]
        finally:
            await worker.client.close()

    try:
        partial, reply, refused, back, resumed = asyncio.run(body())
    finally:
        for p in procs:
            p.kill()
            p.wait()
    # Killed mid-generation: every sample comes back unfinished, with what it had so far.
    assert all(t.finish_reason == "" for t in partial)
    assert all(0 < len(t.output_ids) < N_NEW and set(t.versions) == {0} for t in partial)
    assert reply == {"version": 1, "loaded": False, "alive": False}
    assert all(t.finish_reason == "" and t.output_ids == [] for t in refused)
    # Back on the new server, which loaded version 2 before serving.
    assert back == {"version": 2}
    for before, after in zip(partial, resumed, strict=True):
        assert after.finish_reason == "length" and len(after.output_ids) == N_NEW
        assert after.output_ids[: len(before.output_ids)] == before.output_ids
        n_before = len(before.output_ids)
        assert after.versions == [0] * n_before + [2] * (N_NEW - n_before)


def running_requests(url: str, exp_dir: Path) -> int:
    headers = auth_header(api_key(exp_dir))  # the run's servers want its key
    request = urllib.request.Request(url + "/get_server_info", headers=headers)
    with urllib.request.urlopen(request, timeout=5) as resp:
        return json.load(resp)["num_running_reqs"]


def test_a_run_survives_a_killed_server_and_loses_no_prompt(tmp_path):
    """Two servers; one is killed mid-run. The launcher restarts it, its samples resume on
    the other, it comes back, and every prompt taken from the dataset is trained, ready or
    queued again."""
    exp_dir = tmp_path / "tiny/failover"
    overrides = (
        "total_train_steps=100000", "trial_name=failover", "rollout.n_servers=2",
        "trainer.save_freq_steps=3",
    )  # fmt: skip
    controller_log = exp_dir / "logs/controller0.log"
    with launched(tmp_path, *overrides) as launcher:
        _wait_for(
            lambda: (exp_dir / "metrics.jsonl").exists() and len(read_metrics(exp_dir)) >= 3,
            240,
            "three training steps",
        )
        url = (exp_dir / "registry/server/0").read_text()
        port = url.rsplit(":", 1)[1]
        victims = [
            p for p in processes_mentioning(str(tmp_path))
            if "areal.rollout.server" in cmdline(p) and f"--port {port} " in cmdline(p) + " "
        ]  # fmt: skip
        assert len(victims) == 1, victims
        # Killed while requests are in flight on it. The tiny task's answers take a decode
        # step or two, so a server seen generating has often finished by the kill: stopped
        # first, it holds every call the router sends it meanwhile.
        _wait_for(lambda: running_requests(url, exp_dir) >= 4, 60, "requests on server 0")
        os.kill(victims[0], signal.SIGSTOP)
        time.sleep(1.0)
        os.kill(victims[0], signal.SIGKILL)
        _wait_for(lambda: "inference server 0 is back" in controller_log.read_text(), 120, "back")
        # A few steps with both servers again, and a checkpoint taken after them.
        n_back = len(read_metrics(exp_dir))
        _wait_for(lambda: getattr(latest(exp_dir), "version", 0) >= n_back + 6, 120, "a checkpoint")
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=60)
    assert "role server0 was killed by SIGKILL; restarting it (1/3)" in err, err[-3000:]
    assert "inference server 0 is down" in controller_log.read_text()
    metrics = read_metrics(exp_dir)
    assert [m["version"] for m in metrics] == list(range(1, len(metrics) + 1))
    assert all(m["staleness/max"] <= 4 for m in metrics)
    assert sum(m["rollout/resubmitted"] for m in metrics) > 0
    assert min(m["rollout/servers_alive"] for m in metrics) == 1
    assert metrics[-1]["rollout/servers_alive"] == 2
    # Every serving server holds trained weights, none newer than the trainer's.
    assert 0 < metrics[-1]["rollout/server_version_min"] <= metrics[-1]["version"]
    # No prompt lost or counted twice: every prompt taken is trained, ready, or queued to
    # be generated again, in the controller state of a checkpoint taken after the failure.
    cfg = load_config(exp_dir / "config.yaml")
    ckpt = latest(exp_dir)
    assert ckpt.version >= n_back + 6
    state = unpack(ckpt.controller_state.read_bytes())
    taken = state["epoch"] * len(load_rows(cfg.dataset, cfg.seed)) + state["pos"]
    trained = ckpt.version * cfg.trainer.batch_size
    assert taken == trained + len(state["buffer"]["groups"]) + len(state["retry"])
    _wait_for(lambda: processes_mentioning(str(tmp_path)) == [], 10, "no orphans")


def test_a_server_that_closes_idle_connections_is_never_down(tmp_path):
    """A server that closes connections idle for 0.1 s (vLLM's and SGLang's uvicorn: 5 s)
    loses nothing: a request that meets a connection it has just closed is sent again on a
    fresh one, so no server is declared down and no sample is resubmitted. (Measured with a
    client that took such a failure for a death: 6 "is down" and 712 resubmitted samples in
    60 steps.)"""
    steps = 60
    proc = run_train(
        tmp_path, f"total_train_steps={steps}", "trial_name=keepalive",
        "inference.server_keepalive_s=0.1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    exp_dir = tmp_path / "tiny/keepalive"
    assert "--keepalive-s 0.1" in (exp_dir / "logs/server0.log").read_text().splitlines()[0]
    metrics = read_metrics(exp_dir)
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    assert sum(m["rollout/resubmitted"] for m in metrics) == 0
    assert all(m["rollout/servers_alive"] == 1 for m in metrics)
    logs = "".join(p.read_text() for p in (exp_dir / "logs").glob("*.log"))
    assert " is down" not in logs
