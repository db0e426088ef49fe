"""Process hygiene shared by every role: no process of a run may outlive its parent."""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
from typing import NoReturn

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


def exit_now(code: int = 0) -> NoReturn:
    """End the process as a normal exit does, without Python's teardown of its modules.

    That teardown frees every module one by one: 0.75-1 s of CPU in a process that imported
    torch (a server, a trainer rank), spent after its work is done while the launcher waits
    for it, twice a run. What a normal exit does that matters is done first: the threads that
    are not daemons are joined, the atexit handlers run (event logs, logging), stdio flushed.
    """
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
