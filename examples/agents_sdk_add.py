"""An OpenAI Agents SDK agent that adds with a tool, trained by RL on the tiny model.

    pip install -e ".[agents]"
    python -m areal.train --config configs/agent_tools.yaml   # this agent is its default

`Agent(tools=[add])` with the SDK's `@function_tool` over the shared `add`; the SDK's
chat-completions model talks to the run's endpoint through the client the episode is given.
The SDK sends the tool's strict JSON schema (no tool_choice, no parallel_tool_calls),
executes the parsed call, sends its result back as a "tool" message and takes the model's
next text as the final output, which is graded (examples/add_tool.py: reward).
"""

from __future__ import annotations

try:
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        Runner,
        ToolCallOutputItem,
        function_tool,
        set_tracing_disabled,
    )
    from agents.exceptions import MaxTurnsExceeded
except ImportError as e:  # the run's error then says how to get it
    raise ImportError(f"{e}: pip install -e '.[agents]' (openai-agents)") from e

from examples import add_tool

MAX_CALLS = 3  # configs/agent_tools.yaml sets rollout.max_turns to the same

# Tracing uploads spans to OpenAI's servers: no network here, and nothing to trace for.
set_tracing_disabled(True)

# The SDK derives the schema from the signature and docstring (add_tool.TOOLS["agents_sdk"]).
add = function_tool(add_tool.add)


async def run(data: dict, client) -> float:
    agent = Agent(
        name="adder",
        tools=[add],
        model=OpenAIChatCompletionsModel(model="default", openai_client=client),
    )
    try:
        result = await Runner.run(agent, data["prompt"], max_turns=MAX_CALLS)
    except MaxTurnsExceeded:  # still calling tools after MAX_CALLS calls: no answer
        return add_tool.WRONG
    # add ran: its int came back (a call with wrong arguments returns the SDK's error text).
    used_tool = any(
        isinstance(item, ToolCallOutputItem) and isinstance(item.output, int)
        for item in result.new_items
    )
    return add_tool.reward(result.final_output, data["answer"], used_tool)
