"""The workflow API's pure parts: loading, rewards and returns, samples, request parsing."""

from __future__ import annotations

import asyncio
import math
from dataclasses import fields

import pytest

from areal.config import RolloutConfig, load_config
from areal.trajectory import Trajectory
from areal.worker import make_controller as build_controller
from areal.workflow import Workflow, load_workflow
from areal.workflow.agent import AgentWorkflow
from areal.workflow.openai_api import BadRequest, chat_messages, cut_at_stop, request_params
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
        ({"functions": [{"name": "f"}]}, "send tools"),
        ({"presence_penalty": 0.5}, "penalty"),
    ]:
        with pytest.raises(BadRequest, match=needle):
            request_params(body, SAMPLING, 8)
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}
    assert chat_messages(parts) == [{"role": "user", "content": "a"}]
    with pytest.raises(BadRequest, match="non-empty"):
        chat_messages({"messages": []})
    assert cut_at_stop("x = 3</calc> more", ["</calc>"]) == "x = 3"


class _Decline(Workflow):
    async def arun_episode(self, engine, data):
        return None


def test_a_declined_row_frees_the_gate_and_is_used_up():
    cfg = load_config(None, ["trainer.batch_size=2", "max_staleness=0"])
    rows = [{"prompt": f"{i}+0=", "answer": str(i), "task": "arith", "prompt_ids": [1, i]}
            for i in range(3)]  # fmt: skip
    c = build_controller(cfg, rows, tokenizer=None, workers=[], reward=None, workflow=_Decline())

    async def body():
        return await (await c.admit())

    capacity = c.gate.capacity()
    assert asyncio.run(body()) is None
    assert c.gate.capacity() == capacity and c.gate.n_accepted == 0
    assert c.draws.retry == [] and c.draws.out == {} and c.buffer.n_in_flight == 0
    assert c.episodes.stats()["rollout/episodes_declined"] == 1


class _OnlyEpisode:  # looks like a workflow, but has none of the hooks
    async def arun_episode(self, engine, data):
        return None


only_episode = _OnlyEpisode()
declined = _Decline()
not_async = print


def plain_agent(data, client):
    return 1.0


def test_load_workflow_takes_workflows_and_agent_functions_and_refuses_the_rest():
    from examples.multi_turn_arith import run

    assert isinstance(load_workflow(f"{__name__}:_Decline"), _Decline)
    assert load_workflow(f"{__name__}:declined") is declined
    agent = load_workflow("examples.multi_turn_arith:run", RolloutConfig(max_turns=3))
    assert isinstance(agent, AgentWorkflow) and agent.run is run and agent.cfg.max_turns == 3
    # A plain function is an agent too (run on a thread, with a synchronous client).
    assert load_workflow(f"{__name__}:plain_agent").run is plain_agent
    # The hooks' defaults come with the interface.
    assert declined.stats() == {} and asyncio.run(declined.aclose()) is None
    for name in ("_OnlyEpisode", "only_episode", "not_async"):
        with pytest.raises(ValueError, match="subclass of areal.workflow.Workflow"):
            load_workflow(f"{__name__}:{name}")


def test_individual_samples_keep_every_field_of_the_call():
    t = Trajectory(
        group_id=3,
        prompt_ids=[1, 2],
        output_ids=[5, 6],
        logprobs=[-0.1, -0.2],
        versions=[1, 2],
        finish_reason="stop",
        reward=0.0,
        start_version=1,
        n_interrupts=1,
        t_start=10.0,
        t_end=11.0,
        draw_id=7,
        loss_mask=[1, 1],
    )
    # Every field differs from its default, so a field left behind would show.
    defaults = Trajectory(group_id=0, prompt_ids=[])
    changed = {
        f.name for f in fields(Trajectory) if getattr(t, f.name) != getattr(defaults, f.name)
    }
    assert changed == {f.name for f in fields(Trajectory)} - {"reward"}
    (sample,) = individual_samples([Call(id="a", traj=t)], [2.5])
    assert sample.reward == 2.5
    assert {f.name: getattr(sample, f.name) for f in fields(Trajectory) if f.name != "reward"} == {
        f.name: getattr(t, f.name) for f in fields(Trajectory) if f.name != "reward"
    }
    sample.output_ids.append(9)  # the sample owns its token lists
    assert t.output_ids == [5, 6]


def test_concat_keeps_the_first_calls_identity():
    first = call("a", [1], [5], 0)
    first.traj.draw_id, first.traj.start_version, first.traj.t_start = 7, 2, 10.0
    second = call("b", [1, 5, 7], [9], 0)
    second.traj.t_end = 12.0
    t = concat_sample([first, second], [0.0, 1.0])
    assert (t.group_id, t.draw_id, t.start_version, t.t_start, t.t_end) == (3, 7, 2, 10.0, 12.0)
    assert first.traj.output_ids == [5] and first.traj.loss_mask == []  # calls left as they were
