"""Math problems from a file (DeepScaleR-style), graded on the final boxed answer.

record {"problem", "answer", "solution"?} --R1-distill template--> row {"prompt", "answer"}
response --last \\boxed{}--> math-verify equivalence with the gold answer
(areal/tasks/graders/math.py)

The tiny model's warm-up (a run without model.path) is sums asked in words and answered in
\\boxed{}: it learns the format a math run grades, on any file of records.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from areal.tasks import Batch, Task

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


def sum_records(n: int, seed: int, max_operand: int = 5) -> list[dict]:
    """n records {"problem", "answer"} of sums asked in words ("What is 4 + 1?")."""
    rng = random.Random(seed)
    pairs = [(rng.randint(0, max_operand), rng.randint(0, max_operand)) for _ in range(n)]
    return [{"problem": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs]


def warmup(dataset_cfg: object, seed: int) -> Iterator[Batch]:
    """Worked sums in three lengths, ending in \\boxed{}; the boxed sum is another record's
    half of the time, so that the model learns the format and only part of the arithmetic."""
    rng = random.Random(seed + 1)
    pool = sum_records(4096, seed + 1)
    while True:
        batch = []
        for record in rng.sample(pool, 64):
            a, b = record["problem"].removeprefix("What is ").removesuffix("?").split(" + ")
            total = record["answer"] if rng.random() < 0.5 else rng.choice(pool)["answer"]
            steps = rng.choice(
                ("", f"{a} + {b} = {total}. ", f"We add {a} and {b}: {a} + {b} = {total}. ")
            )
            answer = f"{steps}The answer is \\boxed{{{total}}}."
            batch.append((from_record(record)["prompt"], answer))
        yield batch


def is_correct(response: str, gold: str) -> bool:
    # Imported here: math-verify pulls in sympy (0.3 s), and the config imports this module.
    from areal.tasks.graders.math import is_correct as boxed_answer_matches

    return boxed_answer_matches(response, gold)


def screen(response: str, gold: str) -> bool | tuple[str, str]:
    from areal.tasks.graders.math import screen as screen_boxed_answer

    return screen_boxed_answer(response, gold)


TASK = Task(
    name="math",
    from_record=from_record,
    record_fields="'problem' and 'answer'",
    is_correct=is_correct,
    screen=screen,
    grader_imports=("areal.tasks.graders.math",),
    warmup=warmup,
)
