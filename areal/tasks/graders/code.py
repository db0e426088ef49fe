"""Code grading: the response's last fenced Python block must pass every unit test.

    response --last ```python block--> program
    tests (DeepCoder / TACO / LiveCodeBench forms) --normalise--> [Case(kind, input, output)]
    each case: program in the sandbox (areal.tasks.graders.sandbox) --stdout--> compare

Test forms accepted (a JSON string of any of them too):
- a list of {"input": str, "output": str} stdin/stdout cases (codeforces, primeintellect);
  "testtype": "functional" (LiveCodeBench) or "type": "function_call" (primeintellect)
  with "fn_name" / "metadata": {"func_name"} make a case a function call;
- a dict {"inputs": [...], "outputs": [...], "fn_name"?} (TACO / APPS) or
  {"input": [...], "output": [...]} (code_contests).
A function-call input is a list of arguments, or text holding one JSON value per line.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from areal.tasks.graders.sandbox import Limits, run_python

MAX_RESPONSE_CHARS = 200_000
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

# Runs inside the sandbox for a function-call case: import the solution, call the function
# (a method of class Solution, LeetCode-style, or a top-level function), print the result
# as JSON. The marker line keeps the program's own prints apart from the result.
_CALL_HARNESS = """\
import json, sys
sys.setrecursionlimit(100000)
args = json.loads(open("args.json").read())
ns = {"__name__": "solution"}
exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
name = open("fn_name.txt").read()
fn = getattr(ns["Solution"](), name) if "Solution" in ns and hasattr(ns["Solution"], name) \\
    else ns[name]
result = fn(*args)
sys.stdout.write("\\n@@areal-result@@\\n" + json.dumps(result))
"""
_RESULT_MARK = b"\n@@areal-result@@\n"


@dataclasses.dataclass(frozen=True)
class Case:
    input: str | list
    output: object
    fn_name: str = ""  # empty: a stdin/stdout case


def extract_program(response: str) -> str | None:
    """The last fenced code block (```python preferred, a bare ``` accepted), or None."""
    blocks = _FENCE.findall(response[-MAX_RESPONSE_CHARS:])
    return blocks[-1] if blocks else None


def parse_tests(tests: Any) -> list[Case]:
    """Normalise any accepted test form to cases; raises ValueError on an unknown form."""
    if isinstance(tests, str):
        tests = json.loads(tests)
    if isinstance(tests, dict):
        ins = tests.get("inputs", tests.get("input"))
        outs = tests.get("outputs", tests.get("output"))
        if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs):
            raise ValueError("a dict of tests needs equally long lists 'inputs' and 'outputs'")
        fn = tests.get("fn_name") or ""
        return [Case(i, o, fn) for i, o in zip(ins, outs, strict=True)]
    if isinstance(tests, list):
        cases = []
        for t in tests:
            if not isinstance(t, dict) or "input" not in t or "output" not in t:
                raise ValueError(f"a test must be a dict with 'input' and 'output', got {t!r:.80}")
            fn = t.get("fn_name") or (t.get("metadata") or {}).get("func_name") or ""
            functional = t.get("testtype") == "functional" or t.get("type") == "function_call"
            cases.append(Case(t["input"], t["output"], fn if functional or fn else ""))
        return cases
    raise ValueError(f"tests must be a list or a dict, got {type(tests).__name__}")


def _tokens(text: str) -> list[list[str]]:
    """Lines split into tokens, trailing blank lines dropped: whitespace never matters."""
    lines = [ln.split() for ln in text.strip().splitlines()]
    return [ln for ln in lines if ln]


def same_output(actual: str, expected: Any) -> bool:
    """Token-by-token, line-by-line equality; numbers within 1e-6 (relative) are equal."""
    if isinstance(expected, list):  # some TACO rows hold the expected lines as a list
        expected = "\n".join(map(str, expected))
    got, want = _tokens(actual), _tokens(str(expected))
    if len(got) != len(want):
        return False
    return all(
        len(a) == len(e) and all(_same_token(x, y) for x, y in zip(a, e, strict=True))
        for a, e in zip(got, want, strict=True)
    )


def _same_token(x: str, y: str) -> bool:
    if x == y:
        return True
    try:  # "0.5000000" vs "0.5": printed precision differs, the number does not
        fx, fy = float(x), float(y)
    except ValueError:
        return False
    return abs(fx - fy) <= 1e-6 * max(1.0, abs(fy))


def _call_args(raw: Any) -> list:
    if isinstance(raw, list):
        return raw
    return [json.loads(line) for line in str(raw).splitlines() if line.strip()]


def _expected_value(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def passes(program: str, case: Case, limits: Limits) -> bool:
    if not case.fn_name:
        run = run_python(program, str(case.input), limits)
        if run.timed_out or run.returncode != 0 or len(run.stdout) > limits.output_bytes:
            return False
        return same_output(run.stdout.decode(errors="replace"), case.output)
    files = {
        "solution.py": program,
        "args.json": json.dumps(_call_args(case.input)),
        "fn_name.txt": case.fn_name,
    }
    run = run_python(_CALL_HARNESS, "", limits, files)
    if run.timed_out or run.returncode != 0 or _RESULT_MARK not in run.stdout:
        return False
    try:
        result = json.loads(run.stdout.rsplit(_RESULT_MARK, 1)[1])
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    expected = _expected_value(case.output)
    # TACO wraps a function's expected value in a one-element list.
    return result == expected or [result] == expected


def is_correct(response: str, tests: Any, time_limit_s: float = 6.0, memory_mb: int = 1024) -> bool:
    """True when the last code block of `response` passes every test (stops at a failure)."""
    program = extract_program(response)
    if program is None:
        return False
    cases = parse_tests(tests)
    if not cases:
        raise ValueError("a code problem with no tests cannot be graded")
    limits = Limits(time_s=time_limit_s, memory_mb=memory_mb)
    return all(passes(program, case, limits) for case in cases)
