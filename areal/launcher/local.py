"""The local launcher: every role as a subprocess of this one, on this machine.

    launcher --Popen--> server{k} (registers its URL, becomes the inference server)
             --Popen--> reward0, rollout{k}, controller0              logs/{role}{k}.log
             --Popen--> trainer{r}, r < trainer.parallel.dp          (RANK, WORLD_SIZE, ...)

The plan is the single-node CPU placement (areal/launcher/plan.py); the poll/stop/report
loop is launcher/base.py's. Each child gets SIGKILL if the launcher itself dies
(PR_SET_PDEATHSIG), so a run never leaves orphans.
"""

from __future__ import annotations

import os
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
        if step.role == "trainer" and self.plan.world_size > 1:
            # gloo picks the interface of the hostname, which need not reach 127.0.0.1.
            return cmd, {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        return cmd, {}
