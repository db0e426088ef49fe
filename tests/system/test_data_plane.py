"""The pull data plane against the relay path, with real holder processes and two gloo ranks.

The same batch, held by two holder processes (real TrajectoryStores behind the real RPC
layer): each rank trains one step on the relayed whole batch, and one step on the batch
as references of which it fetches only its own share. The two give bit-identical
statistics and weights; each rank fetched exactly its share. A killed holder fails the
pull, after one retry, with the holder and its log named.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from areal.comm import wire
from areal.comm.net import free_port
from areal.config import load_config
from areal.data_plane import Puller, PullError
from areal.models.tiny import make_tiny_model
from areal.trainer.parallel import DataParallel, init_data_parallel
from areal.trainer.step import batch_split, train_step
from areal.trainer.worker import batch_trajectories
from areal.trajectory import Trajectory, TrajectoryRef
from areal.worker import step_plan
from tests.system.conftest import join_world
from tests.system.test_data_parallel import make_backend, make_trajectories

KEY = bytes(range(32))  # the same in the spawned ranks, which import this module anew
HOLDER = Path(__file__).with_name("holder_proc.py")
OVERRIDES = ["ppo.n_minibatches=2", "ppo.behav_imp_weight_cap=2.0", "seed=3"]
VERSION = 0


@contextmanager
def holders(batch_file: Path, bounds: list[tuple[int, int]], tmp: Path):
    """Holder processes, one per (lo, hi) slice of the batch; yields (procs, refs in order)."""
    procs, files = [], []
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    try:
        for k, (lo, hi) in enumerate(bounds):
            files.append(tmp / f"refs{k}.msgpack")
            cmd = [sys.executable, str(HOLDER), KEY.hex(), str(batch_file), str(lo), str(hi)]
            procs.append(subprocess.Popen([*cmd, f"holder{k}", str(files[-1])], env=env))
        deadline = time.monotonic() + 60
        while not all(f.exists() for f in files):
            assert time.monotonic() < deadline, "the holders did not start"
            assert all(p.poll() is None for p in procs), "a holder died at start"
            time.sleep(0.05)
        yield procs, [r for f in files for r in wire.unpack(f.read_bytes())]
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def _rank_main(rank: int, model_dir: str, tmp: str, port: int) -> None:
    join_world(rank, 2, port)
    dp = init_data_parallel(2, rank, timeout_s=60)
    cfg = load_config(None, OVERRIDES)
    args = {**step_plan(cfg).prepare_args(VERSION), "max_tokens_per_mb": 40, "max_new_tokens": None}
    out = Path(tmp)
    try:
        # relay: every rank has the whole batch (as rank 0's broadcast gives it)
        whole = [Trajectory.from_wire(d) for d in wire.unpack((out / "batch").read_bytes())]
        relay_backend = make_backend(model_dir)
        relay = train_step(relay_backend, whole, dp=dp, **args)
        # pull: references for all, tokens fetched for this rank's share only
        reply = {"trajectories": wire.unpack((out / "refs").read_bytes())}
        puller = Puller(KEY, out / "logs")
        trajs, received = batch_trajectories(step_plan(cfg), reply, VERSION, dp, puller)
        puller.close()
        pull_backend = make_backend(model_dir)
        pull = train_step(pull_backend, trajs, dp=dp, **args)
        params = {f"relay.{j}": p.detach() for j, p in enumerate(relay_backend.model.parameters())}
        params.update(
            {f"pull.{j}": p.detach() for j, p in enumerate(pull_backend.model.parameters())}
        )  # noqa: E501
        save_file({k: v.contiguous() for k, v in params.items()}, out / f"rank{rank}.safetensors")
        info = {
            "relay": relay,
            "pull": pull,
            "fetched": [i for i, t in enumerate(trajs) if isinstance(t, Trajectory)],
            "bytes": puller.bytes_in,
            "received": received,
        }
        (out / f"rank{rank}.json").write_text(json.dumps(info))
    finally:
        dp.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", warmup_steps=0)


@pytest.mark.timeout(180)
def test_pulled_shares_train_bit_identically_to_the_relayed_batch(model_dir, tmp_path):
    vocab = make_backend(model_dir).model.config.vocab_size
    trajs = make_trajectories(vocab)
    batch = [t.to_wire() for t in trajs]
    (tmp_path / "batch").write_bytes(wire.pack(batch))
    with holders(tmp_path / "batch", [(0, 6), (6, len(trajs))], tmp_path) as (_, refs):
        assert [r["n_output"] for r in refs] == [t.n_output for t in trajs]
        (tmp_path / "refs").write_bytes(wire.pack(refs))
        mp.spawn(_rank_main, args=(str(model_dir), str(tmp_path), free_port()), nprocs=2)
    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    tensors = [load_file(tmp_path / f"rank{r}.safetensors") for r in range(2)]
    for info, t in zip(infos, tensors, strict=True):
        assert info["pull"] == info["relay"]  # every statistic, to the last bit
        for key in t:
            if key.startswith("pull."):
                assert torch.equal(t[key], t["relay." + key[5:]]), key
    # Each rank fetched exactly its own share (the step's split), no more: disjoint, all.
    cfg = load_config(None, OVERRIDES)
    seqlens = [t.n_prompt + t.n_output for t in trajs]
    seed = step_plan(cfg).prepare_args(VERSION)["seed"]
    for rank, info in enumerate(infos):
        assert info["fetched"] == batch_split(seqlens, 2, seed, DataParallel(rank, 2))[2]
    assert set(infos[0]["fetched"]).isdisjoint(infos[1]["fetched"])
    assert sorted(infos[0]["fetched"] + infos[1]["fetched"]) == list(range(len(trajs)))
    # Bytes: each rank received its share's bytes, about half of the batch's.
    whole = len(wire.pack(batch))
    for info in infos:
        assert 0 < info["bytes"] < 0.8 * whole
        assert info["received"]["data/pulled_bytes"] == infos[0]["bytes"] + infos[1]["bytes"]


def _replica_rank_main(rank: int, tmp: str, port: int) -> None:
    """Rank `rank` of 2 replicas x 2 model-parallel ranks (as Megatron's tp=2, dp=2 lays
    them out: replica r is ranks 2r and 2r+1); records what it got and what it fetched."""
    import torch.distributed as dist

    join_world(rank, 4, port)
    world = init_data_parallel(4, rank, timeout_s=60)
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank makes every group
    models = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp = world.replicas(rank // 2, 2, replicas[rank % 2], models[rank // 2])
    cfg = load_config(None, OVERRIDES)
    out = Path(tmp)
    try:
        reply = {"trajectories": wire.unpack((out / "refs").read_bytes())}
        puller = Puller(KEY, out / "logs")
        trajs, received = batch_trajectories(step_plan(cfg), reply, VERSION, dp, puller)
        puller.close()
        whole = {i: t.to_wire() for i, t in enumerate(trajs) if isinstance(t, Trajectory)}
        info = {"head": dp.replica_head, "bytes": puller.bytes_in, "received": received}
        (out / f"replica_rank{rank}.msgpack").write_bytes(wire.pack({**info, "whole": whole}))
    finally:
        world.close()


@pytest.mark.timeout(180)
def test_one_rank_of_each_replica_pulls_and_shares_within_the_replica(tmp_path):
    """tp x dp = 2 x 2: the head of each replica alone fetches the replica's share from the
    holders; its model-parallel partner gets the same trajectories from it, bit for bit, and
    fetches nothing. The holders serve the batch once, not once per tensor-parallel rank."""
    trajs = make_trajectories(vocab=50)
    batch = [t.to_wire() for t in trajs]
    (tmp_path / "batch").write_bytes(wire.pack(batch))
    with holders(tmp_path / "batch", [(0, 6), (6, len(trajs))], tmp_path) as (_, refs):
        (tmp_path / "refs").write_bytes(wire.pack(refs))
        mp.spawn(_replica_rank_main, args=(str(tmp_path), free_port()), nprocs=4)
    infos = [wire.unpack((tmp_path / f"replica_rank{r}.msgpack").read_bytes()) for r in range(4)]
    assert [i["head"] for i in infos] == [True, False, True, False]
    cfg = load_config(None, OVERRIDES)
    seqlens = [t.n_prompt + t.n_output for t in trajs]
    seed = step_plan(cfg).prepare_args(VERSION)["seed"]
    for replica in (0, 1):
        head, partner = infos[2 * replica], infos[2 * replica + 1]
        share = batch_split(seqlens, 2, seed, DataParallel(replica, 2))[2]
        assert sorted(head["whole"]) == sorted(partner["whole"]) == share
        for i in share:  # the same fields, to the last bit
            packed = wire.pack(batch[i])
            assert wire.pack(head["whole"][i]) == wire.pack(partner["whole"][i]) == packed
        assert head["bytes"] > 0 and partner["bytes"] == 0
    assert infos[0]["received"]["data/pulled_bytes"] == infos[0]["bytes"] + infos[2]["bytes"]
    assert infos[0]["bytes"] + infos[2]["bytes"] < 1.2 * len(wire.pack(batch))


def test_a_killed_holder_fails_the_pull_after_one_retry_naming_it_and_its_log(tmp_path):
    trajs = make_trajectories(vocab=50, n=4)
    (tmp_path / "batch").write_bytes(wire.pack([t.to_wire() for t in trajs]))
    with holders(tmp_path / "batch", [(0, 4)], tmp_path) as (procs, refs):
        puller = Puller(KEY, tmp_path / "logs", timeout_s=1.0)
        refs = [TrajectoryRef.from_wire(r) for r in refs]
        got = puller.pull(refs)
        assert [t.output_ids for t in got] == [t.output_ids for t in trajs]
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)
        t0 = time.monotonic()
        with pytest.raises(PullError) as e:
            puller.pull(refs[:2])
        puller.close()
    msg = str(e.value)
    assert "holder0" in msg and "tried twice" in msg, msg
    assert str(tmp_path / "logs" / "holder0.log") in msg
    assert refs[0].holder in msg
    assert time.monotonic() - t0 >= 2.0  # two attempts of 1 s each, not one


@pytest.mark.timeout(60)
def test_the_harness_replay_feed_trains_each_trajectory_once_within_the_bound(tmp_path):
    """benchmarks/data_plane.py --feed replay: feeders answer the real controller at once and
    hold what they made; the trainer ranks pull it. Behaviour, not speed: every trajectory
    admitted is trained once, fetched once, within the staleness bound, which is reached
    (the feed outruns the trainer); every byte the ranks pulled, the feeders served."""
    root = Path(__file__).parents[2]
    out = tmp_path / "results.json"
    steps, batch, group, max_staleness = 6, 4, 4, 1
    cmd = [
        sys.executable, str(root / "benchmarks/data_plane.py"), "--feed", "replay",
        "--steps", str(steps), "--batch", str(batch), "--group", str(group),
        "--max-staleness", str(max_staleness), "--mean-tokens", "256", "--max-tokens", "1024",
        "--root", str(tmp_path / "runs"), "--timeout", "50", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=55)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (r,) = json.loads(out.read_text())
    assert r["mode"] == "replay" and r["steps"] == steps
    assert r["trained_trajectories"] == steps * batch * group
    assert r["trained_once"]
    assert r["max_staleness"] == max_staleness
    assert r["staleness_max"] <= max_staleness and r["steps_at_the_bound"] > 0
    fed = r["served"]
    assert sum(f["fetched"] for f in fed) == r["trained_trajectories"]  # each fetched once
    assert sum(f["made"] for f in fed) >= r["trained_trajectories"]
    assert r["pulled_bytes"] == r["served_bytes"] > 0
    assert "bound holds" in done.stdout and "each once" in done.stdout
