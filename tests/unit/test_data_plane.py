"""The pull data plane in the controller: references in the buffer, the batch handed out as
references (trajectories made on the controller held there), released once trained, and a
checkpoint that draws held groups again with the gate's count rebuilt without them."""

from __future__ import annotations

import asyncio

import pytest

from areal.comm.wire import pack, unpack
from areal.config import load_config
from areal.controller.controller import Controller
from areal.data_plane import TrajectoryStore
from areal.trajectory import Trajectory, TrajectoryRef, is_ref
from areal.worker import make_controller as build_controller
from areal.workflow import RolloutEngine, Workflow

WORKER = TrajectoryStore("rollout0", "tcp://10.0.0.1:5000")
"""Stands for a rollout worker's store: the workflow holds its trajectories there."""


def traj(group_id: int, reward: float, n_out: int = 2) -> Trajectory:
    return Trajectory(
        group_id=group_id, prompt_ids=[1, 2, 3], output_ids=[5] * n_out,
        logprobs=[-0.5] * n_out, versions=[0] * n_out, reward=reward, finish_reason="stop",
    )  # fmt: skip


class HeldOrMade(Workflow):
    """Even rows: two samples held by a rollout worker (references); odd rows: made here."""

    async def arun_episode(self, engine: RolloutEngine, data: dict) -> list:
        made = [traj(engine.group_id, r) for r in (1.0, 0.0)]
        return WORKER.hold(made) if data["i"] % 2 == 0 else made


class Released:
    """A worker client that records the releases it is sent."""

    address = WORKER.address

    def __init__(self) -> None:
        self.released: list[str] = []

    def call_soon(self, method: str, timeout: float, **args) -> None:
        assert method == "release"
        self.released += args["ids"]
        WORKER.release_now(args["ids"])


def make_controller(n_rows: int = 12) -> Controller:
    cfg = load_config(None, ["trainer.batch_size=2", "max_staleness=1", "ppo.n_minibatches=1"])
    rows = [{"prompt": str(i), "answer": "", "task": "arith", "i": i, "prompt_ids": [1, i]}
            for i in range(n_rows)]  # fmt: skip
    c = build_controller(cfg, rows, tokenizer=None, workers=[], reward=None, workflow=HeldOrMade())
    c.pool.workers = [Released()]
    c.pool._by_address = {WORKER.address: c.pool.workers[0]}
    c.store.address = "tcp://controller:1"
    return c


async def fill(c: Controller, n: int) -> None:
    groups = [await c.admit() for _ in range(n)]
    await asyncio.gather(*groups)


def test_the_batch_is_references_and_each_is_released_once_trained():
    c = make_controller()

    async def two_batches() -> tuple[dict, dict]:
        await fill(c, 4)
        c._stats = _no_stats
        first = await c.get_batch(0)
        second = await c.get_batch(1)
        return first, second

    first, second = asyncio.run(two_batches())
    for batch in (first, second):
        assert all(is_ref(d) for d in batch["trajectories"])
        refs = [TrajectoryRef.from_wire(d) for d in batch["trajectories"]]
        assert [r.draw_id for r in refs[::2]] == batch["stats"]["batch/draw_ids"]
        # Metadata only: a few hundred bytes, whatever the trajectories' lengths.
        assert len(pack(batch["trajectories"])) < 300 * len(refs)
    both = first["trajectories"] + second["trajectories"]
    holders = {TrajectoryRef.from_wire(d).holder for d in both}
    assert holders == {WORKER.address, "tcp://controller:1"}  # made here: held here
    # The first batch was released when the second was asked for; the second is held.
    first_ids = {d["traj_id"] for d in first["trajectories"] if d["holder"] == WORKER.address}
    assert set(c.pool.workers[0].released) == first_ids
    assert len(c.store) == sum(d["holder"] == c.store.address for d in second["trajectories"])


def test_a_checkpoint_draws_held_groups_again_and_keeps_groups_made_here():
    c = make_controller()
    asyncio.run(fill(c, 4))  # four groups ready: two held by the worker, two made here
    held_draws = sorted(g[0].draw_id for g in (s.group for s in c.buffer._slots.values())
                        if isinstance(g[0], TrajectoryRef))  # fmt: skip
    assert len(held_draws) == 2
    state = unpack(pack(c.state_dict()))
    assert sorted(r["draw_id"] for r in state["retry"]) == held_draws
    assert len(state["buffer"]["groups"]) == 2  # made here: saved whole, as before
    resumed = make_controller()
    resumed.load_state_dict(state, version=3)
    assert len(resumed.buffer) == 2
    assert resumed.gate.n_accepted == 2 * 3 + 2  # the held groups no longer count
    # Drawn again first: the very rows, with their draw ids.
    again = [resumed.draws.next() for _ in range(2)]
    assert sorted(r["draw_id"] for r in again) == held_draws
    assert all(r == c.draws.row(r["draw_id"]) for r in again)


def test_the_store_fetches_releases_and_drops_an_abandoned_call():
    store = TrajectoryStore("rollout1", "tcp://h:1")
    refs = store.hold([traj(0, 1.0, n_out=3), traj(0, 0.0)], call_id="c1")
    other = store.hold([traj(1, 1.0)], call_id="c2")
    got = asyncio.run(store.fetch([refs[1].traj_id, refs[0].traj_id]))
    assert [len(d["output_ids"]) for d in got] == [2, 3]
    assert refs[0].holder == "tcp://h:1" and refs[0].n_output == 3 and refs[0].reward == 1.0
    assert asyncio.run(store.release([refs[0].traj_id])) == {"released": 1}
    with pytest.raises(KeyError, match="rollout1 holds no trajectory"):
        asyncio.run(store.fetch([refs[0].traj_id]))
    assert store.drop_call("c1") == 1 and len(store) == 1
    assert asyncio.run(store.fetch([other[0].traj_id]))[0]["reward"] == 1.0


async def _no_stats() -> dict:
    return {}
