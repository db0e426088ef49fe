"""The local launcher: every role as a subprocess of this one, on this machine.

    launcher --Popen--> server{k} (registers its URL, becomes the inference server)
             --Popen--> reward0, rollout{k}, controller0, trainer0   logs/{role}{k}.log

The plan is the single-node CPU placement (areal/launcher/plan.py); the poll/stop/report
loop is launcher/base.py's. Each child gets SIGKILL if the launcher itself dies
(PR_SET_PDEATHSIG), so a run never leaves orphans.
"""

from __future__ import annotations

import socket

from areal.comm.net import free_port
from areal.launcher.base import Launcher
from areal.launcher.plan import Step, make_plan


class LocalLauncher(Launcher):
    def __init__(self, cfg):
        plan = make_plan(
            cfg, [socket.gethostname()], 0, {socket.gethostname(): "127.0.0.1"}, free_port()
        )
        super().__init__(cfg, plan)

    def command(self, step: Step, cmd: list[str]) -> tuple[list[str], dict[str, str]]:
        return cmd, {}
