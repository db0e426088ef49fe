"""A tool-using agent: the model may write <calc>EXPRESSION</calc>; a calculator answers.

    python -m areal.train --config configs/calculator.yaml

The environment evaluates the expression with a small parser (numbers, + - * / //, %,
unary minus, parentheses; never `eval`), appends "result: VALUE" as the next turn, and lets
the model go on; its final answer is graded (+5 right, -5 wrong). With
rollout.sample_mode=concat the episode is one sequence and the calculator's tokens carry
loss mask 0: the model is trained on what it wrote, not on what the tool wrote.
"""

from __future__ import annotations

import re

MAX_CALLS = 4  # configs/calculator.yaml sets rollout.max_turns to the same
RIGHT, WRONG = 5.0, -5.0
CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|(//|[-+*/%()]))")
_MAX_DIGITS = 100  # results longer than this are refused, not computed


class CalcError(ValueError):
    """The expression is not one the calculator evaluates."""


def calculate(text: str) -> int | float:
    """The value of an arithmetic expression; CalcError for anything else."""
    tokens, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise CalcError(f"unexpected {text[pos : pos + 10]!r}")
        tokens.append(m.group(1) or m.group(2))
        pos = m.end()
    if not tokens or len(tokens) > 200:
        raise CalcError("empty or too long")
    value, rest = _sum(tokens)
    if rest:
        raise CalcError(f"unexpected {rest[0]!r}")
    if len(str(value)) > _MAX_DIGITS:
        raise CalcError("result too large")
    return value


def _sum(tokens: list[str]):
    value, tokens = _product(tokens)
    while tokens and tokens[0] in "+-":
        op, (rhs, tokens) = tokens[0], _product(tokens[1:])
        value = value + rhs if op == "+" else value - rhs
    return value, tokens


def _product(tokens: list[str]):
    value, tokens = _unary(tokens)
    while tokens and tokens[0] in ("*", "/", "//", "%"):
        op, (rhs, tokens) = tokens[0], _unary(tokens[1:])
        if op != "*" and rhs == 0:
            raise CalcError("division by zero")
        if op == "*":
            if len(str(value)) + len(str(rhs)) > _MAX_DIGITS:
                raise CalcError("result too large")
            value = value * rhs
        elif op == "/":
            value = value / rhs
        elif op == "//":
            value = value // rhs
        else:
            value = value % rhs
    return value, tokens


def _unary(tokens: list[str]):
    if tokens and tokens[0] == "-":
        value, tokens = _unary(tokens[1:])
        return -value, tokens
    if tokens and tokens[0] == "(":
        value, tokens = _sum(tokens[1:])
        if not tokens or tokens[0] != ")":
            raise CalcError("missing )")
        return value, tokens[1:]
    if tokens and tokens[0][0].isdigit():
        number = tokens[0]
        return (float(number) if "." in number else int(number)), tokens[1:]
    raise CalcError(f"expected a number, got {tokens[0] if tokens else 'the end'!r}")


def tool_result(text: str) -> str | None:
    """What the calculator says to the model's text, or None when it called no tool."""
    found = CALL.findall(text)
    if not found:
        return None
    try:
        return f"result: {calculate(found[-1])}"
    except (CalcError, ArithmeticError) as e:
        return f"error: {e}"


def is_right(text: str, answer: str) -> bool:
    numbers = re.findall(r"-?\d+", text)
    return bool(numbers) and numbers[-1] == answer.strip()


async def run(data: dict, client) -> float:
    messages = [{"role": "user", "content": data["prompt"]}]
    for _ in range(MAX_CALLS):
        reply = await client.chat.completions.create(model="default", messages=messages)
        text = reply.choices[0].message.content
        result = tool_result(text)
        if result is None:  # a final answer
            return RIGHT if is_right(text, data["answer"]) else WRONG
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": result},
        ]
    return WRONG  # still calling the calculator after MAX_CALLS calls
