"""The rollout workers as one pool: where a group generates, failover, and weight fan-out.

    Controller --generate(group_id, prompt_ids, n)--> WorkerPool --pick (router.py)--> worker k
               <-- n finished trajectories -------        <-- finished | unfinished (k died)
                                                      unfinished: resumed, partial output
                                                      and all, on another alive worker
    Controller --update_weights(v, dir | broadcast)-> every worker --> acknowledged versions
                                                      --> retire weights/ older than v
    a dead worker k --wait_ready--> back (it loads the newest version first) --> alive again
    a generate cancelled (its episode rejected, timed out) --abandon(call_id)--> its worker
                                                      aborts the call's requests on the server

| call / task     | waits for                                  | unblocked by                 |
|-----------------|--------------------------------------------|------------------------------|
| generate        | an alive worker; then its reply            | a worker back; its samples   |
| update_weights  | every worker to load version v             | their replies                |
| back-watch of k | worker k's wait_ready (restart + reload)   | the launcher restarting it   |

A group's samples stay on one worker (its server's prefix cache); a group that a dead
server left unfinished moves to the least loaded alive one. Everything runs on the
controller's event loop: `alive` (a Condition) wakes generations waiting for a worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path

from areal import events, rolelog
from areal.comm.rpc import RpcClient
from areal.controller.router import Router
from areal.trajectory import Trajectory, TrajectoryRef, is_ref
from areal.weights import retire_older_than

log = logging.getLogger("areal.controller")

_ABANDON_TIMEOUT_S = 30.0


class WorkerPool:
    def __init__(self, workers: list[RpcClient], exp_dir: Path, ranks_per_server: int = 1):
        self.workers = workers
        self.ranks_per_server = ranks_per_server
        """Ranks a server takes in a weight-update group (its tensor-parallel size)."""
        self.exp_dir = exp_dir
        self.router = Router(len(workers))
        self.alive = asyncio.Condition()
        """Notified when a worker comes back."""
        self._watchers: dict[int, asyncio.Task] = {}  # dead worker -> waiting for it to be back
        self._resubmitted = 0  # samples resumed on another worker, since the last stats()
        self._by_address = {getattr(w, "address", None): w for w in workers}
        self._group: tuple[str, list[int]] | None = None  # weight-update group: name, members
        self._generation = 0

    async def generate(
        self,
        group_id: int,
        start_version: int,
        prompt_ids: list[int],
        n: int,
        sampling: dict,
        grade: dict | None = None,
    ) -> list[Trajectory | TrajectoryRef]:
        """n finished trajectories continuing prompt_ids, on one worker; samples a dead
        server left unfinished are resumed, with their partial output, on another.

        grade {"task", "answer"} (the pull data plane): each worker grades and keeps the
        samples it finished; they come back as references to it."""
        done: list[Trajectory | TrajectoryRef] = []
        partial: list[dict] | None = None  # None: nothing generated yet
        k = None
        while True:
            async with self.alive:
                await self.alive.wait_for(self.router.any_alive)
                k = self.router.pick(preferred=k)
                self.router.load[k] += 1
            call_id = uuid.uuid4().hex
            try:
                wire = await self.workers[k].call(
                    "generate",
                    group_id=group_id,
                    prompt_ids=prompt_ids,
                    n=n,
                    sampling_params=sampling,
                    start_version=start_version,
                    partial=partial,
                    call_id=call_id,
                    **({} if grade is None else {"grade": grade}),
                )
            except asyncio.CancelledError:
                # Nobody will read these samples: free the server's slots for work that counts.
                # Not waited for: if it fails they finish on their own; only server time is lost.
                self.workers[k].call_soon("abandon", _ABANDON_TIMEOUT_S, call_id=call_id)
                raise
            finally:
                self.router.load[k] -= 1
            done += [TrajectoryRef.from_wire(w) for w in wire if is_ref(w)]
            trajs = [Trajectory.from_wire(w) for w in wire if not is_ref(w)]
            done += [t for t in trajs if t.finish_reason]
            partial = [t.to_wire() for t in trajs if not t.finish_reason]
            if not partial:
                return done
            self._server_down(k)
            self._resubmitted += len(partial)

    def plan_broadcast(self, trainer: dict) -> dict:
        """The weight-update group of the next broadcast (weights.transport=distributed):
        the trainer (rank 0) and every serving worker's server. The same group while its
        members stay; a new one when a server went down or came back, a broadcast failed,
        or the trainer asks (trainer["new_group"]). world_size 1: nobody to send to.
        "delta": whether to send the trainer's deltas (weights.delta): only to the same
        group, every member of which holds the version before (the last update's)."""
        members = [k for k, ok in enumerate(self.router.alive) if ok]
        new = trainer["new_group"] or self._group is None or self._group[1] != members
        if new:
            self._generation += 1
            self._group = (f"areal-weights-{self._generation}", members)
        return {
            "group_name": self._group[0],
            "world_size": len(members) * self.ranks_per_server + 1,
            "new": new,
            "master_address": trainer["master_address"],
            "master_port": trainer["master_port"],
            "backend": trainer["backend"],
            "timeout_s": trainer["timeout_s"],
            "delta": not new and trainer["delta"] is not None,
        }

    async def update_weights(
        self,
        version: int,
        path: str | None,
        disk_version: int | None = None,
        broadcast: dict | None = None,
    ) -> None:
        """Make every worker's server hold `version`: from disk (path), or by broadcast
        (broadcast: plan_broadcast's group and the buckets' specs; path the newest version on
        disk, disk_version). A dead worker loads the newest on disk before it serves again.
        Then retire older weight directories. The caller awaits one at a time."""
        t0 = time.time()

        def args(k: int) -> dict:
            if broadcast is None or k not in self._group[1]:
                return {}
            rank = 1 + self._group[1].index(k) * self.ranks_per_server  # its first rank
            group = {**broadcast["group"], "rank": rank}
            return {"broadcast": {**broadcast, "group": group}}

        replies = await asyncio.gather(
            *(
                w.call(
                    "update_weights",
                    version=version,
                    path=path,
                    disk_version=disk_version,
                    **args(k),
                )  # fmt: skip
                for k, w in enumerate(self.workers)
            )
        )
        events.record("update_weights", t0, time.time(), version=version)
        rolelog.set_context(version=version)
        log.info("version %d loaded by the servers in %.2fs", version, time.time() - t0)
        for k, reply in enumerate(replies):
            if reply["alive"]:
                self.router.version[k] = reply["version"]
            else:  # down: it loads the newest version on disk before it serves again
                self._server_down(k)
            if not reply["loaded"]:
                self._group = None  # a broadcast failed: the next one forms a new group
        # Every server serving holds `version` or the newest on disk, and one that comes back
        # loads the newest on disk first: older directories are no longer needed.
        retire_older_than(self.exp_dir, version if disk_version is None else disk_version)

    async def stats(self) -> dict[str, float]:
        """The pool's counters since the previous call, and its servers' state now."""
        resubmitted, self._resubmitted = self._resubmitted, 0
        worker_stats = await asyncio.gather(*(w.call("stats") for w in self.workers))
        serving = [v for v, ok in zip(self.router.version, self.router.alive, strict=True) if ok]
        return {
            "rollout/interrupted": sum(s["n_interrupted"] for s in worker_stats),
            # Requests aborted on the servers because their episode had ended (abandon).
            "rollout/abandoned": sum(s["n_abandoned"] for s in worker_stats),
            "rollout/servers_alive": sum(self.router.alive),
            # The oldest weights a serving server holds (as it acknowledged them).
            "rollout/server_version_min": min(serving, default=-1),
            "rollout/resubmitted": resubmitted,
        }

    def release(self, refs: list[TrajectoryRef]) -> None:
        """Tell the workers holding refs to drop them (not waited for)."""
        ids: dict[str, list[str]] = {}
        for r in refs:
            ids.setdefault(r.holder, []).append(r.traj_id)
        for address, traj_ids in ids.items():
            worker = self._by_address.get(address)
            if worker is not None:  # else a holder of an earlier attempt: gone with it
                worker.call_soon("release", _ABANDON_TIMEOUT_S, ids=traj_ids)

    def close(self) -> None:
        """Stop waiting for dead workers (the run ends)."""
        for task in self._watchers.values():
            task.cancel()

    def _server_down(self, k: int) -> None:
        """Route around worker k until it says it serves again."""
        self.router.mark_dead(k)
        if k not in self._watchers:
            log.warning("inference server %d is down; routing around it until it is back", k)
            self._watchers[k] = asyncio.create_task(self._wait_back(k))

    async def _wait_back(self, k: int) -> None:
        try:
            reply = await self.workers[k].call("wait_ready")
        finally:
            del self._watchers[k]
        async with self.alive:
            self.router.mark_alive(k, reply["version"])
            self.alive.notify_all()
        log.info("inference server %d is back at version %d", k, reply["version"])
