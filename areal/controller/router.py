"""Which rollout worker (and so which inference server) generates a group.

The samples of one prompt go to one server, and a group that a dead server left
unfinished goes back to the server it was on when that one is alive again; otherwise
the alive server with the fewest groups in flight takes it. Pure bookkeeping on the
controller's event loop; the worker pool (pool.py) counts the load and marks servers dead
and alive.
"""

from __future__ import annotations


class Router:
    def __init__(self, n_servers: int):
        self.load = [0] * n_servers
        """Groups in flight on each server."""
        self.alive = [True] * n_servers
        self.version = [0] * n_servers
        """The weight version each server holds, as last acknowledged."""

    def any_alive(self) -> bool:
        return any(self.alive)

    def pick(self, preferred: int | None = None) -> int:
        """The server for the next call: `preferred` if alive, else the least loaded."""
        if preferred is not None and self.alive[preferred]:
            return preferred
        alive = [k for k, ok in enumerate(self.alive) if ok]
        assert alive, "pick() needs an alive server: wait for any_alive() first"
        return min(alive, key=lambda k: self.load[k])

    def mark_dead(self, k: int) -> None:
        self.alive[k] = False

    def mark_alive(self, k: int, version: int) -> None:
        self.alive[k] = True
        self.version[k] = version
