"""The weight-update group (areal/weight_group.py) between real processes over gloo:
tensors arrive bit for bit, buckets and specs, and every failure ends within its deadline."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from areal import weight_group as wg
from areal.comm.net import free_port

pytestmark = pytest.mark.timeout(120)

NAMES = ["a", "b", "c"]
DTYPES = ["bfloat16", "float32", "int64"]
SHAPES = [[3, 4], [100_000], [5]]


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 4, generator=g).to(torch.bfloat16),
        torch.randn(100_000, generator=g),
        torch.arange(5),
    ]


def _receiver(port: int, rank: int, world: int, out: mp.Queue, timeout_s: float) -> None:
    try:
        group = wg.open_group(
            backend="gloo", master_address="127.0.0.1", master_port=port, rank=rank,
            world_size=world, group_name="g", timeout_s=timeout_s,
        )  # fmt: skip
        got = wg.receive(group, NAMES, DTYPES, SHAPES)
        out.put((rank, {k: v.tolist() for k, v in got.items()}))
        group.close()
    except Exception as e:  # the parent checks it
        out.put((rank, f"{type(e).__name__}: {e}"))


def _spawn(target, *args) -> mp.Process:
    p = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    p.start()
    return p


def test_every_rank_receives_the_tensors_bit_for_bit():
    port, world = free_port("127.0.0.1"), 3
    out = mp.get_context("spawn").Queue()
    procs = [_spawn(_receiver, port, r, world, out, 60.0) for r in (1, 2)]
    group = wg.open_group(
        backend="gloo", master_address="127.0.0.1", master_port=port, rank=0,
        world_size=world, group_name="g", timeout_s=60,
    )  # fmt: skip
    sent = _tensors()
    wg.send(group, sent)
    replies = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    group.close()
    for rank in (1, 2):
        got = replies[rank]
        assert isinstance(got, dict), got
        for name, t in zip(NAMES, sent, strict=True):
            assert got[name] == t.tolist(), name


def test_a_rank_that_never_joins_fails_the_others_within_the_deadline():
    t0 = time.monotonic()
    with pytest.raises(Exception, match="timeout|Timeout|timed out"):
        wg.open_group(
            backend="gloo", master_address="127.0.0.1", master_port=free_port("127.0.0.1"),
            rank=0, world_size=2, group_name="g", timeout_s=2,
        )  # fmt: skip
    assert time.monotonic() - t0 < 15


def test_a_receiver_killed_mid_update_fails_the_sender_instead_of_hanging():
    port = free_port("127.0.0.1")
    out = mp.get_context("spawn").Queue()
    # The receiver joins, then is stopped before it receives: the sender's broadcast of a
    # large tensor cannot complete; killed, its socket closes and the sender fails.
    proc = _spawn(_receiver, port, 1, 2, out, 60.0)
    # 20 s: a spawned process imports torch before it joins (over 5 s on a busy 2-core machine).
    group = wg.open_group(
        backend="gloo", master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
        group_name="g", timeout_s=20,
    )  # fmt: skip
    os.kill(proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    big = [torch.zeros(3, 4, dtype=torch.bfloat16), torch.zeros(64_000_000), torch.arange(5)]
    killer = _spawn(_kill_after, proc.pid, 1.0)
    with pytest.raises(Exception):  # noqa: B017 (gloo's error types vary by failure)
        wg.send(group, big)
    assert time.monotonic() - t0 < 30
    group.close()
    killer.join(10)
    proc.join(10)


def _kill_after(pid: int, seconds: float) -> None:
    time.sleep(seconds)
    os.kill(pid, signal.SIGKILL)


def test_buckets_keep_order_and_size_and_spec_describes_them():
    named = [("x", torch.zeros(10)), ("y", torch.zeros(30)), ("z", torch.zeros(5, 2))]
    assert [[n for n, _ in b] for b in wg.buckets(named, 100)] == [["x"], ["y"], ["z"]]
    assert [[n for n, _ in b] for b in wg.buckets(named, 170)] == [["x", "y"], ["z"]]
    assert wg.spec(named[2:]) == {"names": ["z"], "dtypes": ["float32"], "shapes": [[5, 2]]}
    assert wg.dtype_of("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'float33'"):
        wg.dtype_of("float33")
    with pytest.raises(ValueError, match="differ in length"):
        wg.receive(None, ["a"], [], [[1]])


def test_a_delta_gives_the_new_tensor_bit_for_bit_and_only_from_the_old_one():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    new = old.clone()
    new.view(-1)[::50] += 1.0  # 2% of the entries change
    parts = wg.encode_delta("w", new, old)
    assert [n for n, _ in parts] == ["w:idx", "w:val", "w:sum"]
    assert sum(t.numel() * t.element_size() for _, t in parts) < 0.1 * new.numel() * 2
    got = wg.decode_delta({"w": old, "b": old}, dict(parts))
    assert torch.equal(got["w"], new)
    # From weights other than the old ones the checksum refuses it.
    with pytest.raises(ValueError, match="did not hold the version the delta is from"):
        wg.decode_delta({"w": old + 1}, dict(parts))
    with pytest.raises(ValueError, match="lacks its part w:sum"):
        wg.decode_delta({"w": old}, dict(parts[:2]))
    # Where most entries change, the tensor goes whole; whole tensors pass through.
    dense = old + 1
    assert wg.encode_delta("w", dense, old) == [("w", dense)]
    assert wg.decode_delta({"w": old}, {"w": dense})["w"] is dense
    assert wg.encode_delta("w", old.clone(), old) == []  # unchanged: nothing to send


def test_buckets_keep_the_parts_of_a_delta_together():
    parts = [("a:idx", torch.zeros(30)), ("a:val", torch.zeros(30)), ("a:sum", torch.zeros(1))]
    named = [("x", torch.zeros(10)), *parts, ("y", torch.zeros(10))]
    got = [[n for n, _ in b] for b in wg.buckets(named, 100)]
    assert got == [["x"], ["a:idx", "a:val", "a:sum"], ["y"]]
