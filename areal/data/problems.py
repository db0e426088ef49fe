"""Math and code problems from a file: records -> rows {"prompt", "answer", "task"}.

    DeepScaleR-style math: {"problem", "answer", "solution"?}     -> answer: the gold string
    DeepCoder-style code:  {"problem", "tests" (list/dict or JSON)} -> answer: the tests
Prompts use the R1-distill templates (the answer boxed, the code in a python block), so
that the graders find what they look for. A malformed record is logged with its file and
line, skipped and counted; a file without one usable record is a `ConfigError`.
"""

from __future__ import annotations

import json
import logging

from areal.config import ConfigError
from areal.data.files import BadRecord, read_records
from areal.reward.code import parse_tests

log = logging.getLogger("areal.data")

MATH_TEMPLATE = "{problem} Let's think step by step and output the final answer within \\boxed{{}}."
CODE_TEMPLATE = (
    "{problem}\n\nWrite a Python program that solves the problem. Present the code in\n"
    "```python\nYour code\n```\nat the end."
)
_LOGGED = 10  # malformed rows logged one by one at most; the rest only counted


def math_row(record: dict) -> dict:
    problem, answer = record.get("problem"), record.get("answer")
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError("no 'problem' text")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError("no 'answer' string")
    return {
        "prompt": MATH_TEMPLATE.format(problem=problem.strip()),
        "answer": answer.strip(),
        "task": "math",
    }


def code_row(record: dict) -> dict:
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
    return {
        "prompt": CODE_TEMPLATE.format(problem=problem.strip()),
        "answer": tests,
        "task": "code",
    }


ROW_MAKERS = {"math": math_row, "code": code_row}


def load_file_rows(task: str, path: str) -> list[dict]:
    make = ROW_MAKERS[task]
    rows, skipped = [], 0
    for where, record in read_records(path):
        try:
            if isinstance(record, BadRecord):
                raise ValueError(record)
            if not isinstance(record, dict):
                raise ValueError(f"a record must be an object, got {type(record).__name__}")
            rows.append(make(record))
        except ValueError as e:
            skipped += 1
            if skipped <= _LOGGED:
                log.warning("%s: skipped a malformed %s row: %s", where, task, e)
    if skipped:
        log.warning("%s: skipped %d malformed rows, kept %d", path, skipped, len(rows))
    if not rows:
        raise ConfigError(
            f"dataset.path={path!r} has no usable {task} row ({skipped} malformed): each row "
            + ("needs 'problem' and 'answer'" if task == "math" else "needs 'problem' and 'tests'")
            + ", or set dataset.type to the file's task"
        )
    return rows
