"""A LangChain agent that adds with a tool, trained by RL on the tiny model.

    pip install -e ".[agents]"
    python -m areal.train --config configs/agent_tools.yaml \
        rollout.workflow=examples.langchain_add:run

`ChatOpenAI(...).bind_tools([add])`: the model's reply carries parsed `tool_calls`; the agent
executes each, sends the results back as ToolMessages and reads the final answer, which is
graded (examples/add_tool.py: reward). ChatOpenAI builds its own OpenAI client, so it gets
the episode client's base_url and api_key (the api_key is the episode's session token).
"""

from __future__ import annotations

try:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
except ImportError as e:  # the run's error then says how to get it
    raise ImportError(f"{e}: pip install -e '.[agents]' (langchain-openai)") from e

from examples import add_tool

MAX_CALLS = 3  # configs/agent_tools.yaml sets rollout.max_turns to the same

# LangChain derives the schema from the signature and docstring (add_tool.TOOLS["langchain"]).
add = tool(add_tool.add)


async def run(data: dict, client) -> float:
    llm = ChatOpenAI(
        model="default",
        base_url=str(client.base_url),
        api_key=client.api_key,
        max_retries=0,  # a retried call would be a second recorded call
    ).bind_tools([add])
    messages = [HumanMessage(data["prompt"])]
    used_tool = False
    for _ in range(MAX_CALLS):
        reply = await llm.ainvoke(messages)
        if not reply.tool_calls:
            return add_tool.reward(str(reply.text), data["answer"], used_tool)
        messages.append(reply)
        for call in reply.tool_calls:
            # The endpoint returns only calls of the tools given (add) with a JSON object, but
            # its arguments may be wrong ({"a": 3}): the model hears so, as the SDK does it.
            try:
                result = str(await add.ainvoke(call["args"]))
                used_tool = True
            except Exception:
                result = "An error occurred while running the tool. Please try again."
            messages.append(ToolMessage(result, tool_call_id=call["id"]))
    return add_tool.WRONG  # still calling tools after MAX_CALLS calls: no answer
