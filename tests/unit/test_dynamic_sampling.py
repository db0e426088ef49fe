"""Dynamic sampling in the controller (ppo.dynamic_sampling, DAPO): groups whose rewards
are all equal never reach the buffer, free their place in the staleness gate, and a run
whose every group is dropped stops with a message instead of generating forever."""

from __future__ import annotations

import asyncio

from areal.config import load_config
from areal.controller.controller import Controller
from areal.trajectory import Trajectory
from areal.worker import make_controller as build_controller
from areal.workflow import RolloutEngine, Workflow


class Rewarded(Workflow):
    """Two samples a prompt, whose rewards are the row's."""

    def __init__(self) -> None:
        self.ran: list[list[float]] = []

    async def arun_episode(self, engine: RolloutEngine, data: dict) -> list[Trajectory]:
        self.ran.append(data["rewards"])
        return [
            Trajectory(
                group_id=engine.group_id,
                prompt_ids=[1],
                output_ids=[2],
                logprobs=[-1.0],
                versions=[0],
                reward=r,
            )  # fmt: skip
            for r in data["rewards"]
        ]


def make_controller(rewards: list[list[float]], *overrides: str) -> Controller:
    cfg = load_config(
        None,
        ["trainer.batch_size=2", "max_staleness=0", "rollout.group_size=2",
         "ppo.n_minibatches=1", "ppo.dynamic_sampling=true", *overrides],
    )  # fmt: skip
    rows = [{"prompt": str(i), "answer": "", "task": "arith", "rewards": r}
            for i, r in enumerate(rewards)]  # fmt: skip
    return build_controller(cfg, rows, tokenizer=None, workers=[], reward=None, workflow=Rewarded())


def test_equal_reward_groups_are_dropped_and_replaced():
    # Mostly all-equal rewards (dropped), a few mixed (kept); drawn in a shuffled order.
    c = make_controller([[5.0, 5.0], [-5.0, -5.0]] * 5 + [[5.0, -5.0], [-5.0, 5.0]])

    async def fill() -> None:
        while len(c.buffer) < 2:  # a batch of 2 groups at eta 0: capacity 2 at a time
            await c.admit()
            await asyncio.sleep(0.01)

    asyncio.run(asyncio.wait_for(fill(), 10))
    batch = c.buffer.take(0, 2, 0)
    assert batch is not None
    assert all(len({t.reward for t in group}) > 1 for group in batch)
    equal = [r for r in c.workflow.ran if len(set(r)) == 1]
    assert equal and c._dropped == len(equal)  # dropped as they came, not counted twice
    assert len(c.workflow.ran) - len(equal) == 2 + c.buffer.n_in_flight
    assert c.no_progress is None


def test_only_equal_groups_end_the_run_with_a_message():
    c = make_controller([[1.0, 1.0]] * 200)

    async def spin() -> None:
        while not c.stalled.is_set():
            await c.admit()
            await asyncio.sleep(0)

    asyncio.run(asyncio.wait_for(spin(), 20))
    assert "dynamic sampling dropped 100 groups in a row" in c.no_progress
    assert "ppo.dynamic_sampling=false" in c.no_progress
    assert len(c.buffer) == 0
