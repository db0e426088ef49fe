"""Math grading: the response's last `\\boxed{...}` must equal the gold answer (math-verify).

    response --last \\boxed{} (nested braces)--> "$content$" --parse--> sympy
    gold ("\\frac{1}{2}", "0.5", "[1, 3)", "\\{1, 2\\}", "5\\text{ cm}") --parse--> sympy
    math_verify.verify(gold, answer): fractions, decimals, LaTeX, sets, intervals, units

math-verify's own time limits use SIGALRM, which fails off the main thread and would
silently score everything 0 there: they are switched off (None) here, and the reward
service's process pool enforces the time limit by killing the grading process instead.
"""

from __future__ import annotations

import logging

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

# math-verify warns on every call that its timeouts are off; they are off on purpose.
logging.getLogger("math_verify").setLevel(logging.ERROR)

MAX_RESPONSE_CHARS = 100_000  # only the tail is searched: the final answer is at the end
MAX_ANSWER_CHARS = 1_000  # a longer "answer" is not a final answer, and sympy would crawl

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_CONFIG = (LatexExtractionConfig(), ExprExtractionConfig())


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


def is_correct(response: str, gold: str) -> bool:
    """True when the response's final boxed answer is equivalent to `gold`."""
    answer = last_boxed(response)
    if answer is None or not answer.strip() or len(answer) > MAX_ANSWER_CHARS:
        return False
    gold_parsed = _parse(gold.strip().removeprefix("$").removesuffix("$"))
    if not gold_parsed:
        # A gold answer math-verify cannot read is a data problem: let the service count it.
        raise ValueError(f"cannot parse the gold answer {gold!r}")
    answer_parsed = _parse(answer)
    if not answer_parsed:
        return False
    return verify(gold_parsed, answer_parsed, timeout_seconds=None)
