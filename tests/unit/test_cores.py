"""Work-conserving cores (areal/cores.py): a waiting role lends its share, a returning role
gets it back within a module, and the engine and the trainer's modules follow the ledger.

The roles read a FakeClock that the tests advance: how long a peer has waited is what the
test says, never what a loaded machine's stalls make it (only the engine, a thread of its
own, runs on the real clock)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from areal import cores, events
from areal.cores import BORROW_AFTER_S, RETURN_WAIT_S, Cores, node_cores
from areal.rollout.engine import DecodeEngine, SamplingParams

pytestmark = pytest.mark.skipif(node_cores() < 2, reason="lending needs two cores")


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _two_cores(monkeypatch):
    """The figures below are a 2-core node's, on any machine (a test may set its own)."""
    monkeypatch.setattr(cores, "node_cores", lambda: 2)


class FakeClock:
    """The roles' clock: it moves only when the test advances it; `reads` counts the calls
    (a role waiting for its share reads it on each poll)."""

    def __init__(self) -> None:
        self.now = 1000.0  # a ledger's 0 means working: any time > 0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def pair(tmp_path, clock: FakeClock | None = None) -> tuple[Cores, Cores]:
    """Two roles of one node, one core each (in one process: torch's threads are the last
    set; the test reads each role's own record)."""
    ledger, clock = tmp_path / "ledger", clock or FakeClock()
    return Cores(1, ledger, 0, 2, clock), Cores(1, ledger, 1, 2, clock)


def start(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def assert_polling(thread: threading.Thread, clock: FakeClock, message: str) -> None:
    """`thread` (a role's work()) waits for its share: it polls (reads the clock again and
    again) and does not return. Fails at once if it returns; 10 s at most otherwise."""
    reads, deadline = clock.reads, time.monotonic() + 10
    while thread.is_alive() and clock.reads < reads + 5 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert thread.is_alive() and clock.reads >= reads + 5, message


def assert_returns(thread: threading.Thread) -> None:
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_a_waiting_role_lends_its_share_and_gets_it_back(tmp_path) -> None:
    clock = FakeClock()
    a, b = pair(tmp_path, clock)
    a.work()
    b.work()
    assert a.adapt() == 1
    b.wait()
    clock.advance(BORROW_AFTER_S * 0.9)
    assert a.adapt() == 1  # a gap shorter than BORROW_AFTER_S lends nothing
    clock.advance(BORROW_AFTER_S * 0.2)
    assert a.adapt() == 2
    # b returns: it waits until a, at its next unit of work, hands the core back.
    back = start(b.work)
    assert_polling(back, clock, "b started beside a borrower still holding b's core")
    assert a.adapt() == 1
    assert_returns(back)
    assert (a.threads, b.threads) == (1, 1)
    # A borrower that never hands back (a long op without hooks) delays a by RETURN_WAIT_S.
    a.wait()
    clock.advance(BORROW_AFTER_S * 1.1)
    assert b.adapt() == 2
    back = start(a.work)
    assert_polling(back, clock, "a started beside a borrower still holding a's core")
    clock.advance(RETURN_WAIT_S * 0.9)
    assert_polling(back, clock, "a gave up on its share before RETURN_WAIT_S")
    clock.advance(RETURN_WAIT_S * 0.2)
    assert_returns(back)


def test_borrowers_leave_the_cores_that_grading_uses(tmp_path, monkeypatch) -> None:
    """The reward service's grading processes compute without a share: while one grades, a
    borrower keeps to its own share, and borrows again once the grading ends."""
    clock = FakeClock()
    a, b = pair(tmp_path, clock)
    monkeypatch.setenv(cores.CPU_LEDGER_ENV, str(tmp_path / "ledger"))
    monkeypatch.setenv(cores.CPU_GRADING_ENV, "2")  # after the two roles' slots
    grading = cores.Grading()
    a.work()
    b.wait()
    clock.advance(BORROW_AFTER_S * 1.1)
    assert a.adapt() == 2
    with grading.computing():
        assert a.adapt() == 1
        with grading.computing():  # more grading than cores lends nothing, takes nothing
            assert a.adapt() == 1
    assert grading.busy == 0 and a.adapt() == 2


def test_grading_without_a_ledger_is_a_no_op(monkeypatch) -> None:
    monkeypatch.delenv(cores.CPU_GRADING_ENV, raising=False)
    grading = cores.Grading()
    with grading.computing():
        assert grading.busy == 1
    assert grading.busy == 0


def test_borrowers_split_a_lent_share_and_never_exceed_the_cores(tmp_path, monkeypatch) -> None:
    """Two servers beside one trainer: a lent share is split, never taken by each borrower
    (on 2 cores, 4 threads spinning on them made a decode step 5x as costly)."""
    monkeypatch.setattr(cores, "node_cores", lambda: 64)
    ledger, clock = tmp_path / "ledger", FakeClock()
    trainer, s1, s2, s3 = (Cores(16, ledger, slot, 4, clock) for slot in range(4))
    for role in (trainer, s1, s2, s3):
        role.work()
    assert [r.adapt() for r in (trainer, s1, s2)] == [16, 16, 16]  # nothing lent
    trainer.wait()
    clock.advance(BORROW_AFTER_S * 1.1)
    # The trainer's 16 cores, split among the three working roles: 6, 5 (and 5 for the 4th).
    assert [s1.adapt(), s2.adapt()] == [22, 21]
    # Back to work: the trainer waits for the servers to hand back its share, not longer.
    back = start(trainer.work)
    assert_polling(back, clock, "the trainer started beside borrowers still holding its share")
    assert [s1.adapt(), s2.adapt()] == [16, 16]
    assert_returns(back)


def test_servers_lend_but_never_borrow(tmp_path, monkeypatch) -> None:
    """A server (borrows=False) lends its share and keeps its own; the cores it would have
    borrowed go to the roles that borrow (server.py: a decode step's small parallel regions
    stall on a borrowed thread that any other process preempts)."""
    monkeypatch.setattr(cores, "node_cores", lambda: 64)
    ledger, clock = tmp_path / "ledger", FakeClock()
    trainer = Cores(16, ledger, 0, 4, clock)
    servers = [Cores(16, ledger, slot, 4, clock, borrows=False) for slot in (1, 2, 3)]
    for role in (trainer, *servers):
        role.work()
    servers[0].wait()
    clock.advance(BORROW_AFTER_S * 1.1)
    assert trainer.adapt() == 32 and [s.adapt() for s in servers[1:]] == [16, 16]
    trainer.wait()
    servers[0].work()
    clock.advance(BORROW_AFTER_S * 1.1)
    assert [s.adapt() for s in servers] == [16, 16, 16]


def test_more_roles_than_cores_lend_nothing_and_never_wait(tmp_path, monkeypatch) -> None:
    """Three roles of one thread on 2 cores: a waiting role's core is already taken."""
    monkeypatch.setattr(cores, "node_cores", lambda: 2)
    ledger, clock = tmp_path / "ledger", FakeClock()
    trainer, s1, s2 = (Cores(1, ledger, slot, 3, clock) for slot in range(3))
    s1.work()
    s2.work()
    trainer.wait()
    clock.advance(BORROW_AFTER_S * 1.1)
    assert [s1.adapt(), s2.adapt()] == [1, 1]
    # Its share was never taken: no wait (on the fake clock a wait would never end).
    assert_returns(start(trainer.work))
    assert trainer.adapt() == 1


def test_threads_mean_counts_working_time_only(tmp_path) -> None:
    clock = FakeClock()
    a, b = pair(tmp_path, clock)
    b.wait()
    a.work()
    assert a.threads == 1  # b was waiting less than BORROW_AFTER_S when a started
    clock.advance(0.6)  # one thread
    assert a.adapt() == 2
    clock.advance(0.1)  # two threads
    a.wait()
    clock.advance(0.2)  # waiting: not counted
    assert a.threads_mean() == pytest.approx((0.6 + 2 * 0.1) / 0.7, rel=1e-9)


def test_computing_on_lent_cores_is_recorded_as_a_borrow_span(tmp_path, monkeypatch) -> None:
    log = events.EventLog(tmp_path / "events/trainer0.jsonl", "trainer0")
    monkeypatch.setattr(events, "_log", log)
    clock = FakeClock()
    a, b = pair(tmp_path, clock)
    a.work()
    b.wait()
    clock.advance(BORROW_AFTER_S * 1.1)
    t0 = time.time()
    assert a.adapt() == 2
    a.adapt()  # still borrowing: one span goes on
    time.sleep(0.05)  # the span's length, in wall-clock time (the events' clock)
    a.wait()  # a waiting role's threads sleep: the span ends
    t1 = time.time()
    a.work()  # still lent: a new span
    a.wait()
    log.flush()
    spans = events.read_events(tmp_path)
    assert [(s["role"], s["kind"], s["lent"]) for s in spans] == [("trainer0", "borrow", 1)] * 2
    assert t0 - 0.01 <= spans[0]["start"] and 0.05 <= spans[0]["end"] - spans[0]["start"]
    assert spans[0]["end"] <= t1 <= spans[1]["start"]


def test_the_trainer_borrows_and_hands_back_layer_by_layer(tmp_path) -> None:
    clock = FakeClock()
    a, b = pair(tmp_path, clock)
    model = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(4)])  # as model.layers
    a.follow(model)
    seen: list[tuple[str, int]] = []
    for i, layer in enumerate(model):  # registered after follow's hooks: they see its choice
        layer.register_forward_pre_hook(lambda m, x, i=i: seen.append((f"f{i}", a.threads)))
        layer.register_full_backward_pre_hook(lambda m, g, i=i: seen.append((f"b{i}", a.threads)))

    def b_returns(grad: torch.Tensor) -> None:  # in the backward, as layer 2's starts
        # b starts working in a thread of its own (another process in a run): it marks the
        # ledger at once, then waits for a to hand its share back at a's next layer.
        threading.Thread(target=b.work, daemon=True).start()
        deadline = time.monotonic() + 10
        while b.lending and time.monotonic() < deadline:
            time.sleep(0.001)

    a.work()
    b.wait()
    clock.advance(BORROW_AFTER_S * 1.1)
    x = torch.randn(3, 8, requires_grad=True)
    h = model[2](model[1](model[0](x)))
    h.register_hook(b_returns)  # after follow's hook on the same tensor
    model[3](h).sum().backward()
    assert seen == [("f0", 2), ("f1", 2), ("f2", 2), ("f3", 2),
                    ("b3", 2), ("b2", 2), ("b1", 1), ("b0", 1)]  # fmt: skip


def test_a_large_layers_parts_adapt_too(tmp_path, monkeypatch) -> None:
    """A lent share is taken within a part of a large layer (its attention, its MLP), not
    only at the next layer: a 4M model's layer takes 0.2 s of backward."""
    monkeypatch.setattr(cores, "LARGE_LAYER", 50)  # the large layer: 72 parameters, the small 6
    a, _ = pair(tmp_path)
    small = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())])
    large = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())])
    calls = []
    monkeypatch.setattr(a, "adapt", lambda: calls.append(1))
    for model, per_pass in ((small, 1), (large, 3)):  # the layer; or it and its 2 parts
        a.follow(model)
        calls.clear()
        model[0](torch.randn(1, model[0][0].in_features, requires_grad=True)).sum().backward()
        assert len(calls) == 2 * per_pass  # forward and backward


def test_the_engine_lends_while_it_has_nothing_to_generate(tmp_path) -> None:
    config = Qwen2Config(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True, eos_token_id=0,
    )  # fmt: skip
    server, trainer = pair(tmp_path)
    trainer.work()
    engine = DecodeEngine(Qwen2ForCausalLM(config), num_threads=server, max_total_tokens=4096)
    engine.start()  # idle from the start: the thread lends before any request
    try:
        deadline = time.monotonic() + 10
        while not server.lending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.lending, "an idle engine did not lend its share"
        params = SamplingParams(max_new_tokens=2000, ignore_eos=True)
        running = engine.submit("r", [1, 2, 3], params)
        while server.lending and time.monotonic() < deadline:
            time.sleep(0.001)
        assert not server.lending, "a generating engine still lends its share"
        engine.abort("r")
        running.result(timeout=10)
        while not server.lending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.lending
    finally:
        engine.shutdown()
