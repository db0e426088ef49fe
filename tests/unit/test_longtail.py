"""The longtail task: its scratchpads, its long-tailed lengths, its grader and warm-up."""

from __future__ import annotations

import json
import random
import re
import statistics

import pytest

from areal.config import DatasetConfig
from areal.data.dataset import load_rows
from areal.models import tiny
from areal.tasks import load_task, longtail

LINE = re.compile(r"(\d\d) \+(\d) (\d\d\d)")


def parse(prompt: str) -> tuple[int, int, int]:
    addend, start, steps = map(
        int, re.fullmatch(r"add (\d+) to (\d+), (\d+) times", prompt).groups()
    )
    return start, addend, steps


def test_scratchpad_counts_down_and_adds_one_line_per_step():
    pad = longtail.scratchpad(15, 3, 4)
    assert pad == "03 +3 018\n02 +3 021\n01 +3 024\n00 +3 027"
    assert longtail.is_correct(pad, "27")


def test_problems_are_consistent_and_seeded():
    rows = load_rows(DatasetConfig(type="longtail", n_problems=500), seed=3)
    assert rows == load_rows(DatasetConfig(type="longtail", n_problems=500), seed=3)
    assert rows != load_rows(DatasetConfig(type="longtail", n_problems=500), seed=4)
    for row in rows:
        start, addend, steps = parse(row["prompt"])
        assert row["task"] == "longtail"
        assert row["answer"] == str(start + addend * steps)
        assert 0 <= start <= longtail.MAX_START and 1 <= addend <= longtail.MAX_ADDEND
        assert longtail.SCALE <= steps <= longtail.MAX_STEPS
        pad = longtail.scratchpad(start, addend, steps)
        assert [int(m[0]) for m in LINE.findall(pad)] == list(range(steps - 1, -1, -1))
        assert longtail.is_correct(pad, row["answer"])


def test_steps_follow_the_stated_pareto_tail():
    rng = random.Random(0)
    steps = [longtail.draw_steps(rng) for _ in range(20000)]
    # P(steps >= k) = (SCALE / k) ** ALPHA below the cap.
    for k in (4, 10, 30):
        expected = (longtail.SCALE / k) ** longtail.ALPHA
        assert sum(s >= k for s in steps) / len(steps) == pytest.approx(expected, rel=0.1)
    assert statistics.median(steps) == 3
    q = longtail.length_quantiles()
    assert q["p99"] >= 8 * q["p50"] and q["p99"] >= 500 and q["p50"] >= 10


def test_lengths_in_tokens_match_the_tiny_tokenizer():
    tok = tiny.build_tokenizer(0)
    for steps in (2, 7, 50):
        pad = longtail.scratchpad(20, 3, steps)
        # +1: the end-of-turn token replaces the last line's newline.
        assert (
            len(tok.encode(pad, add_special_tokens=False)) + 1 == longtail.TOKENS_PER_STEP * steps
        )


@pytest.mark.parametrize(
    "response, right",
    [
        ("01 +3 018\n00 +3 021", True),
        ("01 +3 018\n00 +3 021\n", True),
        ("00 +3 21", True),  # the value counts, not its zero padding
        ("01 +3 018\n00 +3 022", False),  # one addition wrong
        ("01 +3 019\n00 +3 021", True),  # only the final answer is graded, as in the paper
        ("01 +3 018\n00 +3", False),  # cut off before the answer: the last integer is 3
        ("", False),
        ("so the answer is twenty-one", False),
    ],
)
def test_grader_looks_at_the_final_answer_only(response, right):
    assert longtail.is_correct(response, "21") is right
    assert load_task("longtail").is_correct(response, "21") is right


def test_warmup_answers_are_wrong_at_the_stated_rate_and_cover_every_length():
    rng = random.Random(0)
    wrong = total = 0
    longest = 0
    for _ in range(150):
        for prompt, pad in longtail.warmup_batch(rng):
            start, addend, steps = parse(prompt)
            lines = LINE.findall(pad)
            assert [int(m[0]) for m in lines] == list(range(steps - 1, -1, -1))
            totals = [start] + [int(m[2]) for m in lines]
            wrong += sum(b - a != addend for a, b in zip(totals, totals[1:], strict=False))
            total += steps
            longest = max(longest, steps)
    assert wrong / total == pytest.approx(longtail.WARMUP_NOISE, abs=0.02)
    assert longest == longtail.MAX_STEPS


def test_dataset_config_makes_longtail_rows():
    rows = load_rows(DatasetConfig(type="longtail", n_problems=50), seed=1)
    assert len(rows) == 50 and all(r["task"] == "longtail" for r in rows)


def response_nll(model_dir) -> float:
    """Mean per-token NLL of clean worked answers under the model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    nll = []
    for row in longtail.make_problems(8, seed=9):
        prompt = tiny.chat_prompt_ids(tok, row["prompt"])
        pad = longtail.scratchpad(*parse(row["prompt"]))
        ids = torch.tensor([prompt + tok.encode(pad, add_special_tokens=False)])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
        token_lp = lp.gather(-1, ids[0, 1:, None])[len(prompt) - 1 :, 0]
        nll.append(-token_lp.mean().item())
    return statistics.mean(nll)


@pytest.mark.timeout(120)
def test_warm_up_teaches_the_format_and_records_the_task(tmp_path):
    before = tiny.make_tiny_model(tmp_path / "m0", warmup_steps=0, task="longtail")
    after = tiny.make_tiny_model(tmp_path / "m30", warmup_steps=30, task="longtail")
    assert json.loads((after / "areal_tiny.json").read_text())["task"] == "longtail"
    assert response_nll(after) < 0.5 * response_nll(before)
