"""The example agents' environments: the calculator's parser never evaluates code."""

from __future__ import annotations

import pytest

from examples.calculator import CalcError, calculate, tool_result
from examples.multi_turn_arith import is_right


@pytest.mark.parametrize(
    ("text", "value"),
    [("1+2*3", 7), ("(1+2)*3", 9), ("-4 + 10", 6), ("7/2", 3.5), ("7//2", 3), ("7 % 4", 3),
     ("--3", 3), ("2*(3-(4-5))", 8), ("1.5*2", 3.0)],
)  # fmt: skip
def test_calculator_evaluates_arithmetic(text, value):
    assert calculate(text) == value


@pytest.mark.parametrize(
    "text",
    ["__import__('os').system('true')", "2**10", "open('x')", "1+", "(1+2", "1 2", "",
     "9" * 60 + "*" + "9" * 60, "x", "1;2", "lambda: 1"],
)  # fmt: skip
def test_calculator_refuses_anything_else(text):
    with pytest.raises(CalcError):
        calculate(text)


def test_tool_result():
    assert tool_result("let me see <calc>12+30</calc>") == "result: 42"
    assert tool_result("<calc>1/0</calc>") == "error: division by zero"
    assert tool_result("<calc>1+</calc>").startswith("error:")
    assert tool_result("42") is None


def test_multi_turn_grader():
    assert is_right("it is 7", "7") and not is_right("8", "7") and not is_right("", "7")
