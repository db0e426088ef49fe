"""Work-conserving cores: the CPU roles of a node that compute (embedded servers, trainer
ranks) lend their cores to each other while they wait.

Each such role has a base share of the node's cores (cores // roles, as when the split was
fixed) and a slot in its node's ledger, a small shared-memory file: since when it waits (a
server with nothing to generate, or held by the staleness bound; a trainer waiting for its
batch), or 0 while it works, and the threads it uses. Before each unit of work (a decode
step; each layer of the trainer's forward and backward) a role sets its torch threads to
its share plus an equal part of the shares of the peers that have waited BORROW_AFTER_S
(several borrowers split a lent share; their threads never exceed the node's cores, so
with more roles than cores nobody borrows). On a 2-core laptop the trainer so trains on
both cores while the server is held by eta; a server lends but does not borrow (below).

Two threads on one core cost far more than one idle core (a 2-thread training step beside
a busy 1-thread server took 1.6x as long as with one thread each): a role that starts
working waits, RETURN_WAIT_S at most, until its borrowing peers hand its share back, which
they do at their next layer or decode step; and a short gap (a weight update, a
batch of requests arriving) lends nothing. Reading the ledger costs a microsecond and
torch.set_num_threads under one. Who generates, who trains and the staleness bound are
as before: only the threads inside each role change.

On by default (launcher.lend_idle_cores; false gives the fixed split). Measured on 2 cores
at eta=4 with one training batch in flight (rollout.max_concurrent=0): 2,341 -> 2,799 tok/s
(4M parameters, 128 new tokens), 2,274 -> 2,733 (64 new tokens, 16 x 4), 12.7-13.8k ->
13.2-16.0k (145k parameters): the server, ahead of the trainer, is held by eta for a third
of each step and the trainer takes its core. With many more rows in flight than one batch,
every update interrupts them all and the re-prefills keep the server busy: nothing to lend.

    ledger slot (three doubles): [waiting since (CLOCK_MONOTONIC, node-wide) or 0 = working,
                                  threads in use, 1 if it borrows]
    a new ledger reads 0: every role working, no share lent before its owner says so

Servers lend and never borrow (role_cores(borrows=False)): a decode step is some fifty small
parallel regions, and a borrowed thread that any other process of the node preempts (the
controller, a rollout worker, the reward service, the server's own HTTP thread) stalls each
of them. In runs of configs/tiny_longtail.yaml (40 steps, median of 3, 2026-11-29) a server's
decode step on a borrowed second thread took 1.09x its one-thread time (alone it is 0.67-0.77x
at 128 rows), single steps at max_staleness 2 up to 0.6 s against 7 ms: with servers not
borrowing, 5,983 -> 7,066 tok/s at max_staleness 4 and 6,711 -> 7,634 at 8. The trainer's
layers are larger: on a lent core they ran 1.02-1.16x faster (two profiles of that config).

A role that computes on lent shares records it as a `borrow` span (areal/events.py), with
`lent` the shares borrowed: the report's timeline then counts a lane that waits while its
core computes for a peer as lent, not idle.

The reward service's grading pool computes too (sympy under math-verify, a sandboxed
program), in bursts and without a share of its own: its slot, after the roles', holds the
cores its grading processes use at the moment, and borrowers leave those to it (a borrowed
thread beside a grading process would stretch every layer of a training step). Graded
cheaply (areal/reward/service.py screens most math answers) it holds none.

    grading slot (the last): [0, cores grading now]    (zeros: nothing grading)
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import mmap
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from areal import events

if TYPE_CHECKING:  # imported where used: the launcher reads the names below without torch
    import torch

CPU_SHARE_ENV = "AREAL_CPU_SHARE"
"""Set on the CPU steps that compute (servers, trainer ranks): how many share the node's cores."""
CPU_LEDGER_ENV = "AREAL_CPU_LEDGER"
"""Set with launcher.lend_idle_cores: the path of the node's ledger..."""
CPU_SLOT_ENV = "AREAL_CPU_SLOT"
"""...and the step's slot in it (its index among the computing steps of its node)."""
CPU_GRADING_ENV = "AREAL_CPU_GRADING"
"""Set on the reward service where it shares a lending node: the grading slot's index (the
number of computing steps of its node)."""

BORROW_AFTER_S = 0.05
"""A peer's share is borrowed once it has waited this long (not in the gaps of its work)."""
LARGE_LAYER = 500_000
"""Parameters of a layer whose parts also adapt (cores.follow)."""
RETURN_WAIT_S = 0.05
"""The longest a role that starts working waits for its share to be handed back."""


def node_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class CoreMeter:
    """The cores of this process's CPU set that other processes leave free, measured from
    /proc/stat over the time since the last call (since it was made, for the first). Where a
    process computes before any role has started (the tiny model's warm-up), it takes these
    and no more: with other runs on the node, a thread on a core they keep busy makes every
    step wait for it (a longtail warm-up step, load average 9 on 2 cores: 1.69 s on 2
    threads, 0.25 s on 1).
    Without /proc/stat (not Linux) every core counts as free."""

    def __init__(self, stat: str = "/proc/stat") -> None:
        self.stat = stat
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self._names = {f"cpu{i}" for i in cpus}
        self._n = len(cpus) or node_cores()
        self._last = self._sample()

    def _sample(self) -> tuple[int, int, float, float] | None:
        """(busy, total) jiffies of this process's CPUs, its own CPU seconds, the time."""
        try:
            with open(self.stat) as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        busy = total = 0
        for line in lines:
            name, *fields = line.split()
            if name in self._names:
                ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq ...
                busy += sum(ticks) - ticks[3] - ticks[4]
                total += sum(ticks)
        return (busy, total, time.process_time(), time.monotonic()) if total else None

    def free(self) -> float:
        """Cores free of other processes' work since the last call (this one's excluded)."""
        now, last = self._sample(), self._last
        self._last = now
        if now is None or last is None or now[1] <= last[1] or now[3] <= last[3]:
            return float(self._n)
        busy = self._n * (now[0] - last[0]) / (now[1] - last[1])
        own = (now[2] - last[2]) / (now[3] - last[3])
        return min(float(self._n), max(0.0, self._n - max(0.0, busy - own)))

    def threads(self, share: int) -> int:
        """Threads for the next stretch of work: the free cores (a core counts when 90% of
        it is free), at least one, at most `share`."""
        return max(1, min(share, int(self.free() + 0.1)))


def role_threads(configured: int) -> int:
    """Torch threads of a computing role: `configured` if > 0, else (0, the default) the cores
    this process may run on divided among the roles sharing them (AREAL_CPU_SHARE): on a
    2-core laptop a server and a trainer get one each, on a 64-core node 32 each."""
    if configured > 0:
        return configured
    return max(1, node_cores() // max(1, int(os.environ.get(CPU_SHARE_ENV, "1"))))


def role_cores(configured: int, borrows: bool = True) -> Cores:
    """The threads of a computing role: role_threads, plus (if it `borrows`) the shares its
    node's waiting roles lend where the launcher gave it a ledger (configured > 0: fixed,
    lends nothing)."""
    ledger = os.environ.get(CPU_LEDGER_ENV)
    if configured > 0 or not ledger:
        return Cores(role_threads(configured))
    roles = int(os.environ.get(CPU_SHARE_ENV, "1"))
    slot = int(os.environ[CPU_SLOT_ENV])
    return Cores(role_threads(0), Path(ledger), slot, roles, borrows=borrows)


def ledger_path(exp_dir: str | Path) -> str:
    """One ledger per run and node: in memory (/dev/shm) where the node has it."""
    run = hashlib.sha1(str(Path(exp_dir).resolve()).encode()).hexdigest()[:16]
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(root, f"areal-cores-{run}")


def _remove(ledger: Path) -> None:
    """The first role to leave removes the name; the others keep their mapping."""
    with contextlib.suppress(OSError):
        os.unlink(ledger)


SLOT = 3
"""Doubles per ledger slot: waiting since, threads, borrows."""


def _open_ledger(ledger: Path, slots: int) -> memoryview:
    size = 8 * SLOT * slots
    fd = os.open(ledger, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)  # zeros: every role working, nothing lent or grading
        view = memoryview(mmap.mmap(fd, size)).cast("d")
    finally:
        os.close(fd)
    atexit.register(_remove, ledger)
    return view


class Grading:
    """The reward service's grading slot: how many cores its grading processes use now
    (a no-op where the launcher gave it none: a GPU node, a fixed split)."""

    def __init__(self) -> None:
        self.busy = 0
        self._ledger: memoryview | None = None
        ledger, slot = os.environ.get(CPU_LEDGER_ENV), os.environ.get(CPU_GRADING_ENV)
        if ledger and slot is not None:
            self._slot = int(slot)
            self._ledger = _open_ledger(Path(ledger), self._slot + 1)

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Around one grading in the pool."""
        self._add(1)
        try:
            yield
        finally:
            self._add(-1)

    def _add(self, n: int) -> None:
        self.busy += n
        if self._ledger is not None:
            self._ledger[SLOT * self._slot + 1] = min(self.busy, node_cores())


class Cores:
    """This process's torch threads: `share` always, plus the shares that waiting peers lend
    (without a ledger, `share` alone: a fixed split).

    `clock` gives every time the ledger holds and is compared with, and the working time of
    threads_mean: CLOCK_MONOTONIC, which every process of the node reads alike (a test
    passes a clock it advances itself)."""

    def __init__(
        self,
        share: int,
        ledger: Path | None = None,
        slot: int = 0,
        roles: int = 1,
        clock: Callable[[], float] = time.monotonic,
        borrows: bool = True,
    ) -> None:
        self.clock = clock
        self.borrows = borrows
        self.share = max(1, share)
        self.limit = max(self.share, node_cores())
        self.slot = slot
        self.threads = 0
        self._borrowing_since: float | None = None  # wall clock, for the borrow span
        # Thread-seconds and seconds of work since the last threads_mean() (a metric).
        self._working_since: float | None = None
        self._thread_s = self._work_s = 0.0
        self._ledger: memoryview | None = None
        self._peers = [i for i in range(roles) if i != slot]
        self._grading = roles  # the grading slot
        if ledger is not None and roles > 1:
            self._ledger = _open_ledger(ledger, roles + 1)
            self._ledger[SLOT * slot + 2] = float(borrows)
        self._set(self.share)

    def work(self) -> None:
        """This role has work from now on: it takes back its share, waiting briefly for
        peers that borrowed it to hand it back, and borrows what waiting peers lend."""
        if self._working_since is not None:
            self.adapt()
            return
        self._working_since = self.clock()
        if self._ledger is not None:
            self._ledger[SLOT * self.slot] = 0.0
            deadline = self._working_since + RETURN_WAIT_S
            while self._peers_hold_mine() and self.clock() < deadline:
                time.sleep(0.002)
        self.adapt()

    def wait(self) -> None:
        """This role waits from now on (for a batch, for requests): its share is lent."""
        self._account()
        self._end_borrow()
        self._working_since = None
        if self._ledger is not None:
            self._ledger[SLOT * self.slot] = self.clock()

    @property
    def lending(self) -> bool:
        """Whether the ledger says this role waits (its share lent to peers with work)."""
        return self._ledger is not None and self._ledger[SLOT * self.slot] > 0

    def adapt(self) -> int:
        """Set the threads for the next unit of work: the share plus its part of the lent cores."""
        if self._ledger is not None and self.borrows:
            # The cores beside the shares of the roles that hold theirs (working, or waiting
            # less than BORROW_AFTER_S) go to those of them that borrow in equal parts, the
            # remainder to the lowest slots: two borrowers never take the same lent share,
            # and where shares alone fill the node (more roles than cores) nobody borrows.
            now, ledger = self.clock(), self._ledger
            holders = [self.slot]
            holders += [i for i in self._peers if not 0 < ledger[SLOT * i] <= now - BORROW_AFTER_S]
            free = self.limit - self.share * len(holders) - int(ledger[SLOT * self._grading + 1])
            borrowers = sorted(i for i in holders if i == self.slot or ledger[SLOT * i + 2])
            extra, rest = divmod(max(0, free), len(borrowers))
            extra += borrowers.index(self.slot) < rest
            self._set(self.share + extra)
            if self.threads > self.share and self._borrowing_since is None:
                self._borrowing_since = time.time()
        return self.threads

    def follow(self, model: torch.nn.Module) -> None:
        """Adapt before each layer of `model`'s forward and of its backward (the elements of
        its ModuleLists: HF's model.layers, Megatron's decoder.layers), so that a share is
        handed back within one layer's time."""
        import torch

        if self._ledger is None:
            return  # a fixed split never changes

        def before_forward(_module: torch.nn.Module, _args: tuple) -> None:
            self.adapt()

        def before_backward(_grad: torch.Tensor) -> None:
            self.adapt()

        def after_forward(_module: torch.nn.Module, _args: tuple, output: object) -> None:
            out = output[0] if isinstance(output, tuple) else output
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(before_backward)  # runs as this layer's backward starts

        # Layers, not every module: hooks on each of a small model's modules cost more than
        # lending gains (the 145k-parameter model's step: 0.06 -> 0.075 s). A large layer's
        # parts too (attention, MLP, norms): waiting for the end of a 4M model's layer (0.2 s
        # of backward) left 40% of the server's waits unlent.
        for layers in (m for m in model.modules() if isinstance(m, torch.nn.ModuleList)):
            for layer in layers:
                big = sum(p.numel() for p in layer.parameters()) >= LARGE_LAYER
                for part in (layer, *layer.children()) if big else (layer,):
                    part.register_forward_pre_hook(before_forward)
                    part.register_forward_hook(after_forward)

    def threads_mean(self) -> float:
        """The mean threads of this role's work since the last call (its share if none)."""
        self._account()
        mean = self._thread_s / self._work_s if self._work_s else float(self.threads)
        self._thread_s = self._work_s = 0.0
        return mean

    def _peers_hold_mine(self) -> bool:
        """Whether the working peers use threads of this role's share: more than the cores
        beside it, or than their own shares where shares alone fill the node (a waiting
        peer's threads sleep)."""
        ledger = self._ledger
        working = [i for i in self._peers if ledger[SLOT * i] == 0]
        threads = sum(ledger[SLOT * i + 1] or self.share for i in working)
        return threads > max(self.limit - self.share, self.share * len(working))

    def _account(self) -> None:
        if self._working_since is not None:
            now = self.clock()
            self._thread_s += self.threads * (now - self._working_since)
            self._work_s += now - self._working_since
            self._working_since = now

    def _end_borrow(self) -> None:
        if self._borrowing_since is not None:
            lent = -(-(self.threads - self.share) // self.share)  # shares, rounded up
            events.record("borrow", self._borrowing_since, time.time(), lent=lent)
            self._borrowing_since = None

    def _set(self, threads: int) -> None:
        if threads != self.threads:
            import torch

            self._account()
            self._end_borrow()
            torch.set_num_threads(threads)
            self.threads = threads
            if self._ledger is not None:
                self._ledger[SLOT * self.slot + 1] = threads
