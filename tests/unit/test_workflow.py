"""The workflow API's pure parts: loading, rewards and returns, samples, request parsing."""

from __future__ import annotations

import asyncio
import math

import pytest

from areal.config import load_config
from areal.controller.controller import Controller
from areal.trajectory import Trajectory
from areal.workflow import load_workflow
from areal.workflow.agent import AgentWorkflow
from areal.workflow.openai_endpoint import BadRequest, chat_messages, cut_at_stop, request_params
from areal.workflow.samples import (
    Call,
    call_rewards,
    concat_sample,
    discounted_returns,
    individual_samples,
)
from areal.workflow.single_turn import SingleTurnWorkflow


def call(i: str, prompt: list[int], out: list[int], version: int) -> Call:
    return Call(
        id=i,
        traj=Trajectory(
            group_id=3,
            prompt_ids=prompt,
            output_ids=out,
            logprobs=[-0.1 * (k + 1) for k in range(len(out))],
            versions=[version] * len(out),
            finish_reason="stop",
        ),
    )


def test_the_default_workflow_is_single_turn_and_specs_are_checked():
    assert isinstance(load_workflow(load_config(None).rollout.workflow), SingleTurnWorkflow)
    assert isinstance(load_workflow("examples.multi_turn_arith:run"), AgentWorkflow)
    with pytest.raises(ValueError, match="cannot import 'nope'"):
        load_workflow("nope:run")
    with pytest.raises(ValueError, match="has no 'missing'"):
        load_workflow("areal.workflow.single_turn:missing")


def test_discount_is_applied_once():
    assert discounted_returns([1.0, 0.0, 2.0], 0.5) == [1.5, 1.0, 2.0]
    assert discounted_returns([1.0, 1.0], 1.0) == [2.0, 1.0]
    assert discounted_returns([], 0.9) == []
    calls = [call("a", [1], [2], 0), call("b", [1, 2, 9], [3], 0), call("c", [1, 2, 9, 3], [4], 0)]
    rewards = call_rewards({"a": 1.0, "c": 2.0}, calls)
    assert rewards == [1.0, 0.0, 2.0]
    returns = discounted_returns(rewards, 0.5)
    # Samples carry the returns as they are: no second discount anywhere downstream.
    assert [t.reward for t in individual_samples(calls, returns)] == [1.5, 1.0, 2.0]
    assert concat_sample(calls, returns).reward == 1.5
    # A float is the episode's reward: the last call's.
    assert call_rewards(4.0, calls) == [0.0, 0.0, 4.0]


@pytest.mark.parametrize(
    ("result", "needle"),
    [("7", "return a float"), (True, "return a float"), ({"zz": 1.0}, "no call"),
     ({"a": math.inf}, "finite"), (math.nan, "finite"), (None, "return a float")],
)  # fmt: skip
def test_bad_rewards_are_clear_errors(result, needle):
    with pytest.raises(ValueError, match=needle):
        call_rewards(result, [call("a", [1], [2], 0)])


def test_concat_masks_environment_tokens_and_keeps_versions():
    calls = [
        call("a", [1, 2], [5, 6], 0),
        call("b", [1, 2, 5, 6, 7, 8], [9], 1),  # 7, 8: the environment's turn
    ]
    t = concat_sample(calls, [0.0, 1.0])
    assert t.prompt_ids == [1, 2]
    assert t.output_ids == [5, 6, 7, 8, 9]
    assert t.loss_mask == [1, 1, 0, 0, 1]
    assert t.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.1]
    # Environment tokens take the version before them: the oldest token stays a model's.
    assert t.versions == [0, 0, 0, 0, 1]
    assert t.n_generated == 3 and t.group_id == 3


def test_concat_refuses_when_a_call_does_not_extend_the_previous_one():
    # The template re-rendered the model's [5, 6] as [5, 4]: not append-only.
    calls = [call("a", [1, 2], [5, 6], 0), call("b", [1, 2, 5, 4, 7], [9], 0)]
    assert concat_sample(calls, [0.0, 1.0]) is None
    # The agent dropped the first turn from the history.
    calls = [call("a", [1, 2], [5, 6], 0), call("b", [1, 7], [9], 0)]
    assert concat_sample(calls, [0.0, 1.0]) is None


def test_loss_mask_travels_on_the_wire_and_old_trajectories_still_load():
    t = concat_sample([call("a", [1], [5], 0), call("b", [1, 5, 7], [9], 0)], [0.0, 1.0])
    assert Trajectory.from_wire(t.to_wire()).loss_mask == [1, 0, 1]
    old = Trajectory(group_id=0, prompt_ids=[1], output_ids=[2], logprobs=[0.0], versions=[0])
    wire = old.to_wire()
    del wire["loss_mask"]
    assert Trajectory.from_wire(wire).loss_mask == []


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8}


def test_request_params():
    assert request_params({}, SAMPLING, 8) == {"max_new_tokens": 8, "stop": []}
    body = {"max_tokens": 3, "temperature": 1.0, "stop": "</calc>"}
    assert request_params(body, SAMPLING, 8) == {"max_new_tokens": 3, "stop": ["</calc>"]}
    assert request_params({"max_completion_tokens": 5}, SAMPLING, 8)["max_new_tokens"] == 5
    for body, needle in [
        ({"temperature": 0.7}, "rollout.temperature"),
        ({"n": 2}, "n must be 1"),
        ({"stream": True}, "stream"),
        ({"max_tokens": 0}, "positive"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"presence_penalty": 0.5}, "penalty"),
    ]:
        with pytest.raises(BadRequest, match=needle):
            request_params(body, SAMPLING, 8)
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}
    assert chat_messages(parts) == [{"role": "user", "content": "a"}]
    with pytest.raises(BadRequest, match="non-empty"):
        chat_messages({"messages": []})
    assert cut_at_stop("x = 3</calc> more", ["</calc>"]) == "x = 3"


class _Decline:
    async def arun_episode(self, engine, data):
        return None


def test_a_declined_row_frees_the_gate_and_is_used_up():
    cfg = load_config(None, ["trainer.batch_size=2", "max_staleness=0"])
    rows = [{"prompt": f"{i}+0=", "answer": str(i), "task": "arith", "prompt_ids": [1, i]}
            for i in range(3)]  # fmt: skip
    c = Controller(cfg, rows, tokenizer=None, workers=[], reward=None, workflow=_Decline())

    async def body():
        index = c.buffer.reserve(c.gate.on_rollout_submitted())
        row = c._rows_in_flight[index] = c._next_row()
        await c._rollout_group(index, row, 0)

    capacity = c.gate.capacity()
    asyncio.run(body())
    assert c.gate.capacity() == capacity and c.gate.n_accepted == 0
    assert c._retry == [] and c._rows_in_flight == {} and c.buffer.n_in_flight == 0
    assert c.episodes.stats()["rollout/episodes_declined"] == 1
