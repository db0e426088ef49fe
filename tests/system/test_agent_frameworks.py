"""Agents written as their frameworks' documentation writes them (tests/documented_agents/)
run many episodes in one agent process, as in a whole run: LangChain's cached HTTP client,
the Agents SDK's model and a module-level openai client and aiohttp session are made by the
first episodes and reused by every later one, groups overlapping. The real endpoint and agent
process; the model is scripted (it calls the tool the request offers, then answers with the
tool's result), so that every episode scores +5 when the plumbing works."""

from __future__ import annotations

import asyncio
import json
import random
import re

import pytest

from areal.config import load_config
from areal.models.tiny import build_tokenizer
from areal.trajectory import Trajectory
from areal.workflow.agent import AgentWorkflow
from areal.workflow.api import RolloutEngine
from tests.documented_agents import RIGHT_WITH_TOOL

pytest.importorskip("openai")

AGENTS = {  # module of tests/documented_agents -> the framework it needs
    "langchain_adder": "langchain_openai",
    "sdk_adder": "agents",
    "openai_adder": "aiohttp",
}
WAVES, GROUPS, GROUP_SIZE = 3, 4, 4  # 48 episodes, 16 at a time


def scripted_model(tokenizer):
    """generate_fn of a model that calls the offered function on the user's operands, and
    answers with the tool's result once it has one."""

    async def generate(input_ids: list[int], n: int, params: dict) -> list[Trajectory]:
        await asyncio.sleep(random.uniform(0.0, 0.02))  # calls of episodes interleave
        text = tokenizer.decode(input_ids)
        turn = text.rsplit("<|im_start|>user", 1)[-1]
        result = re.findall(r"<tool_response>\n(\d+)\n</tool_response>", turn)
        if result:
            out = result[-1]
        else:
            a, b = re.search(r"(\d+)\+(\d+)=", turn).groups()
            name = re.search(r'"name": "(\w+)"', text).group(1)
            call = {"name": name, "arguments": {"a": int(a), "b": int(b)}}
            out = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        ids = tokenizer.encode(out, add_special_tokens=False) + [tokenizer.eos_token_id]
        return [
            Trajectory(
                group_id=0,
                prompt_ids=list(input_ids),
                output_ids=ids,
                logprobs=[-0.1] * len(ids),
                versions=[0] * len(ids),
                finish_reason="stop",
            )
        ]

    return generate


@pytest.mark.timeout(180)
@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_a_documented_agent_runs_many_episodes_in_one_process(agent):
    pytest.importorskip(AGENTS[agent])
    from areal.workflow import resolve

    tokenizer = build_tokenizer(0)
    cfg = load_config(
        None, ["rollout.sample_mode=concat", "rollout.max_turns=10", "rollout.agent_processes=1"]
    ).rollout
    workflow = AgentWorkflow(resolve(f"tests.documented_agents.{agent}:run"), cfg)
    generate = scripted_model(tokenizer)

    def engine(group_id: int) -> RolloutEngine:
        return RolloutEngine(
            tokenizer=tokenizer,
            group_size=GROUP_SIZE,
            sampling_params={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 80},
            group_id=group_id,
            start_version=0,
            generate_fn=generate,
        )

    async def body() -> list[list[Trajectory]]:
        groups = []
        try:
            for wave in range(WAVES):
                rows = [(3 + g, wave + 1) for g in range(GROUPS)]
                groups += await asyncio.gather(
                    *(
                        workflow.arun_episode(
                            engine(wave * GROUPS + g), {"prompt": f"{a}+{b}=", "answer": str(a + b)}
                        )
                        for g, (a, b) in enumerate(rows)
                    )
                )
            return groups
        finally:
            await workflow.aclose()

    groups = asyncio.run(body())
    samples = [s for group in groups for s in group]
    assert len(samples) == WAVES * GROUPS * GROUP_SIZE  # one concat sample per episode
    assert all(s.reward == RIGHT_WITH_TOOL for s in samples), [s.reward for s in samples]
    stats = workflow.stats()
    assert stats["episode/tool_share"] == 1.0 and stats["episode/tool_calls_mean"] == 1.0
