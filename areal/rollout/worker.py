"""The rollout worker: one per inference server, between the controller and that server.

    controller --generate(group)--------> worker --POST /generate x G--> inference server
               <--- G trajectories ------        <-- output | abort (weight update) --
    controller --update_weights(v, dir)-> worker --pause / update_weights_from_disk / continue

| loop              | waits for                      | unblocked by                          |
|-------------------|--------------------------------|---------------------------------------|
| one sample        | the server's /generate answer  | finish (stop/length) or an abort      |
| resumed sample    | the server to continue         | the weight update finishing           |
| weight update     | the server to pause and load   | /update_weights_from_disk answering   |

Interruptible (the paper): an update aborts in-flight generations; each comes back with its
partial output, and is resubmitted as prompt + partial output, which the paused server
holds until it has loaded the new weights. Its tokens keep the behaviour log-prob and the
version of the weights that produced them. Non-interruptible (the paper's ablation): the
update stops new submissions and waits for the in-flight ones to finish.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from areal.rollout.client import SGLangClient
from areal.trajectory import Trajectory

log = logging.getLogger("areal.rollout")

_MAX_RESUMES = 1000  # an abort loop this long means something other than updates aborts us


class RolloutWorker:
    def __init__(self, server_url: str, *, interruptible: bool = True):
        self.client = SGLangClient(server_url)
        self.interruptible = interruptible
        self.version = 0
        self.n_interrupted = 0
        """Requests interrupted by weight updates since the last stats() call."""
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = asyncio.Event()  # cleared while a non-interruptible update waits
        self._open.set()
        self._update_lock = asyncio.Lock()

    async def generate(
        self,
        group_id: int,
        prompt_ids: list[int],
        n: int,
        sampling_params: dict,
        start_version: int,
    ) -> list[dict]:
        """Sample n responses to one prompt; returns trajectories in wire form."""
        trajs = await asyncio.gather(
            *(
                self._sample(group_id, list(prompt_ids), sampling_params, start_version)
                for _ in range(n)
            )
        )
        return [t.to_wire() for t in trajs]

    async def _sample(
        self, group_id: int, prompt_ids: list[int], sampling_params: dict, start_version: int
    ) -> Trajectory:
        traj = Trajectory(
            group_id=group_id,
            prompt_ids=prompt_ids,
            start_version=start_version,
            t_start=time.time(),
        )
        max_new = int(sampling_params["max_new_tokens"])
        rid = uuid.uuid4().hex
        for _ in range(_MAX_RESUMES):
            await self._open.wait()
            self._in_flight += 1
            self._idle.clear()
            try:
                out = await self.client.generate(
                    prompt_ids + traj.output_ids,
                    {**sampling_params, "max_new_tokens": max_new - len(traj.output_ids)},
                    rid=rid,
                )
            finally:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._idle.set()
            traj.extend(out.output_ids, out.logprobs, out.weight_version)
            if out.finish_reason != "abort":
                traj.finish_reason = out.finish_reason
                break
            if len(traj.output_ids) >= max_new:
                traj.finish_reason = "length"
                break
            traj.n_interrupts += 1
            self.n_interrupted += 1
        else:
            raise RuntimeError(
                f"request {rid} was aborted {_MAX_RESUMES} times: something other than weight "
                "updates is aborting requests on the inference server"
            )
        traj.t_end = time.time()
        return traj

    async def update_weights(self, version: int, path: str) -> dict:
        """Make the server generate with `version` from now on."""
        async with self._update_lock:
            if version <= self.version:
                return {"version": self.version}
            t0 = time.time()
            if self.interruptible:
                # Abort in-flight requests (they come back partial and are resubmitted) and
                # hold new ones until the new weights are loaded.
                try:  # a pause cut short (cancelled, timed out) must not leave it paused
                    await self.client.pause_generation(mode="abort")
                    await self.client.update_weights_from_disk(path, version)
                finally:
                    await self.client.continue_generation()
            else:
                self._open.clear()
                try:
                    await self._idle.wait()
                    await self.client.update_weights_from_disk(path, version)
                finally:
                    self._open.set()
            self.version = version
            log.info("loaded version %d in %.2fs", version, time.time() - t0)
            return {"version": version, "seconds": time.time() - t0}

    async def stats(self) -> dict:
        n, self.n_interrupted = self.n_interrupted, 0
        return {"n_interrupted": n, "in_flight": self._in_flight}
