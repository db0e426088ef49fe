"""The `add` tool on the small-sums task: what the two framework agents share.

    configs/agent_tools.yaml: dataset.type = "examples.add_tool:TASK"
        rows        arith's ("3+4=", "7"); each agent asks its row and grades itself (reward)
        warm-up     the tiny model learns to call add in Qwen's format, and to answer with
                    the tool's result, on exactly the requests the frameworks send, then
                    on requests of other agents (tool_requests.py: their instructions,
                    docstrings and argument names)
    examples/agents_sdk_add.py   OpenAI Agents SDK: Agent(tools=[add]), Runner.run
    examples/langchain_add.py    LangChain: ChatOpenAI(...).bind_tools([add])

Each framework turns the Python function `add` into a JSON schema of its own (the SDK's
strict schema has titles, `additionalProperties` and `"strict": true`; LangChain's has
neither), and the chat template writes that schema into the prompt. The warm-up renders
both, through the endpoint's own function, so that its token sequences are the ones a run
sees (tests/unit/test_add_tool.py checks this against each framework when installed).

The warm-up is imperfect on purpose, so that RL has something to learn. Its first
CALLS_ONLY_STEPS batches are all tool episodes: call add with the row's operands, then answer
with the result. Copying the operands from a ~200-token prompt is what a 2-layer model
learns last (abruptly, after ~300 steps; with fewer tool episodes per batch, much later), so
the format comes first. The batches after it mix in direct answers: only TOOL_SHARE of their
episodes call add, the others answer at once, and half of those answers are random numbers
(as arith's warm-up). RL starts from a model that calls the tool about that often.

Agents written by others send other requests: a system prompt (the SDK's `instructions`),
their own docstring, other argument names. From batch EXAMPLES_ONLY_STEPS on, only
EXAMPLES_SHARE of the episodes are the examples' requests; the others are drawn by
tool_requests.py. Not earlier: the operands are copied by their position relative to the
call, which a system prompt or a description (both before the user's turn) leaves as it is,
and the model finds that position sooner on the examples' requests alone (with variety from
the first batch it had not by batch 400 in three of four tries).
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator

from areal.tasks import Batch, ChatCall, Task
from areal.tasks.arith import ArithOptions, generate, is_correct, make_problems
from examples import tool_requests


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


# The `tools` entry each framework sends for `add` (its signature and docstring above):
# openai-agents 0.24 `@function_tool` (strict mode, its default), and langchain-core 1.8
# `bind_tools` (`convert_to_openai_tool`). Data, not computed: the warm-up (and so the tiny
# model's directory) must not depend on which framework is installed.
_INTEGER = {"type": "integer"}
TOOLS = {
    "agents_sdk": {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "properties": {
                    "a": {"title": "A", **_INTEGER},
                    "b": {"title": "B", **_INTEGER},
                },
                "required": ["a", "b"],
                "title": "add_args",
                "type": "object",
                "additionalProperties": False,
            },
            "strict": True,
        },
    },
    "langchain": {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "properties": {"a": _INTEGER, "b": _INTEGER},
                "required": ["a", "b"],
                "type": "object",
            },
        },
    },
}

# Rewards. A right answer reached through add scores highest. A right answer without the
# tool still scores above zero (the answer is right, and a model that knows a sum should not
# be pushed towards a wrong one) but well below: on this task the tool makes the answer
# certain, the tiny model's own answers are mostly guesses, and the run is there to teach
# tool use; with equal rewards RL would have no reason to prefer the tool where a guess
# happens to be right. Wrong, missing or malformed answers score lowest.
RIGHT_WITH_TOOL, RIGHT_WITHOUT_TOOL, WRONG = 5.0, 1.0, -5.0
CALLS_ONLY_STEPS = 400
"""Warm-up batches in which every episode calls the tool (then answers with its result)."""
TOOL_SHARE = 0.4
"""Warm-up episodes calling the tool after those; the others answer at once (half wrongly)."""
EXAMPLES_ONLY_STEPS = 250
"""Warm-up batches of the examples' exact requests only, before varied ones come in."""
EXAMPLES_SHARE = 0.25
"""Warm-up episodes that are the examples' exact requests after those; the others vary
(tool_requests.py: system prompts, descriptions, argument names)."""


def reward(final: str | None, answer: str, used_tool: bool) -> float:
    """An episode's reward: its final answer must be the number alone (a tool call the
    parser refused, read back as text, is not an answer)."""
    if final is None or final.strip() != answer:
        return WRONG
    return RIGHT_WITH_TOOL if used_tool else RIGHT_WITHOUT_TOOL


def tool_call_text(a: int, b: int, tool: dict | None = None) -> str:
    """How a Qwen-family model calls `tool` (add, unless given) on a and b: its name and
    argument names copied from the schema (the chat template asks for exactly this)."""
    fn = (tool or TOOLS["langchain"])["function"]
    first, second = fn["parameters"]["properties"]
    call = {"name": fn["name"], "arguments": {first: a, second: b}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def warmup_episode(
    prompt: str,
    answer: str,
    tool: dict,
    rng: random.Random,
    tool_share: float,
    system: str | None = None,
) -> list[ChatCall]:
    """The calls of one warm-up episode, in the frameworks' wire shapes (`system`: the
    agent's instructions, sent first)."""
    opening = [{"role": "system", "content": system}] if system is not None else []
    opening.append({"role": "user", "content": prompt})
    if rng.random() >= tool_share:  # answer at once, right half of the time
        guess = answer if rng.random() < 0.5 else str(rng.randint(0, 2 * int(answer) + 1))
        return [ChatCall(messages=opening, tools=[tool], response=guess)]
    a, b = (int(x) for x in prompt.rstrip("=").split("+"))
    text = tool_call_text(a, b, tool)
    function = json.loads(text.split("\n")[1])
    function["arguments"] = json.dumps(function["arguments"])
    called = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_0", "type": "function", "function": function}],
    }
    result = {"role": "tool", "tool_call_id": "call_0", "content": str(add(a, b))}
    return [
        ChatCall(messages=opening, tools=[tool], response=text),
        ChatCall(messages=[*opening, called, result], tools=[tool], response=answer),
    ]


def warmup(dataset_cfg, seed: int) -> Iterator[Batch]:
    """Batches of 16 episodes: EXAMPLES_SHARE of them the examples' own requests (one
    framework's schema of add, no system prompt), the others varied (tool_requests.py)."""
    rng = random.Random(seed + 1)
    pool = make_problems(4096, TASK.options_of(dataset_cfg.options).max_operand, seed + 1)
    tools = list(TOOLS.values())
    for step in itertools.count():
        share = 1.0 if step < CALLS_ONLY_STEPS else TOOL_SHARE
        batch = []
        for p in rng.sample(pool, 16):
            if step < EXAMPLES_ONLY_STEPS or rng.random() < EXAMPLES_SHARE:
                system, tool = None, rng.choice(tools)
            else:
                system, tool = tool_requests.request(rng)
            batch.append(warmup_episode(p["prompt"], p["answer"], tool, rng, share, system))
        yield batch


TASK = Task(
    name="add_tool", generate=generate, is_correct=is_correct, warmup=warmup, options=ArithOptions
)
