"""Which address a role's servers bind and which one it tells its peers (via the registry).

On one machine (the local launcher) everything is loopback. On a cluster the launcher
sets AREAL_HOST in each role's environment to the address other nodes reach that node at
(SLURM's NodeAddr); the role then binds all interfaces and registers AREAL_HOST, because
the launcher, not the role, knows which of a node's names the other nodes can resolve.
"""

from __future__ import annotations

import os
import socket

HOST_ENV = "AREAL_HOST"
_LOOPBACK = "127.0.0.1"


def advertised_host() -> str:
    """The host part of the addresses this process registers."""
    return os.environ.get(HOST_ENV) or _LOOPBACK


def bind_host() -> str:
    """The interface this process's servers listen on."""
    return "0.0.0.0" if os.environ.get(HOST_ENV) else _LOOPBACK


def free_port(host: str | None = None) -> int:
    """A port that is free on this node now (another process may take it before we bind)."""
    with socket.socket() as s:
        s.bind((host or bind_host(), 0))
        return s.getsockname()[1]
