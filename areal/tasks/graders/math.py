"""Math grading: the response's last `\\boxed{...}` must equal the gold answer (math-verify).

    response --last \\boxed{} (nested braces)--> answer --screen--> verdict, when certain:
        no answer: wrong; the gold's own string (trivially normalised): right;
        two integers: compared as integers
    otherwise "$answer$", gold ("\\frac{1}{2}", "0.5", "[1, 3)", "\\{1, 2\\}", "5\\text{ cm}")
        --parse--> sympy --math_verify.verify--> verdict, memoised per (answer, gold)

Screening first matters on a CPU node: math-verify parses both sides with sympy (milliseconds
a response, on the cores that generate and train), while a policy that has learnt a task
mostly writes the gold answer itself (benchmarks/grading.py).

math-verify's own time limits use SIGALRM, which fails off the main thread and would
silently score everything 0 there: they are switched off (None) here, and the reward
service's process pool enforces the time limit by killing the grading process instead.
"""

from __future__ import annotations

import functools
import logging
import re

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

# math-verify warns on every call that its timeouts are off; they are off on purpose.
logging.getLogger("math_verify").setLevel(logging.ERROR)

MAX_RESPONSE_CHARS = 100_000  # only the tail is searched: the final answer is at the end
MAX_ANSWER_CHARS = 1_000  # a longer "answer" is not a final answer, and sympy would crawl

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_CONFIG = (LatexExtractionConfig(), ExprExtractionConfig())
_AROUND_SYMBOLS = re.compile(r"\s*([^\w\\\s])\s*")  # spaces beside a symbol: "1, 2" is "1,2"
_INTEGER = re.compile(r"-?\d+")
_FRAC = re.compile(r"\\[dt]frac(?![a-zA-Z])")
_SIZED = re.compile(r"\\(left|right)(?![a-zA-Z])")  # \left( is (; \leftarrow is not


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, `\\boxed 5`), braces balanced."""
    text = text[-MAX_RESPONSE_CHARS:]
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    while start >= 0:
        found = _box_content(text, start)
        if found is not None:
            return found
        # An unclosed box (a truncated response): try the one before it.
        start = max(text.rfind(cmd, 0, start) for cmd in _BOX_COMMANDS)
    return None


def _box_content(text: str, start: int) -> str | None:
    i = text.index("{", start) if "{" in text[start : start + 8] else -1
    if i < 0:  # "\boxed 5": the argument runs to the next space or "$"
        rest = text[start:].split(None, 1)
        if len(rest) < 2 or rest[0] not in _BOX_COMMANDS:
            return None
        return rest[1].split("$", 1)[0].split()[0] if rest[1].strip() else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _parse(latex: str) -> list:
    return parse(f"${latex}$", extraction_config=_CONFIG, parsing_timeout=None)


def _normal(latex: str) -> str:
    """Spelling that never changes the value: outer $ and spaces, spaces beside symbols,
    \\dfrac/\\tfrac for \\frac, \\left/\\right."""
    text = latex.strip().removeprefix("$").removesuffix("$")
    text = _SIZED.sub("", _FRAC.sub(r"\\frac", text))
    return _AROUND_SYMBOLS.sub(r"\1", text.strip())


def screen(response: str, gold: str) -> bool | tuple[str, str]:
    """The verdict where it is certain without sympy (no final answer: wrong; the gold's own
    string after trivial normalisation: right; two integers: their values decide); otherwise
    the question only math-verify answers, (answer, gold), whose verdict may be reused for
    every response that asks it."""
    answer = last_boxed(response)
    if answer is None or not answer.strip() or len(answer) > MAX_ANSWER_CHARS:
        return False
    mine, theirs = _normal(answer), _normal(gold)
    if mine == theirs and mine:
        return True
    if _INTEGER.fullmatch(mine) and _INTEGER.fullmatch(theirs):
        return int(mine) == int(theirs)
    return answer, gold


def is_correct(response: str, gold: str) -> bool:
    """True when the response's final boxed answer is equivalent to `gold`."""
    verdict = screen(response, gold)
    return verdict if isinstance(verdict, bool) else verify_answer(*verdict)


@functools.lru_cache(maxsize=65536)
def verify_answer(answer: str, gold: str) -> bool:
    """math-verify's verdict on a boxed answer against the gold one (memoised: a group's
    wrong answers repeat). ValueError for a gold answer it cannot read."""
    gold_parsed = _parse(gold.strip().removeprefix("$").removesuffix("$"))
    if not gold_parsed:
        # A gold answer math-verify cannot read is a data problem: let the service count it.
        raise ValueError(f"cannot parse the gold answer {gold!r}")
    answer_parsed = _parse(answer)
    if not answer_parsed:
        return False
    return verify(gold_parsed, answer_parsed, timeout_seconds=None)
