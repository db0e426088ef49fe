"""A run whose episodes only fail stops by itself, with the first error on the console."""

from __future__ import annotations

import os
import subprocess
import textwrap

from tests.system.test_run import ROOT, _wait_for, processes_mentioning, train_cmd

WORKFLOW = """
from areal.workflow import Workflow


class Refused(Workflow):
    async def arun_episode(self, engine, data):
        raise RuntimeError("400 tools are not supported: describe them in the prompt")
"""


def test_a_run_whose_episodes_all_fail_stops_with_the_error(tmp_path):
    (tmp_path / "refusing_workflow.py").write_text(textwrap.dedent(WORKFLOW))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        train_cmd(
            tmp_path, "trial_name=refused", "rollout.workflow=refusing_workflow:Refused",
            "rollout.max_consecutive_failures=8", "model.tiny_warmup_steps=0",
        ),
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr
    assert "areal: the run cannot make progress: the last 8 episodes were all rejected" in err
    assert "Traceback" in err and "RuntimeError: 400 tools are not supported" in err
    assert "refusing_workflow.py" in err  # the frame that raised
    assert "restarting the run" not in err  # no recovery: it would fail the same way
    _wait_for(lambda: processes_mentioning(str(tmp_path)) == [], 30, "no process left")
