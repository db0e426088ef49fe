"""Interruptible generation through the real rollout worker and a real server process.

Weight updates land while long generations run. Each trajectory must come back whole,
its tokens tagged with the version of the weights that produced them, and each token's
behaviour log-prob must be the one those weights give it (checked against transformers).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from areal import weight_group
from areal.comm.net import free_port
from areal.models.tiny import chat_prompt_ids, make_tiny_model
from areal.rollout.sglang_api import DELTA
from areal.rollout.worker import RolloutWorker
from areal.trajectory import Trajectory
from tests.system.conftest import copy_weights, embedded_server, ref_logprobs

N_NEW = 200
SAMPLING = {"max_new_tokens": N_NEW, "ignore_eos": True, "temperature": 1.0}


@pytest.fixture(scope="module")
def versions(tmp_path_factory) -> list[Path]:
    """Weights of versions 0, 1, 2: each a visibly different policy."""
    root = tmp_path_factory.mktemp("weights")
    v0 = make_tiny_model(root / "v0", warmup_steps=0)

    def scaled(factor: float):
        def edit(tensors):
            tensors["model.norm.weight"] = tensors["model.norm.weight"] * factor

        return edit

    return [
        v0,
        copy_weights(v0, root / "v1", scaled(3.0)),
        copy_weights(v0, root / "v2", scaled(0.4)),
    ]


@pytest.fixture(scope="module")
def server(versions, tmp_path_factory):
    with embedded_server(versions[0], tmp_path_factory.mktemp("logs") / "server.log") as url:
        yield url


def prompt(versions, i: int) -> list[int]:
    from transformers import AutoTokenizer

    return chat_prompt_ids(AutoTokenizer.from_pretrained(versions[0]), f"What is {i} plus 2?")


async def generated_tokens(worker: RolloutWorker) -> int:
    return (await worker.client.server_info())["total_generated_tokens"]


async def wait_generated(worker: RolloutWorker, n: int) -> None:
    """Until the server has generated n more tokens: progress, not time, paces the test."""
    target = await generated_tokens(worker) + n
    while await generated_tokens(worker) < target:
        await asyncio.sleep(0.01)


async def broadcast_update(
    worker: RolloutWorker, version: int, path: Path, new: bool, held: Path | None = None
) -> None:
    """The worker receives `version` (path's weights) by broadcast, this process the trainer:
    the controller's part (the group, the buckets) and the trainer's (joining, sending).
    held: the weights the server holds, to send deltas against (weights.delta)."""
    tensors = sorted(load_file(path / "model.safetensors").items())
    if held is not None:
        old = load_file(held / "model.safetensors")
        tensors = [e for n, t in tensors for e in weight_group.encode_delta(n, t, old[n])]
        assert sum(t.numel() for _, t in tensors) < 0.01 * sum(t.numel() for t in old.values())
    buckets = list(weight_group.buckets(tensors, 20_000))
    assert len(buckets) > 1 or held is not None
    group = {
        "group_name": "g", "world_size": 2, "rank": 1, "new": new, "backend": "gloo",
        "master_address": "127.0.0.1", "master_port": broadcast_update.port, "timeout_s": 60,
    }  # fmt: skip
    receiving = worker.update_weights(
        version, str(path.parent / "v0"), disk_version=0,
        broadcast={
            "group": group,
            "buckets": [weight_group.spec(b) for b in buckets],
            "load_format": None if held is None else DELTA,
        },
    )  # fmt: skip

    def send() -> None:
        if new:
            broadcast_update.group = weight_group.open_group(
                backend="gloo", master_address="127.0.0.1", master_port=group["master_port"],
                rank=0, world_size=2, group_name="g", timeout_s=60,
            )  # fmt: skip
        for b in buckets:
            weight_group.send(broadcast_update.group, [t for _, t in b])

    reply, _ = await asyncio.gather(receiving, asyncio.to_thread(send))
    assert reply == {"version": version, "loaded": True, "alive": True}


@pytest.mark.parametrize("transport", ["disk", "distributed"])
def test_updates_interrupt_generation_and_tokens_keep_their_version(server, versions, transport):
    async def update(worker: RolloutWorker, v: int) -> None:
        if transport == "disk":
            await worker.update_weights(v, str(versions[v]))
        else:
            # v2 as a delta against v1 (only model.norm.weight differs)
            held = versions[1] if v == 2 else None
            await broadcast_update(worker, v, versions[v], new=v == 1, held=held)

    async def body() -> tuple[list[Trajectory], dict]:
        worker = RolloutWorker(server, interruptible=True)
        broadcast_update.port = free_port("127.0.0.1")
        try:
            await worker.client.update_weights_from_disk(str(versions[0]), 0)  # from v0
            running = asyncio.create_task(
                worker.generate(7, prompt(versions, 1), 4, SAMPLING, start_version=0)
            )
            for v in (1, 2):
                await wait_generated(worker, 4 * 15)  # about 15 tokens each per version
                assert not running.done(), "generation ended before the update: raise N_NEW"
                await update(worker, v)
            trajs = [Trajectory.from_wire(w) for w in await asyncio.wait_for(running, 120)]
            if transport == "distributed":
                broadcast_update.group.close()
                await worker.client.destroy_weights_update_group("g")
            return trajs, await worker.stats()
        finally:
            await worker.client.close()

    trajs, stats = asyncio.run(body())
    assert stats["n_interrupted"] == 2 * 4  # both updates caught all four samples in flight
    models = [AutoModelForCausalLM.from_pretrained(v, dtype=torch.float32).eval() for v in versions]
    for t in trajs:
        assert (t.group_id, t.finish_reason, t.n_interrupts) == (7, "length", 2)
        assert len(t.output_ids) == len(t.logprobs) == len(t.versions) == N_NEW
        # Versions only go up along a trajectory, and all three produced some of its tokens.
        assert t.versions == sorted(t.versions) and set(t.versions) == {0, 1, 2}
        # Each token's behaviour log-prob is what its own version's weights give it...
        by_version = torch.stack(
            [ref_logprobs(m, t.prompt_ids, t.output_ids, 1.0) for m in models]
        )  # [3, N_NEW]
        tags = torch.tensor(t.versions)
        expected = by_version[tags, torch.arange(N_NEW)]
        assert torch.allclose(torch.tensor(t.logprobs), expected, atol=1e-4, rtol=0)
        # ...and not what the other versions would have given it.
        other = by_version[(tags + 1) % 3, torch.arange(N_NEW)]
        assert (torch.tensor(t.logprobs) - other).abs().max() > 1e-2


def test_non_interruptible_update_waits_for_generation(server, versions):
    async def body() -> tuple[list[Trajectory], list[Trajectory]]:
        worker = RolloutWorker(server, interruptible=False)
        try:
            await worker.update_weights(5, str(versions[1]))  # nothing in flight: at once
            running = asyncio.create_task(
                worker.generate(3, prompt(versions, 2), 2, SAMPLING, start_version=5)
            )
            await wait_generated(worker, 2 * 15)
            assert not running.done()
            await worker.update_weights(6, str(versions[2]))  # drains first
            assert running.done(), "the update returned before in-flight requests finished"
            before = [Trajectory.from_wire(w) for w in running.result()]
            after = await worker.generate(4, prompt(versions, 2), 2, SAMPLING, start_version=6)
            return before, [Trajectory.from_wire(w) for w in after]
        finally:
            await worker.client.close()

    before, after = asyncio.run(body())
    for t in before:
        assert (t.n_interrupts, t.finish_reason, len(t.output_ids)) == (0, "length", N_NEW)
        assert set(t.versions) == {5}
    assert all(set(t.versions) == {6} for t in after)


def test_an_abandoned_call_is_aborted_on_the_server_and_not_resumed(server, versions):
    """The controller abandons a call whose episode ended: the server stops generating its
    requests at once, and the worker does not resume them (nor count an interruption)."""
    long = {**SAMPLING, "max_new_tokens": 900}

    async def body() -> tuple[list[Trajectory], dict, int, dict]:
        worker = RolloutWorker(server, interruptible=True)
        try:
            running = asyncio.create_task(
                worker.generate(3, prompt(versions, 2), 4, long, start_version=0, call_id="c1")
            )
            await wait_generated(worker, 4 * 10)
            reply = await worker.abandon("c1")
            trajs = [Trajectory.from_wire(w) for w in await asyncio.wait_for(running, 30)]
            # The server holds no request of the call any more (an unaborted one would run
            # for hundreds of tokens): nothing left that could generate.
            info = await worker.client.server_info()
            idle = sum(info[k] for k in ("num_running_reqs", "num_waiting_reqs", "num_held_reqs"))
            return trajs, reply, idle, await worker.stats()
        finally:
            await worker.client.close()

    trajs, reply, idle, stats = asyncio.run(body())
    assert reply == {"aborted": 4}
    assert idle == 0
    assert len(trajs) == 4 and not any(t.finish_reason for t in trajs)  # none finished
    assert stats["n_abandoned"] == 4 and stats["n_interrupted"] == 0
    assert stats["in_flight"] == 0
