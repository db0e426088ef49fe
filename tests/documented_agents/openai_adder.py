"""Plain openai, as an application keeps it: one AsyncOpenAI (one connection pool) and one
aiohttp.ClientSession for the whole process, made by the first episode and used by every
later one; each call carries its episode's key (the session token)."""

from __future__ import annotations

import json

import aiohttp
import openai

from tests.documented_agents import WRONG, grade

_client: openai.AsyncOpenAI | None = None
_http: aiohttp.ClientSession | None = None

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Integer addition.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


async def run(data: dict, client) -> float:
    global _client, _http
    if _client is None:
        _client = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="set per call")
        _http = aiohttp.ClientSession()
    # The "environment" through the shared aiohttp session (here: the model list).
    async with _http.get(f"{client.base_url}models") as response:
        response.raise_for_status()
    mine = _client.with_options(api_key=client.api_key)
    messages = [{"role": "user", "content": data["prompt"]}]
    used_tool = False
    for _ in range(3):
        reply = await mine.chat.completions.create(model="default", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        if not message.tool_calls:
            return grade(message.content, data["answer"], used_tool)
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}
            )
            used_tool = True
    return WRONG
