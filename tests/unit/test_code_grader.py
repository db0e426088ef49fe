"""Code grading without running code: program extraction, test forms, output comparison."""

from __future__ import annotations

import json
import time

import pytest

from areal.tasks.graders.code import Case, extract_program, parse_tests, same_output


def test_the_last_fenced_block_is_the_program():
    response = "Try:\n```python\nprint(1)\n```\nBetter:\n```python\nprint(2)\n```\nDone."
    assert extract_program(response) == "print(2)\n"
    assert extract_program("```py\nx = 1\n```") == "x = 1\n"
    assert extract_program("```\nbare = True\n```") == "bare = True\n"
    assert extract_program("no code here") is None
    assert extract_program("```python\nunclosed = 1\n") is None


def test_stdin_cases_as_a_plain_list_and_as_a_json_string():
    tests = [
        {"input": "1 2\n", "output": "3\n"},
        {"input": "5 5", "output": "10", "testtype": "stdin"},
    ]
    expected = [Case("1 2\n", "3\n"), Case("5 5", "10")]
    assert parse_tests(tests) == expected
    assert parse_tests(json.dumps(tests)) == expected


def test_functional_cases_in_the_livecodebench_and_primeintellect_forms():
    meta = {"func_name": "f"}
    lcb = [{"input": "1\n2", "output": "3", "testtype": "functional", "metadata": meta}]
    prime = [{"input": [1, 2], "output": 3, "type": "function_call", "fn_name": "f"}]
    assert parse_tests(lcb) == [Case("1\n2", "3", "f")]
    assert parse_tests(prime) == [Case([1, 2], 3, "f")]


def test_taco_and_code_contests_dicts():
    taco = {"inputs": [[[1, 2]], [[3]]], "outputs": [[2], [3]], "fn_name": "maxOf"}
    assert parse_tests(taco) == [Case([[1, 2]], [2], "maxOf"), Case([[3]], [3], "maxOf")]
    contests = {"input": ["1\n", "2\n"], "output": ["a\n", "b\n"]}
    assert parse_tests(json.dumps(contests)) == [Case("1\n", "a\n"), Case("2\n", "b\n")]


@pytest.mark.parametrize(
    "tests",
    [{"inputs": ["1"], "outputs": []}, [{"input": "1"}], ["1 2"], 7, "not json"],
)
def test_malformed_tests_are_rejected(tests):
    with pytest.raises(ValueError):
        parse_tests(tests)


@pytest.mark.parametrize(
    "actual, expected, same",
    [
        ("3\n", "3", True),
        ("1  2 3  \n\n", "1 2 3\n", True),
        ("1\r\n2\r\n", "1\n2\n", True),
        ("0.5000000\n", "0.5", True),
        ("1 2\n3", "1\n2 3", False),  # line structure matters
        ("3", "4", False),
        ("", "4", False),
        ("YES", "yes", False),
        ("a\nb\n", ["a", "b"], True),  # expected lines given as a list
    ],
)
def test_output_comparison_ignores_whitespace_only(actual, expected, same):
    assert same_output(actual, expected) is same


def test_huge_and_pathological_responses_are_fast():
    t0 = time.time()
    extract_program("```" * 100_000)  # many unclosed fences: no quadratic blow-up
    assert extract_program("x" * 10_000_000 + "```python\nprint(1)\n```") == "print(1)\n"
    assert extract_program("```python\n" * 50_000) is not None
    assert time.time() - t0 < 6
