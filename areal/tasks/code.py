"""Code problems from a file (DeepCoder-style), graded by running their unit tests.

record {"problem", "tests" (list/dict, or JSON text)} --template--> row {"prompt", "answer"}
response --last ```python block--> every test in the sandbox (areal.tasks.graders.code), under
reward.code_time_limit_s and reward.code_memory_mb
"""

from __future__ import annotations

import json

from areal.config import RewardConfig
from areal.tasks import Task
from areal.tasks.graders.code import is_correct, parse_tests

TEMPLATE = (
    "{problem}\n\nWrite a Python program that solves the problem. Present the code in\n"
    "```python\nYour code\n```\nat the end."
)


def from_record(record: dict) -> dict:
    problem, tests = record.get("problem"), record.get("tests")
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError("no 'problem' text")
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as e:
            raise ValueError(f"'tests' is a string but not JSON ({e.msg})") from None
    if tests is None:
        raise ValueError("no 'tests'")
    if not parse_tests(tests):  # raises ValueError naming what is wrong
        raise ValueError("'tests' holds no test")
    return {"prompt": TEMPLATE.format(problem=problem.strip()), "answer": tests}


def grader_options(reward_cfg: RewardConfig) -> dict:
    """The sandbox's limits per test case."""
    return {"time_limit_s": reward_cfg.code_time_limit_s, "memory_mb": reward_cfg.code_memory_mb}


TASK = Task(
    name="code",
    from_record=from_record,
    record_fields="'problem' and 'tests'",
    is_correct=is_correct,
    grader_options=grader_options,
    uses_sandbox=True,
)
