"""README's commands as written, on the tiny default, shortened only by overrides appended
(a fileroot of the test's, 2 steps, no warm-up): the quick start (and the same command
again, which leaves the finished run as it is), a recipe, LoRA and its export, and eval of
the quick start's run directory."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SHORT = ("total_train_steps=2", "model.tiny_warmup_steps=0")


def readme_command(marker: str) -> list[str]:
    """The one README line holding `marker`, as argv (its comment and any `... &&` before
    the command dropped)."""
    (line,) = [ln for ln in README.splitlines() if marker in ln and "python -m" in ln]
    argv = shlex.split(line.split("&&")[-1].split("  #")[0])
    assert argv[:2] == ["python", "-m"], line
    return [sys.executable, *argv[1:]]


def run(argv: list[str], tmp_path: Path, *extra: str, timeout: float = 300):
    argv = [a.replace("/tmp/areal", str(tmp_path)).replace("/tmp/merged", str(tmp_path / "m"))
            for a in argv]  # fmt: skip
    return subprocess.run(
        [*argv, *extra], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def train(marker: str, tmp_path: Path) -> subprocess.CompletedProcess:
    proc = run(readme_command(marker), tmp_path, f"fileroot={tmp_path}", *SHORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.timeout(900)
def test_readmes_commands_run_as_written(tmp_path):
    quick = "pip install torch"
    out = train(quick, tmp_path).stdout
    run0 = tmp_path / "tiny/run0"
    assert f"experiment directory {run0}" in out and "run finished" in out
    # Starting roles take seconds (imports, the model): the console names what it waits for.
    assert "areal: waiting for " in out and "server0 to load the model" in out
    again = train(quick, tmp_path).stdout  # the same command again: nothing is lost
    assert "is finished (its checkpoint has 2 of 2 steps); nothing was changed" in again

    recipe = train("ppo.recipe=gspo", tmp_path).stdout
    assert "objective recipe=gspo" in recipe and "(not the paper's default" in recipe
    assert (tmp_path / "tiny/gspo/metrics.jsonl").read_text().count("\n") == 2

    lora = train("model.lora.rank=16", tmp_path).stdout
    assert "LoRA on: rank 16" in lora
    export = run(readme_command("areal.export /tmp/areal/tiny/lora"), tmp_path)
    assert export.returncode == 0, export.stderr[-3000:]
    assert (tmp_path / "m/config.json").is_file()

    out = tmp_path / "eval.json"
    ev = run(readme_command("areal.eval --model /tmp/areal/tiny/run0"), tmp_path,
             "--max-problems", "4", "--output", str(out))  # fmt: skip
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert f"evaluating {run0}/checkpoints/v000002/model" in ev.stdout
    result = json.loads(out.read_text())
    assert result["task"] == "arith" and result["n_problems"] == 4 and result["n_samples"] == 8
    assert "code sandbox" not in ev.stdout + ev.stderr  # arith runs no code
