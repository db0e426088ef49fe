"""Tasks as one unit: found by short name or "package.module:object", rows tagged with the
spec they were loaded under, and the data and reward packages independent of each other."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from areal import tasks
from areal.config import ConfigError, DatasetConfig, RewardConfig, load_config
from areal.data.dataset import load_rows
from areal.tasks import Task, load_task

AREAL = Path(__file__).resolve().parents[2] / "areal"


def _reverse_rows(dataset_cfg, seed: int) -> list[dict]:
    words = ["abc", "hello", "tasks"]
    return [{"prompt": f"reverse {w}", "answer": w[::-1]} for w in words[: dataset_cfg.n_problems]]


REVERSE = Task(
    name="reverse",
    generate=_reverse_rows,
    is_correct=lambda response, answer: response.strip().endswith(answer),
)
"""A task of one's own, made in code: this module is all it takes."""

PAIRS = Task(
    name="pairs",
    from_record=lambda r: {"prompt": r["q"], "answer": r["a"]},
    record_fields="'q' and 'a'",
    is_correct=lambda response, answer: response == answer,
)
"""One read from dataset.path (a KeyError is not a malformed row: ValueError is)."""


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


@pytest.mark.parametrize(("package", "other"), [("data", "reward"), ("reward", "data")])
def test_data_and_reward_do_not_import_each_other(package, other):
    files = sorted((AREAL / package).rglob("*.py"))
    assert files
    for f in files:
        bad = sorted(m for m in imported_modules(f) if m.split(".")[:2] == ["areal", other])
        assert not bad, f"{f.relative_to(AREAL.parent)} imports {bad}"


def test_the_import_check_sees_function_level_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from areal.reward import service\n    import areal.data.files\n")
    assert {"areal.reward.service", "areal.data.files"} <= imported_modules(f)


def test_builtin_tasks_are_one_module_each():
    assert tasks.names() == ("arith", "longtail", "code", "math")  # made in code first
    for name in tasks.names():
        task = load_task(name)
        assert task.name == name and task is load_task(name)
        assert task.needs_path == (name in ("code", "math"))
        assert (task.warmup is not None) == (name in ("arith", "longtail", "math"))
        assert (task.screen is not None) == (name == "math")


def test_an_unknown_task_names_the_known_ones():
    with pytest.raises(ConfigError, match="unknown task 'sums'.*arith, longtail, code, math"):
        load_task("sums")
    with pytest.raises(ConfigError, match="dataset.type must be one of arith, longtail, code"):
        DatasetConfig(type="sums")
    with pytest.raises(ConfigError, match="cannot import 'nope.tasks'"):
        load_task("nope.tasks:TASK")
    with pytest.raises(ConfigError, match="has no 'NOPE'"):
        load_task(f"{__name__}:NOPE")
    with pytest.raises(ConfigError, match="is a function, not an areal.tasks.Task"):
        load_task(f"{__name__}:imported_modules")


def test_a_task_of_ones_own_is_named_in_the_config_only():
    spec = f"{__name__}:REVERSE"
    cfg = load_config(None, [f"dataset.type={spec}", "dataset.n_problems=2"])
    rows = load_rows(cfg.dataset, seed=0)
    # The spec travels with the row: the reward service loads the task from it.
    assert rows == [
        {"prompt": "reverse abc", "answer": "cba", "task": spec},
        {"prompt": "reverse hello", "answer": "olleh", "task": spec},
    ]
    assert load_task(rows[0]["task"]).is_correct("it is cba", rows[0]["answer"])
    assert load_task(spec).grader_options(RewardConfig()) == {}


def test_a_file_task_of_ones_own_reads_its_records(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ({"q": "1", "a": "2"}, {"q": "3", "a": "4"})))
    spec = f"{__name__}:PAIRS"
    rows = load_rows(DatasetConfig(type=spec, path=str(path)), seed=0)
    assert [(r["prompt"], r["answer"], r["task"]) for r in rows] == [
        ("1", "2", spec),
        ("3", "4", spec),
    ]
    with pytest.raises(
        ConfigError, match=f"dataset.path is required when dataset.type is '{spec}'"
    ):
        load_rows(DatasetConfig(type=spec), seed=0)


def test_the_code_task_takes_the_sandbox_limits_from_the_reward_section():
    options = load_task("code").grader_options(
        RewardConfig(code_time_limit_s=2.5, code_memory_mb=300)
    )
    assert options == {"time_limit_s": 2.5, "memory_mb": 300}
    program = "```python\nprint(sum(map(int, input().split())))\n```"
    assert load_task("code").is_correct(program, [{"input": "2 3\n", "output": "5\n"}], **options)
