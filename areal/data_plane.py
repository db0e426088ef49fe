"""The data plane (AReaL v0.5, DESIGN.md): tokens stay where they are made, metadata travels.

    rollout worker k: decodes, grades, TrajectoryStore.hold --> TrajectoryRefs (~150 B each)
    controller: staleness gate, buffer, dynamic sampling, stats on the refs
    controller --get_batch(i): refs--> trainer rank 0 --broadcast(refs)--> every rank
    each replica's head: its share of the batch (step.batch_split, from the lengths alone)
        --fetch(ids), one thread per holder, in parallel--> rollout worker k' --> tokens
        --within the replica (its tp x pp ranks, Megatron)--> the replica's other ranks
    controller --release(ids)--> holders, at get_batch(i+1) (batch i is trained by then)

No process relays tokens it does not train on: the controller never sees a trajectory's
tokens (the single-turn episode's decode and grading run on the worker that generated it),
rank 0 passes on metadata only, and each replica receives only its own share, once. A workflow that
builds trajectories on the controller (agents) makes the controller their holder.

| waits for                     | unblocked by                                            |
|-------------------------------|---------------------------------------------------------|
| a rank's fetch from a holder  | the holder's reply; else one retry, then PullError      |

Faults: a holder is a rollout worker (or the controller); its death stops the run, which
the launcher restarts from its latest checkpoint. Trajectories held by the dead process are
lost with it, so the controller's checkpoint keeps no held group: their draws are drawn
again (with the gate's count rebuilt without them), as the groups in flight are. A pull
from a dead or stuck holder fails the trainer rank with the holder and its log named.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from areal.comm.rpc import RpcError, RpcTimeout, SyncRpcClient
from areal.trajectory import Trajectory, TrajectoryRef

log = logging.getLogger("areal.data_plane")

PULL_TIMEOUT_S = 120.0
"""Seconds one fetch from one holder may take before it is tried again (then fails)."""


class PullError(RuntimeError):
    """A trainer rank could not fetch its trajectories from a holder, twice."""


class TrajectoryStore:
    """The trajectories a process made and holds for the trainer ranks, by id, until the
    controller releases them. Ids are "call.n": a generate call abandoned after it finished
    drops what it held (drop_call)."""

    RPC_METHODS: tuple[str, ...] = ("fetch", "release")

    def __init__(self, name: str, address: str = ""):
        self.name = name
        """The holder's role and index, as its log is named (rollout3)."""
        self.address = address
        """Its RPC server's address (set once the server is bound)."""
        # call -> id -> the trajectory's wire form: numpy arrays, 13 bytes a token, where
        # Python lists of ints and floats take ~100 (and are what the GC would walk).
        self._held: dict[str, dict[str, dict]] = {}
        self._calls = itertools.count()

    def hold(self, trajs: Sequence[Trajectory], call_id: str = "") -> list[TrajectoryRef]:
        """Keep trajs; their references, for the controller."""
        call_id = call_id or f"h{next(self._calls)}"
        held = self._held.setdefault(call_id, {})
        refs = []
        for t in trajs:
            traj_id = f"{call_id}.{len(held)}"
            held[traj_id] = t.to_wire()
            refs.append(TrajectoryRef.of(t, traj_id, self.address, self.name))
        return refs

    def __len__(self) -> int:
        return sum(len(h) for h in self._held.values())

    def _find(self, traj_id: str) -> dict | None:
        return self._held.get(traj_id.rsplit(".", 1)[0], {}).get(traj_id)

    async def fetch(self, ids: list[str]) -> list[dict]:
        """The trajectories `ids`, in wire form, in that order; they stay held."""
        missing = [i for i in ids if self._find(i) is None]
        if missing:
            raise KeyError(
                f"{self.name} holds no trajectory {missing[:3]} ({len(missing)} missing): "
                "released already, or made by an earlier attempt of the run"
            )
        return [self._find(i) for i in ids]

    async def release(self, ids: list[str]) -> dict:
        """Drop `ids` (trained on, or dropped by the controller)."""
        return {"released": self.release_now(ids)}

    def release_now(self, ids: Sequence[str]) -> int:
        n = 0
        for traj_id in ids:
            call_id = traj_id.rsplit(".", 1)[0]
            held = self._held.get(call_id)
            if held is not None and held.pop(traj_id, None) is not None:
                n += 1
                if not held:
                    del self._held[call_id]
        return n

    def drop_call(self, call_id: str) -> int:
        """Drop what generate(call_id) held: its episode ended without it (abandoned)."""
        return len(self._held.pop(call_id, {}))


class Puller:
    """A trainer rank's fetches from the holders: one thread and one connection per holder,
    kept from step to step."""

    def __init__(self, key: bytes, log_dir: Path, timeout_s: float = PULL_TIMEOUT_S):
        self.key = key
        self.log_dir = log_dir
        self.timeout_s = timeout_s
        self._clients: dict[str, SyncRpcClient] = {}
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="pull")
        self.bytes_in = 0
        """Bytes received from holders so far (the frames, HMAC included)."""

    def pull(self, refs: Sequence[TrajectoryRef]) -> list[Trajectory]:
        """The whole trajectories of refs, in order, fetched from their holders in parallel."""
        by_holder: dict[str, list[int]] = defaultdict(list)
        for k, ref in enumerate(refs):
            by_holder[ref.holder].append(k)
        jobs = {h: self._pool.submit(self._fetch, refs, ks) for h, ks in by_holder.items()}
        out: list[Trajectory | None] = [None] * len(refs)
        for h, job in jobs.items():
            wires, n_bytes = job.result()
            self.bytes_in += n_bytes
            for k, wire in zip(by_holder[h], wires, strict=True):
                out[k] = refs[k].resolve(Trajectory.from_wire(wire))
        return out

    def _fetch(self, refs: Sequence[TrajectoryRef], ks: list[int]) -> tuple[list[dict], int]:
        """On a pool thread: the wire forms of refs[ks] (one holder's) and their bytes."""
        holder, name = refs[ks[0]].holder, refs[ks[0]].holder_name
        ids = [refs[k].traj_id for k in ks]
        for attempt in (1, 2):
            client = self._clients.get(holder)
            if client is None:
                client = self._clients[holder] = SyncRpcClient(holder, self.key)
            try:
                before = client.bytes_in
                t0 = time.monotonic()
                wires = client.call("fetch", timeout=self.timeout_s, ids=ids)
                log.debug("fetched %d from %s in %.3fs", len(ids), name, time.monotonic() - t0)
                return wires, client.bytes_in - before
            except (RpcTimeout, RpcError) as e:
                # A fresh connection for the retry: the old one may hold a late reply.
                self._clients.pop(holder).close()
                if attempt == 2:
                    raise PullError(
                        f"could not fetch {len(ids)} trajectories from {name} at {holder}, "
                        f"tried twice ({type(e).__name__}: {e}); the holder died or is stuck: "
                        f"see {self.log_dir / (name + '.log')}"
                    ) from e
                log.warning("fetch from %s at %s failed (%s); trying again", name, holder, e)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in self._clients.values():
            c.close()
        self._clients.clear()
