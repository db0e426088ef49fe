"""Math grading by final boxed answer: extraction and equivalence (math-verify, in-process)."""

from __future__ import annotations

import threading
import time

import pytest

from areal.tasks.graders.math import (
    MAX_RESPONSE_CHARS,
    is_correct,
    last_boxed,
    screen,
    verify_answer,
)


@pytest.mark.parametrize(
    "text, boxed",
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}"),  # nested braces
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces of a set
        (r"first \boxed{1}, then \boxed{2}", "2"),  # the last box wins
        (r"\boxed{7} and an unclosed \boxed{8", "7"),  # a truncated final box is skipped
        (r"\fbox{5}", "5"),
        (r"$\boxed 9$", "9"),
        ("no box at all: 42", None),
        (r"\boxed{", None),
        ("", None),
    ],
)
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize(
    "response, gold",
    [
        (r"\boxed{\frac{1}{2}}", "0.5"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{1/2}", r"\frac12"),
        (r"\boxed{\dfrac{3}{4}}", "0.75"),
        (r"\boxed{\{2, 1\}}", r"\{1, 2\}"),  # sets ignore order
        (r"\boxed{[1, 3)}", "[1, 3)"),
        (r"\boxed{(1,3)}", "(1, 3)"),
        (r"\boxed{5\text{ cm}}", "5"),  # units
        (r"\boxed{50\%}", "50"),
        (r"\boxed{x^2+2x+1}", "(x+1)^2"),  # symbolic equivalence
        (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
        (r"\boxed{\pi}", r"\pi"),
        (r"Thinking... \boxed{3} no wait, \boxed{4}", "4"),
        ("x = 10, so the answer is $\\boxed{10}$.", "$10$"),  # gold may carry $...$
    ],
)
def test_equivalent_answers_are_correct(response, gold):
    assert is_correct(response, gold)


@pytest.mark.parametrize(
    "response, gold",
    [
        (r"\boxed{3}", "4"),
        (r"\boxed{(1,3)}", "[1, 3)"),  # open vs half-open interval
        (r"\boxed{3.14}", r"\pi"),
        (r"\boxed{4} no wait, \boxed{3}", "4"),  # only the final answer counts
        ("The answer is 4.", "4"),  # no box, no credit
        (r"\boxed{}", "4"),
        (r"\boxed{\frac{}{}}", "4"),
        (r"\boxed{@@#$%^&}", "4"),
        ("\x00\xff garbage \\boxed{{{{", "4"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2, 3\}"),
    ],
)
def test_wrong_and_garbage_answers_are_wrong(response, gold):
    assert not is_correct(response, gold)


def test_a_huge_response_is_capped_and_fast():
    # Megabytes of thinking followed by the answer: only the tail is read.
    response = ("{" * 1000 + "blah \\boxed{" * 1000) * 200 + r" so \boxed{12}"
    assert len(response) > 10 * MAX_RESPONSE_CHARS
    t0 = time.time()
    assert is_correct(response, "12")
    assert not is_correct(r"\boxed{" + "1" * 5000 + "}", "1" * 5000)  # a huge "answer"
    assert time.time() - t0 < 10


def test_an_unparseable_gold_answer_is_an_error_not_a_verdict():
    with pytest.raises(ValueError, match="gold answer"):
        is_correct(r"\boxed{1}", "")


def test_grading_works_off_the_main_thread():
    """The SIGALRM trap of the public system: math-verify's own timeouts are off here."""
    results = []
    t = threading.Thread(target=lambda: results.append(is_correct(r"\boxed{\frac{1}{2}}", "0.5")))
    t.start()
    t.join()
    assert results == [True]


@pytest.mark.parametrize(
    "response, gold",
    [
        (r"\boxed{5}", "5"),
        (r"\boxed{05}", "5"),
        (r"\boxed{-0}", "0"),
        (r"\boxed{7}", "8"),
        (r"\boxed{12}", "$12$"),
        (r"\boxed{ \dfrac{1}{2} }", r"\frac{1}{2}"),
        (r"\boxed{\tfrac12}", r"\frac12"),
        (r"\boxed{\left(1, 3\right)}", "(1,3)"),
        (r"\boxed{\left[1, 3\right)}", "[1, 3)"),
        (r"\boxed{\{1, 2\}}", r"\{1,2\}"),
        (r"\boxed{x + 1}", "x+1"),
        (r"\boxed{5\text{ cm}}", r"5\text{ cm}"),
        (r"\boxed{-12}", "12"),
    ],
)
def test_a_screened_verdict_is_math_verifys(response, gold):
    """Certain verdicts skip sympy and agree with it: the answer is the gold's own string
    (spaces, \\dfrac, \\left/\\right aside) or both are integers."""
    verdict = screen(response, gold)
    assert isinstance(verdict, bool), verdict
    assert verdict == verify_answer.__wrapped__(last_boxed(response), gold)


@pytest.mark.parametrize(
    "response, gold",
    [
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{1 2}", "12"),  # spaces between digits are not trivially nothing
        (r"\boxed{\leftarrow}", "arrow"),  # \left only as a size command
        (r"\boxed{5.0}", "5"),
        (r"\boxed{2\sqrt{2}}", r"2 \sqrt{2}"),  # a space before a command is kept
    ],
)
def test_anything_else_is_a_question_for_math_verify(response, gold):
    assert screen(response, gold) == (last_boxed(response), gold)
