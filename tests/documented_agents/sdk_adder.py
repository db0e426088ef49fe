"""The OpenAI Agents SDK as its docs show: Agent(instructions=..., tools=[...]), Runner.run
with its default max_turns."""

from __future__ import annotations

from agents import (
    Agent,
    OpenAIChatCompletionsModel,
    Runner,
    ToolCallOutputItem,
    function_tool,
    set_tracing_disabled,
)

from tests.documented_agents import grade

set_tracing_disabled(True)  # tracing uploads spans to OpenAI's servers: no network here

INSTRUCTIONS = (
    "You help people with quick sums. Use the available function to work out the result "
    "and answer with the number alone, no words."
)


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers and return their sum."""
    return a + b


async def run(data: dict, client) -> float:
    agent = Agent(
        name="Sum helper",
        instructions=INSTRUCTIONS,
        tools=[add],
        model=OpenAIChatCompletionsModel(model="default", openai_client=client),
    )
    result = await Runner.run(agent, data["prompt"])
    used_tool = any(
        isinstance(item, ToolCallOutputItem) and isinstance(item.output, int)
        for item in result.new_items
    )
    return grade(result.final_output, data["answer"], used_tool)
