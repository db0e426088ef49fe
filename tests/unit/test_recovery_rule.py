"""Recovery tells a fault from a bug (areal/launcher/base.py): real role processes that
raise. One that raises before the run's first step, or raises the same error at the same
step after a restart, stops the run at once with its error; different errors are faults,
restarted up to recover.max_restarts."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from areal.config import load_config
from areal.launcher.base import Launcher, error_line
from areal.launcher.plan import Plan, Step

STEP_LINE = {"version": 1, "reward/mean": 0.0, "staleness/max": 0,
             "throughput/train_tokens_per_s": 1.0, "time": 0.1}  # fmt: skip


class ScriptLauncher(Launcher):
    """The launcher's loop over one 'trainer' step that runs `script` instead of a role."""

    def __init__(self, tmp_path: Path, script: str):
        cfg = load_config(
            None,
            [f"fileroot={tmp_path}", "recover.max_restarts=2", "launcher.dead_role_poll_s=0.05"],
        )
        plan = Plan(["here"], 0, 0, 0, [Step("trainer", 0, "here")])
        super().__init__(cfg, plan)
        self.log_dir.mkdir(parents=True)
        self.script = textwrap.dedent(script)

    def command(self, step: Step, cmd: list[str]) -> tuple[list[str], dict[str, str]]:
        return [sys.executable, "-c", self.script, str(self.exp_dir)], {}


def run(launcher: ScriptLauncher) -> tuple[int, list[int]]:
    resumed: list[int] = []

    def resume(n: int) -> None:  # as resume=true does: metrics back to the checkpoint (none)
        resumed.append(n)
        (launcher.exp_dir / "metrics.jsonl").unlink(missing_ok=True)

    return launcher.run(resume=resume), resumed


def test_an_error_before_the_first_step_is_not_restarted(tmp_path, capsys):
    launcher = ScriptLauncher(tmp_path, "raise RuntimeError('tokenizer.chat_template is not set')")
    rc, resumed = run(launcher)
    err = capsys.readouterr().err
    assert rc == 1 and resumed == []
    assert "it failed before the run's first step completed" in err
    assert "RuntimeError: tokenizer.chat_template is not set" in err  # the role's log tail


STEP_THEN_RAISE = """
    import json, os, sys
    exp = sys.argv[1]
    with open(exp + "/metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 1, **%s}) + "\\n")
    raise ValueError(%s)
"""


def test_the_same_error_at_the_same_step_stops_after_one_restart(tmp_path, capsys):
    message = "'shape mismatch at 0x7f3a2c tcp://127.0.0.1:' + str(40000 + os.getpid() % 999)"
    launcher = ScriptLauncher(tmp_path, STEP_THEN_RAISE % (json.dumps(STEP_LINE), message))
    rc, resumed = run(launcher)
    err = capsys.readouterr().err
    assert rc == 1 and resumed == [1], err  # one restart, not recover.max_restarts of them
    assert "the same error at step 1 as before the last restart" in err
    assert "ValueError: shape mismatch" in err


def test_different_errors_are_faults_and_are_restarted(tmp_path, capsys):
    message = "'attempt ' + os.environ['AREAL_RECOVER_RESTARTS']"
    launcher = ScriptLauncher(tmp_path, STEP_THEN_RAISE % (json.dumps(STEP_LINE), message))
    rc, resumed = run(launcher)
    assert rc == 1 and resumed == [1, 2]  # every restart spent
    assert "restarting the run from its latest checkpoint (2/2)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("log", "line"),
    [
        ("Traceback\n  File x\nValueError: at 0x7fff12 port 43211\n", "ValueError: at # port #"),
        ("torch.DistStoreError: timed out\nexiting\n", "torch.DistStoreError: timed out"),
        ("all good\n", None),
    ],
)  # fmt: skip
def test_the_error_line_of_a_log(tmp_path, log, line):
    (tmp_path / "r.log").write_text(log)
    assert error_line(tmp_path / "r.log") == line
