"""DeepScaleR / DeepCoder style files: formats, prompts, malformed rows, clear errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from areal.config import ConfigError, DatasetConfig
from areal.data.dataset import load_rows

DATA = Path(__file__).resolve().parents[1] / "data"


def load_file_rows(task: str, path: str) -> list[dict]:
    """The rows a run with dataset.type=task, dataset.path=path trains on."""
    return load_rows(DatasetConfig(type=task, path=path), seed=0)


def test_math_samples_in_jsonl_and_json():
    rows = load_file_rows("math", str(DATA / "math_sample.jsonl"))
    assert len(rows) == 12
    assert all(r["task"] == "math" for r in rows)
    assert rows[0]["prompt"].endswith(
        "Let's think step by step and output the final answer within \\boxed{}."
    )
    assert rows[0]["answer"] == "\\frac{3}{4}"
    as_array = load_file_rows("math", str(DATA / "math_sample.json"))
    assert [r["answer"] for r in as_array] == [r["answer"] for r in rows[:4]]


def test_code_samples_with_both_test_styles():
    rows = load_file_rows("code", str(DATA / "code_sample.jsonl"))
    assert len(rows) == 5
    assert all(r["task"] == "code" and "```python" in r["prompt"] for r in rows)
    # Tests stored as JSON strings arrive decoded: the grader gets plain lists and dicts.
    assert isinstance(rows[0]["answer"], list)
    assert isinstance(rows[3]["answer"], dict) and rows[3]["answer"]["fn_name"] == "maxOf"


def test_malformed_rows_are_reported_with_file_and_line_and_skipped(tmp_path, caplog):
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        json.dumps({"problem": "1+1?", "answer": "2"})
        + "\n{not json\n"
        + json.dumps({"problem": "no answer"})
        + "\n\n"
        + json.dumps({"problem": "2+2?", "answer": 4})  # a number answer is fine
        + "\n"
        + json.dumps(["a", "list"])
        + "\n"
    )
    with caplog.at_level(logging.WARNING, logger="areal.data"):
        rows = load_file_rows("math", str(path))
    assert [r["answer"] for r in rows] == ["2", "4"]
    text = caplog.text
    assert f"{path}:2" in text and "invalid JSON" in text
    assert f"{path}:3" in text and "'answer'" in text
    assert f"{path}:6" in text
    assert "skipped 3 malformed rows, kept 2" in text


def test_json_array_rows_know_their_line(tmp_path, caplog):
    path = tmp_path / "rows.json"
    path.write_text('[\n {"problem": "a", "answer": "1"},\n {"problem": "b"}\n]\n')
    with caplog.at_level(logging.WARNING, logger="areal.data"):
        assert len(load_file_rows("math", str(path))) == 1
    assert f"{path}:3" in caplog.text


def test_bad_code_tests_are_skipped(tmp_path):
    path = tmp_path / "code.jsonl"
    good = {"problem": "p", "tests": [{"input": "1", "output": "1"}]}
    lines = [good, {"problem": "p", "tests": "[oops"}, {"problem": "p", "tests": []}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert len(load_file_rows("code", str(path))) == 1


def test_a_file_without_usable_rows_is_a_clear_error(tmp_path):
    path = tmp_path / "code_rows.jsonl"
    path.write_text(json.dumps({"problem": "p", "tests": [{"input": "1", "output": "1"}]}) + "\n")
    with pytest.raises(ConfigError, match="no usable math row .*'problem' and 'answer'"):
        load_file_rows("math", str(path))


@pytest.mark.parametrize(
    "name, needle",
    [("missing.jsonl", "does not exist"), ("rows.csv", "unknown file type")],
)
def test_path_mistakes_say_what_to_do(tmp_path, name, needle):
    if name.endswith(".csv"):
        (tmp_path / name).write_text("problem,answer\n")
    with pytest.raises(ConfigError, match=needle):
        load_file_rows("math", str(tmp_path / name))


def test_parquet_without_pyarrow_names_the_install(tmp_path):
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        path = tmp_path / "rows.parquet"
        path.write_bytes(b"PAR1")
        with pytest.raises(ConfigError, match="pip install pyarrow"):
            load_file_rows("math", str(path))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "rows.parquet"
        pq.write_table(pa.table({"problem": ["1+1?"], "answer": ["2"]}), path)
        assert load_file_rows("math", str(path))[0]["answer"] == "2"


def test_a_directory_of_shards_is_read_whole(tmp_path):
    (tmp_path / "a").mkdir()
    for name, answer in (("a/part0.jsonl", "1"), ("part1.json", "2")):
        record = {"problem": "p", "answer": answer}
        text = json.dumps(record) if name.endswith("l") else json.dumps([record])
        (tmp_path / name).write_text(text + "\n")
    (tmp_path / "README.md").write_text("not data")
    assert [r["answer"] for r in load_file_rows("math", str(tmp_path))] == ["1", "2"]


def test_prompts_over_max_prompt_len_are_dropped_and_none_left_is_an_error(caplog):
    from areal.data.dataset import tokenize_rows
    from areal.models.tiny import build_tokenizer

    tok = build_tokenizer()
    rows = [{"prompt": "1 + 2 = ?", "answer": "3"}, {"prompt": "1 + 2 = ? " * 50, "answer": "3"}]
    short = len(tok.apply_chat_template([{"role": "user", "content": rows[0]["prompt"]}],
                                        add_generation_prompt=True, tokenize=True,
                                        return_dict=False))  # fmt: skip
    kept = tokenize_rows(rows, tok, max_prompt_len=short)
    assert [r["prompt"] for r in kept] == [rows[0]["prompt"]]
    assert len(kept[0]["prompt_ids"]) == short
    assert "dropped 1 prompts longer than dataset.max_prompt_len" in caplog.text
    with pytest.raises(ValueError, match="no prompt fits dataset.max_prompt_len=3: raise it"):
        tokenize_rows(rows, tok, max_prompt_len=3)
