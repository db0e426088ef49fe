"""The program in the sandbox sees a minimal fixed environment, never the grader's: a secret
in the reward service's environment (a W&B or cloud token on a cluster) stays there, in
every sandbox mode this machine can run (bwrap, unshare, plain)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECRET = "areal-test-secret-4711"

# The grader: a real RewardService (its pool processes inherit this process's environment)
# grading a program that passes only if it can print the secret, and the raw environment
# the program sees, with its attempts to read its ancestors' environments.
GRADER = r"""
import asyncio, json, sys
from areal.config import RewardConfig
from areal.tasks.graders import sandbox
from areal.reward.service import RewardService

PROBE = '''
import json, os
ancestors, pid = [], os.getppid()
while pid > 1:
    try:
        ancestors.append(open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace"))
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        break
home_ok = os.path.isdir(os.environ.get("HOME", "/nonexistent"))
print(json.dumps({"env": dict(os.environ), "ancestors": ancestors, "cwd": os.getcwd(),
                  "home_ok": home_ok}))
'''
LEAK = "```python\nimport os\nprint(os.environ.get('AREAL_TEST_SECRET', 'none'))\n```"

async def grade():
    s = RewardService(RewardConfig(n_workers=1, timeout_s=30, correct=1.0, wrong=0.0,
                                   code_time_limit_s=5))
    try:
        return await s.grade("code", [LEAK], [{"input": "", "output": sys.argv[1] + "\n"}])
    finally:
        s.close()

run = sandbox.run_python(PROBE, "", sandbox.Limits(time_s=10))
rewards = asyncio.run(grade())
print(json.dumps({"mode": sandbox.mode(), "stdout": run.stdout.decode(), "rewards": rewards}))
"""


def _modes() -> list:
    modes = ["plain"]
    if shutil.which("unshare"):
        modes.append("unshare")
    if shutil.which("bwrap"):
        modes.append("bwrap")
    return modes


@pytest.mark.parametrize("mode", _modes())
def test_the_program_never_sees_the_graders_environment(mode):
    env = {**os.environ, "AREAL_SANDBOX": mode, "AREAL_TEST_SECRET": SECRET,
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", GRADER, SECRET], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["mode"] == mode
    assert out["rewards"] == [0.0]  # printing the secret would have passed the test
    seen = json.loads(out["stdout"])
    assert SECRET not in out["stdout"]  # not in its environment nor in any ancestor's
    env = seen["env"]
    env.pop("PWD", None)  # bwrap sets it to the working directory
    assert env == {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
                   "HOME": seen["cwd"]}  # fmt: skip
    assert seen["home_ok"]
