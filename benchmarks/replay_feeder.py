"""A replay feeder for the data-plane harness: a rollout worker without a model, a decode or
a grader, to feed the real controller at its limit (benchmarks/data_plane.py --feed replay).

    python benchmarks/replay_feeder.py --exp-dir DIR --index K [--mean-tokens 8192]
        [--sigma 1.0] [--seed K]

It registers as rollout worker K and serves what the controller's WorkerPool and the
trainer ranks' Puller call on a rollout worker, under the same names, over the real RPC
layer (ZMQ, msgpack + HMAC):

    controller --generate(group, n, grade)--> n trajectories at once: lengths long-tailed
               <-- n TrajectoryRefs --------    (log-normal, mean --mean-tokens, cut at
                                                max_new_tokens), tokens and log-probs
                                                views of pre-built buffers, reward 0/1 at
                                                random; held in the real TrajectoryStore
    controller --update_weights / stats / wait_ready / abandon--> the real RolloutWorker's
                                                (its server a no-op client)
    trainer ranks --fetch(ids)--> the real TrajectoryStore: the bytes really travel
    controller --release(ids)---> the real TrajectoryStore
    the harness --served--> {fetch bytes sent, trajectories made, fetched, released, held}

A held trajectory's arrays are views of the buffers, so holding costs ~1 KiB whatever its
length; a fetch packs (copies) its tokens into the reply frame as a rollout worker's does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import math
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areal.comm.registry import Registry, load_key  # noqa: E402
from areal.comm.rpc import RpcServer  # noqa: E402
from areal.config import load_config  # noqa: E402
from areal.data_plane import TrajectoryStore  # noqa: E402
from areal.rollout.worker import RolloutWorker  # noqa: E402
from areal.trajectory import Trajectory  # noqa: E402

_BUFFER_TOKENS = 1 << 20  # tokens and log-probs to slice from (4 MiB each)
_METHOD: contextvars.ContextVar[str] = contextvars.ContextVar("method", default="")


class Replayed(Trajectory):
    """A Trajectory whose token arrays are numpy views (the held wire form as they are):
    its versions' min and max without a Python loop over every token."""

    @property
    def version_min(self) -> int:
        return int(self.versions.min()) if len(self.versions) else -1

    @property
    def version_max(self) -> int:
        return int(self.versions.max()) if len(self.versions) else -1


class NoModel:
    """The InferenceClient of a server that is not there: every call answers at once."""

    base_url = "replay://"

    async def update_weights_from_disk(self, *args: object, **kwargs: object) -> dict:
        return {"success": True}

    async def pause_generation(self, mode: str = "abort") -> dict:
        return {}

    async def continue_generation(self) -> dict:
        return {}

    async def abort_request(self, rid: str) -> None:
        return None

    async def health(self) -> bool:
        return True

    async def close(self) -> None:
        return None


class ReplayWorker(RolloutWorker):
    """The rollout worker with generate answered from buffers at once; the rest its own."""

    def __init__(self, store: TrajectoryStore, mean_tokens: float, sigma: float, seed: int):
        super().__init__("replay://", client_factory=lambda url, api_key=None: NoModel())
        self.store = store
        self.rng = random.Random(seed)
        gen = np.random.default_rng(seed)
        self.ids = gen.integers(3, 32000, _BUFFER_TOKENS, dtype=np.int32)
        self.lps = (-3 * gen.random(_BUFFER_TOKENS)).astype(np.float32)
        self.mu = math.log(mean_tokens) - sigma**2 / 2
        self.sigma = sigma
        self._versions = (-1, np.zeros(0, np.int32))  # (version, np.full(cap, version))
        self.n_made = self.n_fetched = self.fetch_bytes = 0

    def _versions_of(self, n: int) -> np.ndarray:
        if self._versions[0] != self.version or len(self._versions[1]) < n:
            cap = max(n, len(self._versions[1]), 1 << 15)
            self._versions = (self.version, np.full(cap, self.version, np.int32))
        return self._versions[1][:n]

    async def generate(
        self,
        group_id: int,
        prompt_ids: list[int],
        n: int,
        sampling_params: dict,
        start_version: int,
        partial: list[dict] | None = None,
        call_id: str = "",
        grade: dict | None = None,
    ) -> list[dict]:
        if partial is not None or grade is None:
            raise RuntimeError("the replay feeder serves the pull data plane's first calls only")
        cap = int(sampling_params["max_new_tokens"])
        trajs = []
        t0 = time.time()
        for _ in range(n):
            length = max(1, min(cap, int(self.rng.lognormvariate(self.mu, self.sigma))))
            at = self.rng.randrange(0, _BUFFER_TOKENS - length)
            trajs.append(
                Replayed(
                    group_id=group_id,
                    prompt_ids=prompt_ids,
                    output_ids=self.ids[at : at + length],
                    logprobs=self.lps[at : at + length],
                    versions=self._versions_of(length),
                    finish_reason="length" if length == cap else "stop",
                    reward=float(self.rng.random() < 0.5),
                    start_version=start_version,
                    t_start=t0,
                    t_end=t0,
                )  # fmt: skip
            )
        self.n_made += n
        return [r.to_wire() for r in self.store.hold(trajs, call_id)]

    async def fetch(self, ids: list[str]) -> list[dict]:
        _METHOD.set("fetch")  # the reply's frames count as served (CountingServer)
        wires = await self.store.fetch(ids)
        self.n_fetched += len(wires)
        return wires

    async def served(self) -> dict:
        return {
            "made": self.n_made,
            "fetched": self.n_fetched,
            "fetch_bytes": self.fetch_bytes,
            "held": len(self.store),
        }


class CountingServer(RpcServer):
    """The RPC server, counting the bytes of the fetch replies it sends (HMAC included, as
    the Puller counts what it receives)."""

    worker: ReplayWorker | None = None

    def _seal(self, obj: object) -> list[bytes]:
        frames = super()._seal(obj)
        if _METHOD.get() == "fetch" and self.worker is not None:
            self.worker.fetch_bytes += sum(len(f) for f in frames)
        return frames


async def main(args: argparse.Namespace) -> None:
    exp = Path(args.exp_dir)
    cfg = load_config(str(exp / "config.yaml"))
    key = load_key(exp)
    store = TrajectoryStore(f"rollout{args.index}")
    worker = ReplayWorker(store, args.mean_tokens, args.sigma, args.seed)
    server = CountingServer(key)
    server.worker = worker
    store.address = server.address
    for name in RolloutWorker.RPC_METHODS:
        server.register(name, getattr(worker, name))
    server.register("fetch", worker.fetch)
    server.register("release", store.release)
    server.register("served", worker.served)
    Registry(cfg.exp_dir).register("rollout", args.index, server.address)
    loop = asyncio.get_running_loop()
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.close)
    await server.serve()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--exp-dir", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--mean-tokens", type=float, default=8192)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    asyncio.run(main(p.parse_args()))
