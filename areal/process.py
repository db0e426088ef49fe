"""Process hygiene shared by every role: no process of a run may outlive its parent."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1
RESTARTS_ENV = "AREAL_RECOVER_RESTARTS"
"""Set by the launcher for every role: how many recoveries of the run came before."""


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, however the parent dies.

    Used between fork and exec for the launcher's children, and as the initializer of
    process pools, so that even a SIGKILLed launcher leaves no orphan behind.
    """
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
