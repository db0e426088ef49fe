"""The controller's checkpoint state: nothing trained twice, nothing lost, counters rebuilt."""

from __future__ import annotations

from areal.comm.wire import pack, unpack
from areal.config import load_config
from areal.controller.controller import Controller
from areal.trajectory import Trajectory


def make_controller(n_rows: int = 10) -> Controller:
    cfg = load_config(None, ["trainer.batch_size=2", "max_staleness=1", "ppo.n_minibatches=1"])
    rows = [
        {"prompt": f"{i}+0=", "answer": str(i), "task": "arith", "prompt_ids": [1, i]}
        for i in range(n_rows)
    ]
    return Controller(cfg, rows, tokenizer=None, workers=[], reward=None)


def start_group(c: Controller) -> int:
    index = c.buffer.reserve(c.gate.on_rollout_submitted())
    c._rows_in_flight[index] = c._next_row()
    return index


def finish_group(c: Controller, index: int) -> None:
    row = c._rows_in_flight.pop(index)
    c.gate.on_rollout_accepted()
    c.buffer.put(
        index,
        [
            Trajectory(
                group_id=index,
                prompt_ids=row["prompt_ids"],
                output_ids=[5, 6],
                logprobs=[-0.5, -0.25],
                versions=[0, 0],
            )
        ],
    )


def test_state_round_trip_regenerates_in_flight_prompts_and_keeps_ready_groups():
    c = make_controller()
    groups = [start_group(c) for _ in range(4)]  # B * (eta + 1) = 4 may start at version 0
    finish_group(c, groups[0])
    finish_group(c, groups[2])
    in_flight_prompts = sorted(c._rows_in_flight[i]["prompt"] for i in (groups[1], groups[3]))
    ready_before = len(c.buffer)

    state = unpack(pack(c.state_dict()))  # travels through the same format as the wire
    resumed = make_controller()
    resumed.load_state_dict(state, version=0)

    assert len(resumed.buffer) == ready_before == 2
    # Prompts that were generating are generated again, before any new prompt.
    assert sorted(resumed._next_row()["prompt"] for _ in range(2)) == in_flight_prompts
    # The dataset goes on where it was: the fifth prompt of the epoch comes next.
    assert resumed._next_row() == c._next_row()
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
