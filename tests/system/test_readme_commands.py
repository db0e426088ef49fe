"""The commands of README and the docs pages as written, each read from the page it lives on,
on the tiny default, shortened only by overrides appended (a fileroot of the test's, 2 steps,
no warm-up): a recipe (and the same command again, which leaves the finished run as it is),
LoRA and its export, and eval of a run directory.

The quick start (README's first line, docs/get-started/cpu.md's first run) is run by
tests/docs/test_get_started.py; here it is only checked to be that page's command. The eval
line names the quick start's run0; it evaluates this test's recipe run instead, so that no
command runs twice across the two tests.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHORT = ("total_train_steps=2", "model.tiny_warmup_steps=0")


def doc_command(page: str, marker: str) -> list[str]:
    """The one line of `page` (README.md or docs/...) holding `marker`, as argv (its comment,
    a trailing backslash's continuation joined, and any `... &&` before the command dropped)."""
    text = (ROOT / page).read_text().replace("\\\n", " ")
    (line,) = [ln for ln in text.splitlines() if marker in ln and "python -m" in ln]
    argv = shlex.split(line.split("&&")[-1].split("  #")[0])
    assert argv[:2] == ["python", "-m"], line
    return [sys.executable, *argv[1:]]


def run(argv: list[str], tmp_path: Path, *extra: str, timeout: float = 300):
    # The paths the page names, not the interpreter's (which may lie under /tmp/areal-...).
    argv = argv[:1] + [
        a.replace("/tmp/areal", str(tmp_path)).replace("/tmp/merged", str(tmp_path / "m"))
        for a in argv[1:]
    ]
    start = time.monotonic()
    proc = subprocess.run(
        [*argv, *extra], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    print(f"{time.monotonic() - start:6.1f}s  {shlex.join(argv[1:])}")
    return proc


def train(page: str, marker: str, tmp_path: Path) -> subprocess.CompletedProcess:
    proc = run(doc_command(page, marker), tmp_path, f"fileroot={tmp_path}", *SHORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_readmes_quick_start_is_the_cpu_page_s_run():
    """README's first line trains as docs/get-started/cpu.md's first run, which
    tests/docs/test_get_started.py runs as written."""
    quick = shlex.join(["python", *doc_command("README.md", "pip install torch")[1:]])
    assert quick == "python -m areal.train --config configs/tiny.yaml"
    assert quick in (ROOT / "docs/get-started/cpu.md").read_text().splitlines()


@pytest.mark.timeout(900)
def test_the_docs_commands_run_as_written(tmp_path):
    objectives = "docs/guides/objectives.md"
    recipe = train(objectives, "ppo.recipe=gspo", tmp_path).stdout
    gspo = tmp_path / "tiny/gspo"
    assert f"experiment directory {gspo}" in recipe and "run finished" in recipe
    # Starting roles take seconds (imports, the model): the console names what it waits for.
    assert "areal: waiting for " in recipe and "server0 to load the model" in recipe
    assert "objective recipe=gspo" in recipe and "(not the paper's default" in recipe
    assert (gspo / "metrics.jsonl").read_text().count("\n") == 2
    again = train(objectives, "ppo.recipe=gspo", tmp_path).stdout  # again: nothing is lost
    assert "is finished (its checkpoint has 2 of 2 steps); nothing was changed" in again

    lora = train("docs/guides/lora.md", "trainer.lr=2e-3 trial_name=lora", tmp_path).stdout
    assert "LoRA on: rank 16" in lora
    export = run(doc_command("docs/guides/lora.md", "areal.export /tmp/areal/tiny/lora"), tmp_path)
    assert export.returncode == 0, export.stderr[-3000:]
    assert (tmp_path / "m/config.json").is_file()

    out = tmp_path / "eval.json"
    line = doc_command("docs/guides/evaluation.md", "areal.eval --model /tmp/areal/tiny/run0 ")
    line = [a.replace("/tmp/areal/tiny/run0", "/tmp/areal/tiny/gspo") for a in line]
    ev = run(line, tmp_path, "--max-problems", "4", "--output", str(out))
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert f"evaluating {gspo}/checkpoints/v000002/model" in ev.stdout
    result = json.loads(out.read_text())
    assert result["task"] == "arith" and result["n_problems"] == 4 and result["n_samples"] == 8
    assert "code sandbox" not in ev.stdout + ev.stderr  # arith runs no code
