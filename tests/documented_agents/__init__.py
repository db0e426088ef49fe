"""Agents written as each framework's own documentation writes them, independently of this
project: instructions and tool docstrings of their own (which the tiny model's warm-up never
saw), every framework default left as it is (LangChain's cached HTTP client and no timeout,
the SDK's max_turns and retries), and one agent that keeps a module-level openai client and
aiohttp session across episodes. Each grades itself: a right answer after the tool ran +5,
a right answer without it +1, anything else -5.

    langchain_adder.py   ChatOpenAI(model, base_url, api_key).bind_tools([@tool]), a tool loop
    sdk_adder.py         Agent(instructions=..., tools=[@function_tool]), Runner.run
    openai_adder.py      one module-level AsyncOpenAI and aiohttp.ClientSession, tools by hand

tests/system/test_agent_frameworks.py runs them for many episodes against a scripted model;
docs/guides/agents.md ("What the tiny tool model generalises to") runs them
with configs/agent_tools.yaml.
"""

from __future__ import annotations

import ast
from pathlib import Path

RIGHT_WITH_TOOL, RIGHT, WRONG = 5.0, 1.0, -5.0


def grade(final: str | None, answer: str, used_tool: bool) -> float:
    if final is None or final.strip() != answer:
        return WRONG
    return RIGHT_WITH_TOOL if used_tool else RIGHT


def held_out() -> set[str]:
    """Every string of these agents' modules (their instructions and tool docstrings among
    them), read without importing their frameworks: the warm-up must draw none of them."""
    strings = set()
    for path in Path(__file__).parent.glob("*_adder.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
    return strings
