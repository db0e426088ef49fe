"""LangChain as its docs show: ChatOpenAI with its defaults, bind_tools, a tool loop."""

from __future__ import annotations

from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from tests.documented_agents import WRONG, grade

INSTRUCTIONS = (
    "You are a meticulous arithmetic helper. Whenever the user asks for a sum, call the "
    "tool you were given instead of adding in your head, then reply with only the number."
)


@tool
def add(a: int, b: int) -> int:
    """Compute the total of the two whole numbers a and b."""
    return a + b


async def run(data: dict, client) -> float:
    llm = ChatOpenAI(model="default", base_url=str(client.base_url), api_key=client.api_key)
    llm_with_tools = llm.bind_tools([add])
    messages = [SystemMessage(INSTRUCTIONS), HumanMessage(data["prompt"])]
    used_tool = False
    for _ in range(3):
        reply = await llm_with_tools.ainvoke(messages)
        if not reply.tool_calls:
            return grade(reply.text, data["answer"], used_tool)
        messages.append(reply)
        for call in reply.tool_calls:
            try:
                messages.append(await add.ainvoke(call))  # a ToolMessage
                used_tool = True
            except Exception as e:  # arguments that miss the schema: the model hears it
                messages.append(ToolMessage(f"Error: {e}", tool_call_id=call["id"]))
    return WRONG
