"""Where a group generates: the router's choice, and the worker pool's failover and weight
fan-out against fake workers (the pool's only I/O is their `call`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from areal.controller.pool import WorkerPool
from areal.controller.router import Router
from areal.trajectory import Trajectory
from areal.weights import publish, published_versions


def test_least_loaded_alive_server_unless_the_preferred_one_is_alive():
    router = Router(3)
    router.load[:] = [2, 0, 1]
    assert router.pick() == 1
    assert router.pick(preferred=0) == 0  # a group stays where it started
    router.mark_dead(1)
    assert router.pick() == 2
    router.mark_dead(0)
    assert router.pick(preferred=0) == 2  # its server is dead: the least loaded alive one
    router.mark_dead(2)
    assert not router.any_alive()
    router.mark_alive(0, version=7)
    assert router.pick(preferred=2) == 0 and router.version[0] == 7


class FakeWorker:
    """A rollout worker as the pool reaches it. A dying one hands its samples back
    unfinished with one token generated, refuses weights, and is back when told."""

    def __init__(self, dying: bool = False):
        self.dying = dying
        self.back = asyncio.Event()
        self.generates: list[dict] = []
        self.version = 0

    async def call(self, method: str, **kw):
        if method == "generate":
            self.generates.append(kw)
            trajs = [Trajectory.from_wire(w) for w in kw["partial"]] if kw["partial"] else [
                Trajectory(group_id=kw["group_id"], prompt_ids=kw["prompt_ids"])
                for _ in range(kw["n"])
            ]  # fmt: skip
            for t in trajs:
                t.extend([len(t.output_ids) + 1], [-0.5], self.version)
                t.finish_reason = "" if self.dying else "length"
            return [t.to_wire() for t in trajs]
        if method == "update_weights":
            if not self.dying:
                self.version = kw["version"]
            return {"version": self.version, "loaded": not self.dying, "alive": not self.dying}
        if method == "wait_ready":
            await self.back.wait()
            self.dying = False
            return {"version": self.version}
        assert method == "stats"
        return {"n_interrupted": 0, "n_abandoned": 0}


def test_a_dead_servers_samples_resume_elsewhere_and_it_is_used_again_once_back(tmp_path):
    async def body():
        dying, healthy = FakeWorker(dying=True), FakeWorker()
        pool = WorkerPool([dying, healthy], tmp_path)
        trajs = await pool.generate(4, 0, [1, 2], 2, {"max_new_tokens": 2})
        # Both samples began on server 0 (least loaded, first) and finished on server 1,
        # with the token server 0 had generated.
        assert [t.output_ids for t in trajs] == [[1, 2], [1, 2]]
        assert all(t.finish_reason == "length" and t.group_id == 4 for t in trajs)
        assert healthy.generates[0]["partial"] is not None
        stats = await pool.stats()
        assert stats["rollout/servers_alive"] == 1 and stats["rollout/resubmitted"] == 2
        assert (await pool.stats())["rollout/resubmitted"] == 0  # since the previous call
        # Back: the router takes it again (the least loaded: both idle, it comes first).
        async with pool.alive:
            dying.back.set()
            await pool.alive.wait_for(lambda: all(pool.router.alive))
        await pool.generate(5, 0, [1], 1, {})
        assert dying.generates[-1]["group_id"] == 5
        pool.close()

    asyncio.run(body())


def test_weights_load_everywhere_and_older_versions_are_retired(tmp_path):
    for v in (0, 1, 2):
        publish(tmp_path, v, lambda d: (Path(d) / "config.json").write_text("{}"))

    async def body():
        workers = [FakeWorker(), FakeWorker(dying=True)]
        pool = WorkerPool(workers, tmp_path)
        await pool.update_weights(2, "unused")
        # The live server acknowledged 2; the one that refused is routed around until back.
        assert pool.router.version == [2, 0] and pool.router.alive == [True, False]
        stats = await pool.stats()
        assert stats["rollout/server_version_min"] == 2 and stats["rollout/servers_alive"] == 1
        pool.close()

    asyncio.run(body())
    assert published_versions(tmp_path) == [2]


def test_each_tensor_parallel_worker_of_a_server_takes_a_rank_of_the_weight_group(tmp_path):
    """A server of tp_size 2 joins as ranks rank_offset and rank_offset + 1 (SGLang's and the
    vLLM extension's rule), so the group has 1 + 2 ranks per server and no two servers share
    one; the same group serves the next update while its members stay."""
    trainer = dict(master_address="127.0.0.1", master_port=1, backend="gloo", timeout_s=5.0,
                   delta=None, new_group=False)  # fmt: skip

    async def body():
        workers = [FakeWorker(), FakeWorker(), FakeWorker()]
        sent: list[dict] = []
        for w in workers:
            call = w.call

            async def recording(method, _call=call, **kw):
                if method == "update_weights":
                    sent.append(kw["broadcast"]["group"])
                return await _call(method, **kw)

            w.call = recording
        pool = WorkerPool(workers, tmp_path, ranks_per_server=2)
        group = pool.plan_broadcast(trainer)
        assert group["world_size"] == 7 and group["new"]
        await pool.update_weights(1, None, 0, {"group": group, "buckets": []})
        assert sorted(g["rank"] for g in sent) == [1, 3, 5]
        assert not pool.plan_broadcast(trainer)["new"]
        pool.close()

    asyncio.run(body())
