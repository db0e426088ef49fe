"""The controller's checkpoint state: nothing trained twice, nothing lost, counters rebuilt."""

from __future__ import annotations

import asyncio

from areal.comm.wire import pack, unpack
from areal.config import load_config
from areal.controller.buffer import ReplayBuffer
from areal.controller.controller import Controller
from areal.trajectory import Trajectory
from areal.worker import make_controller as build_controller
from areal.workflow import RolloutEngine, Workflow


class Held(Workflow):
    """Episodes that end when the test releases their group: groups truly in flight."""

    def __init__(self) -> None:
        self.release: dict[int, asyncio.Event] = {}

    def done(self, group_id: int) -> None:
        self.release.setdefault(group_id, asyncio.Event()).set()

    async def arun_episode(self, engine: RolloutEngine, data: dict) -> list[Trajectory]:
        await self.release.setdefault(engine.group_id, asyncio.Event()).wait()
        return [
            Trajectory(
                group_id=engine.group_id,
                prompt_ids=data["prompt_ids"],
                output_ids=[5, 6],
                logprobs=[-0.5, -0.25],
                versions=[0, 0],
            )
        ]


def make_controller(n_rows: int = 10) -> Controller:
    cfg = load_config(None, ["trainer.batch_size=2", "max_staleness=1", "ppo.n_minibatches=1"])
    rows = [
        {"prompt": f"{i}+0=", "answer": str(i), "task": "arith", "prompt_ids": [1, i]}
        for i in range(n_rows)
    ]
    return build_controller(cfg, rows, tokenizer=None, workers=[], reward=None, workflow=Held())


def test_state_round_trip_regenerates_in_flight_prompts_and_keeps_ready_groups():
    c = make_controller()

    async def checkpoint_with_two_groups_in_flight() -> tuple[dict, list[str]]:
        # B * (eta + 1) = 4 may start at version 0; group ids are given in admission order.
        groups = [await c.admit() for _ in range(4)]
        for group_id in (0, 2):
            c.workflow.done(group_id)
            assert await groups[group_id] is not None
        state = c.state_dict()
        in_flight_prompts = sorted(row["prompt"] for row in c.draws.out.values())
        for g in groups:
            g.cancel()
        await asyncio.gather(*groups, return_exceptions=True)
        return state, in_flight_prompts

    state, in_flight_prompts = asyncio.run(checkpoint_with_two_groups_in_flight())
    assert len(in_flight_prompts) == 2 and c.buffer.n_in_flight == 2
    ready_before = len(c.buffer)

    state = unpack(pack(state))  # travels through the same format as the wire
    resumed = make_controller()
    resumed.load_state_dict(state, version=0)

    assert len(resumed.buffer) == ready_before == 2
    # Prompts that were generating are generated again, before any new prompt.
    assert sorted(resumed.draws.next()["prompt"] for _ in range(2)) == in_flight_prompts
    # The dataset goes on where it was: the fifth prompt of the epoch comes next.
    assert resumed.draws.next() == c.draws.next()
    # Counters rebuilt from the version and the restored buffer, not carried over.
    assert resumed.gate.n_running == 0
    assert resumed.gate.n_accepted == 2
    assert resumed.gate.capacity() == 2
    batch = resumed.buffer.take(0, 2, 1)
    assert [g[0].output_ids for g in batch] == [[5, 6], [5, 6]]
    assert [g[0].logprobs for g in batch] == [[-0.5, -0.25], [-0.5, -0.25]]


def test_resume_at_a_later_version_counts_trained_groups():
    c = make_controller()
    state = unpack(pack(c.state_dict()))
    c.load_state_dict(state, version=7)
    assert c.gate.version == 7
    assert c.gate.n_accepted == 2 * 7
    assert c.gate.capacity() == 2 * (7 + 1 + 1) - 14


def test_a_buffer_saved_before_group_ids_had_their_name_still_loads():
    group = [Trajectory(group_id=5, prompt_ids=[1], output_ids=[2], logprobs=[0.0], versions=[0])]
    old = {
        "next_index": 9,
        "groups": [{"index": 5, "start_version": 0, "group": [t.to_wire() for t in group]}],
    }
    buf = ReplayBuffer()
    buf.load_state_dict(unpack(pack(old)))
    assert len(buf) == 1 and buf.reserve(0) == 9  # group ids go on past the saved ones
    assert buf.state_dict()["groups"][0]["group_id"] == 5
