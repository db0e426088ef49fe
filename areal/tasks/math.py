"""Math problems from a file (DeepScaleR-style), graded on the final boxed answer.

record {"problem", "answer", "solution"?} --R1-distill template--> row {"prompt", "answer"}
response --last \\boxed{}--> math-verify equivalence with the gold answer (areal.reward.math)
"""

from __future__ import annotations

from areal.tasks import Task

TEMPLATE = "{problem} Let's think step by step and output the final answer within \\boxed{{}}."


def from_record(record: dict) -> dict:
    problem, answer = record.get("problem"), record.get("answer")
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError("no 'problem' text")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError("no 'answer' string")
    return {"prompt": TEMPLATE.format(problem=problem.strip()), "answer": answer.strip()}


def is_correct(response: str, gold: str) -> bool:
    # Imported here: math-verify pulls in sympy (0.3 s), and the config imports this module.
    from areal.reward.math import is_correct as boxed_answer_matches

    return boxed_answer_matches(response, gold)


def screen(response: str, gold: str) -> bool | tuple[str, str]:
    from areal.reward.math import screen as screen_boxed_answer

    return screen_boxed_answer(response, gold)


TASK = Task(
    name="math",
    from_record=from_record,
    record_fields="'problem' and 'answer'",
    is_correct=is_correct,
    screen=screen,
    grader_imports=("areal.reward.math",),
)
