"""The weight-update group (areal/weight_group.py) between real processes over gloo:
tensors arrive bit for bit, buckets and specs, and every failure ends within its deadline."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import time

import pytest
import torch

from areal import weight_group as wg
from areal.comm.net import free_port

pytestmark = pytest.mark.timeout(120)

NAMES = ["a", "b", "c", "d", "e"]
DTYPES = ["bfloat16", "float32", "uint8", "int64", "float32"]
SHAPES = [[3, 4], [100_000], [7], [5], [0]]  # an odd size before an int64: alignment


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 4, generator=g).to(torch.bfloat16),
        torch.randn(100_000, generator=g),
        torch.arange(7, dtype=torch.uint8),
        torch.arange(5),
        torch.zeros(0),
    ]


def _receiver(
    port: int, rank: int, world: int, out: mp.Queue, timeout_s: float, backend: str = "gloo",
    shm_dir: str = wg.SHM_DIR,
) -> None:  # fmt: skip
    wg.SHM_DIR = shm_dir  # another node's /dev/shm, for the test that cannot map
    try:
        group = wg.open_group(
            backend=backend, master_address="127.0.0.1", master_port=port, rank=rank,
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


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_every_rank_receives_the_tensors_bit_for_bit(backend):
    """gloo over TCP, or shm: the same bytes through one file in /dev/shm, gone once every
    receiver has mapped it."""
    port, world = free_port("127.0.0.1"), 3
    out = mp.get_context("spawn").Queue()
    procs = [_spawn(_receiver, port, r, world, out, 60.0, backend) for r in (1, 2)]
    group = wg.open_group(
        backend=backend, master_address="127.0.0.1", master_port=port, rank=0,
        world_size=world, group_name="g", timeout_s=60,
    )  # fmt: skip
    sent = _tensors()
    wg.send(group, sent)
    assert not [f for f in os.listdir(wg.SHM_DIR) if f.startswith(f"areal-{os.getpid()}-")]
    replies = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    group.close()
    for rank in (1, 2):
        got = replies[rank]
        assert isinstance(got, dict), got
        for name, t in zip(NAMES, sent, strict=True):
            assert got[name] == t.tolist(), name


def test_a_receiver_that_cannot_map_the_shared_bucket_fails_both_sides_at_once(tmp_path):
    """A receiver on another node (here: another /dev/shm) says so in the handshake: the
    sender fails with what to do, long before the group's deadline, and leaves no file."""
    port = free_port("127.0.0.1")
    out = mp.get_context("spawn").Queue()
    proc = _spawn(_receiver, port, 1, 2, out, 60.0, "shm", str(tmp_path))
    group = wg.open_group(
        backend="shm", master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
        group_name="g", timeout_s=60,
    )  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="could not map .*weights.shared_memory=false"):
        wg.send(group, _tensors())
    assert time.monotonic() - t0 < 10
    rank, reply = out.get(timeout=30)
    assert "could not map the shared bucket" in reply and "No such file" in reply, reply
    assert not [f for f in os.listdir(wg.SHM_DIR) if f.startswith(f"areal-{os.getpid()}-")]
    proc.join(10)
    group.close()


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
    # The kill must land while the sender is inside its broadcast (256 MB to a stopped
    # receiver: blocked until it fails); nothing outside the sender shows that moment.
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


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _round_trip(new: torch.Tensor, old: torch.Tensor) -> dict[str, torch.Tensor]:
    """The delta of new against old, applied to a copy of old: it must give new bit for bit
    (the receiver's checksum passes). Returns the parts."""
    parts = wg.encode_delta("w", new, old)
    state = {"w": old.clone()}
    wg.apply_bucket(state, wg.decode_delta(state, dict(parts)))
    assert torch.equal(_bits(state["w"]), _bits(new))
    return dict(parts)


def _nbytes(parts: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in parts.values())


def _changed(old: torch.Tensor, positions) -> torch.Tensor:
    new = old.clone()
    new.view(-1)[torch.as_tensor(positions)] += 1.0
    return new


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_sparse_delta_is_gaps_of_a_byte_and_round_trips_exactly(dtype):
    g = torch.Generator().manual_seed(0)
    old = torch.randn(64, 32, generator=g).to(dtype)
    # 2% of the entries change, < 100 apart, the first and the last too
    some = torch.arange(0, old.numel(), 50) + torch.randint(1, 50, (41,), generator=g)
    new = _changed(old, [0, *some.clamp(max=old.numel() - 1).tolist(), old.numel() - 1])
    parts = _round_trip(new, old)
    nnz = int((new != old).sum())
    assert list(parts) == ["w:gap8", "w:val", "w:sum"]
    assert parts["w:gap8"].numel() == nnz  # one byte an entry: no gap longer than 255
    assert _nbytes(parts) == nnz * (1 + new.element_size()) + 8
    assert _nbytes(parts) < 0.1 * new.numel() * new.element_size()


@pytest.mark.parametrize(
    ("share", "kind"),
    [(1e-4, "gap16"), (0.003, "gap16"), (0.04, "gap8"), (0.2, "bits"), (0.5, "bits")],
)
def test_random_deltas_of_any_share_round_trip_exactly(share, kind):
    g = torch.Generator().manual_seed(2)
    old = torch.randn(300_001, generator=g).to(torch.bfloat16)
    new = old.clone()
    mask = torch.rand(old.numel(), generator=g) < share
    new[mask] = torch.randn(int(mask.sum()), generator=g).to(torch.bfloat16)
    parts = _round_trip(new, old)
    assert list(parts) == [f"w:{kind}", "w:val", "w:sum"]  # the smallest for the share


def test_long_gaps_follow_the_codes_and_the_smaller_width_is_chosen():
    n = 2**24 + 2**17
    old = torch.zeros(n, dtype=torch.bfloat16)
    # Mostly short gaps with a few of > 255, > 65535 and > 2**24: gap8 with 3 long gaps.
    short = [*range(0, 3000, 3), 3000 + 300, 3300 + 70_000, 73_300 + 2**24 + 7]
    parts = _round_trip(_changed(old, short + [n - 1]), old)
    assert "w:gap8" in parts and parts["w:gap8"].numel() == len(short) + 1 + 8 * 4
    # Sparse: every gap > 255, so 2-byte codes are smaller; two of > 65535 (one > 2**24).
    sparse = [0, *range(1000, 60_000, 1000), 59_000 + 70_000, 129_000 + 2**24 + 1, n - 1]
    parts = _round_trip(_changed(old, sparse), old)
    assert "w:gap16" in parts and parts["w:gap16"].numel() == 2 * len(sparse) + 8 * 2
    parts = _round_trip(_changed(old, [0, n - 1]), old)  # only the first and the last
    assert "w:gap8" in parts and parts["w:gap8"].numel() == 2 + 8


def test_dense_deltas_are_bitmaps_or_whole_and_unchanged_tensors_are_nothing():
    g = torch.Generator().manual_seed(1)
    old = torch.randn(999, 37, generator=g)  # an odd numel: the last word is padded
    third = _changed(old, torch.randperm(old.numel(), generator=g)[: old.numel() // 3])
    parts = _round_trip(third, old)
    assert list(parts) == ["w:bits", "w:val", "w:sum"]
    assert parts["w:bits"].numel() == -(-old.numel() // 8)
    everything = old + 1.0
    assert wg.encode_delta("w", everything, old) == [("w", everything)]
    half = old.to(torch.bfloat16)
    assert wg.encode_delta("w", half + 1, half)[0][0] == "w"  # bf16: a bitmap is not smaller
    for t in (old, torch.zeros(0), torch.tensor(1.5), torch.ones(1, dtype=torch.bfloat16)):
        assert wg.encode_delta("w", t.clone(), t) == []  # unchanged (and empty): nothing
    # 0-d and 1-element tensors go whole; entries compare by bits: -0.0 is a change.
    assert wg.encode_delta("w", torch.tensor(2.5), torch.tensor(1.5)) == [("w", torch.tensor(2.5))]
    zero = torch.zeros(1000)
    negative = zero.clone()
    negative[[3, 200]] = -0.0
    assert "w:gap8" in _round_trip(negative, zero)


def test_a_delta_from_another_base_is_refused_and_undone():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    new = _changed(old, [5, 70, 150])
    parts = dict(wg.encode_delta("a", new, old) + wg.encode_delta("w", new, old))
    other = old.clone()
    other.view(-1)[9] += 1.0  # an entry the delta does not touch
    state = {"a": old.clone(), "w": other.clone()}
    decoded = wg.decode_delta(state, parts)
    assert isinstance(decoded["w"], wg.Patch)
    with pytest.raises(ValueError, match="did not hold the version the delta is from"):
        wg.apply_bucket(state, decoded)
    assert torch.equal(state["a"], old) and torch.equal(state["w"], other)  # both undone
    with pytest.raises(ValueError, match="came as parts"):
        wg.decode_delta(state, {k: v for k, v in parts.items() if k != "w:sum"})
    with pytest.raises(ValueError, match="send it whole"):
        wg.decode_delta({"w": old.float(), "a": old}, parts)
    with pytest.raises(ValueError, match="positions"):
        wg.decode_delta({"w": old.view(-1)[:100], "a": old}, parts)
    with pytest.raises(ValueError, match="not in the model"):
        wg.decode_delta({"a": old}, parts)
    # Whole tensors pass through and are copied after the deltas.
    state = {"a": old.clone(), "w": old.clone()}
    wg.apply_bucket(
        state,
        wg.decode_delta(
            state,
            {"w": new, "a:gap8": parts["a:gap8"], "a:val": parts["a:val"], "a:sum": parts["a:sum"]},
        ),
    )
    assert torch.equal(state["a"], new) and torch.equal(state["w"], new)


def test_buckets_keep_the_parts_of_a_delta_together():
    parts = [("a:gap8", torch.zeros(30)), ("a:val", torch.zeros(30)), ("a:sum", torch.zeros(1))]
    named = [("x", torch.zeros(10)), *parts, ("y", torch.zeros(10))]
    got = [[n for n, _ in b] for b in wg.buckets(named, 100)]
    assert got == [["x"], ["a:gap8", "a:val", "a:sum"], ["y"]]


def test_a_group_goes_through_shared_memory_only_where_every_server_is_on_this_node(tmp_path):
    """The trainer's choice for each new group: shm where every registered server listens on
    this node's address and /dev/shm has room for a version, else gloo's sockets; never
    with weights.shared_memory=false, nor once a server could not map (broadcast.py)."""
    from areal.comm.net import advertised_host
    from areal.comm.registry import Registry
    from areal.config import load_config
    from areal.trainer.broadcast import WeightBroadcaster

    def broadcaster(*overrides: str) -> WeightBroadcaster:
        cfg = load_config(None, [f"fileroot={tmp_path}", "weights.transport=distributed",
                                 "rollout.n_servers=2", *overrides])  # fmt: skip
        return WeightBroadcaster(cfg, tmp_path / "model", 0)

    b = broadcaster()
    registry = Registry(b.cfg.exp_dir)
    registry.register("server", 0, f"http://{advertised_host()}:1")
    assert b._group_backend(1000) == "shm"  # server 1 not up: decided again for its group
    registry.register("server", 1, "http://10.1.2.3:1")
    assert b._group_backend(1000) == "gloo"
    registry.register("server", 1, f"http://{advertised_host()}:2")
    assert b._group_backend(1000) == "shm"
    assert b._group_backend(10**15) == "gloo"  # no room for a version in /dev/shm
    b.shared_memory = False  # what a NotShared failure sets
    assert b._group_backend(1000) == "gloo"
    assert broadcaster("weights.shared_memory=false")._group_backend(1000) == "gloo"


def _buckets_to_share() -> list[list[torch.Tensor]]:
    """Four buckets: two in the first file's slots, one larger (a new file), one after it."""
    return [[torch.full((1000,), float(i)), torch.arange(i + 3)] for i in range(2)] + [
        [torch.full((300_000,), 2.0), torch.arange(5)],
        [torch.full((10,), 3.0), torch.arange(6)],
    ]


def _shared_receiver(port: int, out: mp.Queue) -> None:
    try:
        group = wg.open_group(
            backend="shm", master_address="127.0.0.1", master_port=port, rank=1,
            world_size=2, group_name="g", timeout_s=60,
        )  # fmt: skip
        got = []
        for bucket in _buckets_to_share():
            shapes = [list(t.shape) for t in bucket]
            dtypes = [wg.dtype_name(t.dtype) for t in bucket]
            views = wg.receive(group, ["x", "y"], dtypes, shapes)
            got.append([views[n].tolist() for n in ("x", "y")])  # used before the next
        out.put(got)
        group.close()
    except Exception as e:  # the parent checks it
        out.put(f"{type(e).__name__}: {e}")


def test_shared_buckets_reuse_two_slots_and_a_larger_one_makes_a_new_file():
    """And a new file sweeps away what a killed trainer left: its ring files, not a live one's."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    orphan, other = (os.path.join(wg.SHM_DIR, f"areal-{p.pid}-g-1") for p in (dead, live))
    for path in (orphan, other):
        open(path, "wb").close()
    port = free_port("127.0.0.1")
    out = mp.get_context("spawn").Queue()
    proc = _spawn(_shared_receiver, port, out)
    group = wg.open_group(
        backend="shm", master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
        group_name="g", timeout_s=60,
    )  # fmt: skip
    sent = _buckets_to_share()
    for bucket in sent:
        wg.send(group, bucket)
    assert group.ring.number == 2 and group.buckets == 4
    got = out.get(timeout=60)
    assert got == [[t.tolist() for t in b] for b in sent], str(got)[:300]
    assert not [f for f in os.listdir(wg.SHM_DIR) if f.startswith(f"areal-{os.getpid()}-")]
    assert not os.path.exists(orphan) and os.path.exists(other)
    live.kill()
    os.unlink(other)
    proc.join(30)
    group.close()
