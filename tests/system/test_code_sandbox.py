"""Hostile programs through the real RewardService: each ends wrong within its limits, the
service stays up, and nothing outside the sandbox changes.

The problem of every case is "read a b, print a+b" with the test "2 3" -> "5"; a hostile
program is built so that it would pass the test if its attack worked, so a wrong verdict
means the attack failed, and the marker checks show it changed nothing outside.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import tempfile
import time
from pathlib import Path

import pytest

from areal.comm.registry import create_key
from areal.config import RewardConfig
from areal.reward.service import RewardService
from areal.tasks.graders import sandbox

DATA = Path(__file__).resolve().parents[1] / "data"
TESTS = [{"input": "2 3\n", "output": "5\n"}]
LIMIT_S = 1.0
SOLUTIONS = [
    "```python\na, b = map(int, input().split())\nprint(a + b)\n```",
    "```python\nn = int(input())\nprint(*sorted(map(int, input().split())))\n```",
    "Here:\n```python\ndef add(a, b):\n    return a + b\n```",
    "```python\nclass Solution:\n    def maxOf(self, nums):\n        return max(nums)\n```",
    "```python\nprint(input()[::-1])\n```",
]


def program(source: str) -> str:
    return f"Let me solve it.\n```python\n{source}\n```"


def grade(responses: list[str], tests=TESTS, **kw) -> tuple[list[float], dict, float]:
    async def go():
        service = RewardService(
            RewardConfig(
                n_workers=kw.get("n_workers", 2),
                timeout_s=kw.get("timeout_s", 20.0),
                correct=5.0,
                wrong=-5.0,
                code_time_limit_s=LIMIT_S,
                code_memory_mb=256,
            )
        )
        try:
            t0 = time.time()
            rewards = await service.grade("code", responses, tests)
            elapsed = time.time() - t0
            # The service is still up and grades correctly after the attack.
            assert await service.grade("code", [SOLUTIONS[0]], TESTS) == [5.0]
            return rewards, await service.stats(), elapsed
        finally:
            service.close()

    return asyncio.run(go())


def sandbox_processes() -> list[int]:
    """Live processes running as a sandbox uid (no other user on the machine has one)."""
    pids = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and entry.stat().st_uid >= sandbox.SANDBOX_UID_BASE:
                pids.append(int(entry.name))
        except OSError:
            pass
    return pids


def no_sandbox_processes_within(seconds: float) -> bool:
    deadline = time.time() + seconds
    while sandbox_processes() and time.time() < deadline:
        time.sleep(0.05)
    return not sandbox_processes()


needs_namespaces = pytest.mark.skipif(
    sandbox.mode() == "plain", reason="needs bwrap or unshare (network and pid namespaces)"
)


@pytest.fixture
def open_dir():
    """A world-writable directory in /tmp, the one place an unconfined nobody could write."""
    d = tempfile.mkdtemp(prefix="areal-outside-")
    os.chmod(d, 0o777)
    yield Path(d)
    for p in Path(d).iterdir():
        p.unlink()
    os.rmdir(d)


def test_correct_and_wrong_programs_for_every_sample_row():
    rows = [json.loads(line) for line in (DATA / "code_sample.jsonl").read_text().splitlines()]
    for row, solution in zip(rows, SOLUTIONS, strict=True):
        wrong = solution.replace("+", "-").replace("max(", "min(").replace("[::-1]", "")
        wrong = wrong.replace("sorted(", "list(")
        rewards, counts, _ = grade([solution, wrong, "no code at all"], tests=row["tests"])
        assert rewards == [5.0, -5.0, -5.0], row["problem"]
        assert counts["errors"] == counts["timeouts"] == 0


@pytest.mark.parametrize(
    "name, source",
    [
        ("infinite loop", "while True:\n    pass"),
        ("sleep", "import time\ntime.sleep(600)\nprint(5)"),
        (
            "fork bomb",
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
            "        pass",
        ),
        ("memory bomb", "x = []\nwhile True:\n    x.append(bytearray(10**7))"),
        ("huge output", "import sys\nwhile True:\n    sys.stdout.write('5' * 65536)"),
    ],
)
def test_resource_attacks_end_wrong_within_their_limits(name, source):
    rewards, counts, elapsed = grade([program(source)])
    assert rewards == [-5.0], name
    assert counts["errors"] == counts["timeouts"] == 0  # the sandbox stopped it, not the pool
    assert elapsed < LIMIT_S + 8, (name, elapsed)
    assert no_sandbox_processes_within(3), name


@pytest.mark.skipif(sandbox.mode() != "bwrap", reason="only bwrap caps the files' total size")
def test_filling_the_disk_stops_at_the_cap():
    source = "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'5' * (1 << 19))\n    i += 1"
    rewards, counts, elapsed = grade([program(source)])
    assert rewards == [-5.0]
    assert elapsed < LIMIT_S + 8
    assert not list(Path(tempfile.gettempdir()).glob("areal-sandbox-*/f0"))


def test_writing_outside_its_directory_changes_nothing(tmp_path, open_dir):
    private = tmp_path / "private_marker"  # under root's 0700 pytest directory
    existing = open_dir / "existing"
    existing.write_text("untouched")
    existing.chmod(0o666)  # even a file anyone may write
    targets = [private, open_dir / "new_marker", Path("/work/areal_marker")]
    if sandbox.mode() == "bwrap":
        targets.append(existing)  # only a private view of the file system protects these
    source = "\n".join(f"open({str(t)!r}, 'w').write('pwned')" for t in targets)
    rewards, _, _ = grade([program(source + "\nprint(5)")])
    assert rewards == [-5.0]
    assert not private.exists() and not Path("/work/areal_marker").exists()
    assert existing.read_text() == "untouched"
    if sandbox.mode() == "bwrap":
        assert not (open_dir / "new_marker").exists()


def test_the_experiment_key_cannot_be_read(tmp_path):
    exp = tmp_path / "exp"
    key = create_key(exp)
    key_file = next((exp / "registry").glob("key*"))
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    tests = [{"input": "", "output": key_file.read_text()}]  # reading the key = passing
    sources = [
        f"print(open({str(key_file)!r}).read())",
        f"import os\nos.chmod({str(key_file)!r}, 0o644)\nprint(open({str(key_file)!r}).read())",
    ]
    rewards, _, _ = grade([program(s) for s in sources], tests=tests)
    assert rewards == [-5.0, -5.0]
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert key


@needs_namespaces
def test_no_network():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    source = (
        "import socket\n"
        f"socket.create_connection(('127.0.0.1', {port}), timeout=0.5).sendall(b'x')\n"
        "print(5)"
    )
    try:
        rewards, _, _ = grade([program(source)])
        assert rewards == [-5.0]
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    finally:
        listener.close()


def test_killing_its_parent_or_everyone_does_not_hurt_the_service():
    source = (
        "import os, signal\n"
        "for pid in (os.getppid(), 1, -1):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "    except OSError:\n"
        "        pass\n"
        "print(4)"
    )
    rewards, counts, _ = grade([program(source), SOLUTIONS[0]])
    assert rewards == [-5.0, 5.0]
    assert counts["errors"] == 0 and counts["timeouts"] == 0  # no grading process died


@needs_namespaces
def test_a_daemonised_child_dies_with_the_sandbox(open_dir):
    marker = open_dir / "late_marker"
    source = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(1.5)\n"
        f"        open({str(marker)!r}, 'w').write('still alive')\n"
        "    os._exit(0)\n"
        "print(4)"
    )
    rewards, _, _ = grade([program(source)])
    assert rewards == [-5.0]
    assert no_sandbox_processes_within(2)
    time.sleep(1.5)  # the child's own 1.5 s: a child still alive would have written by now
    assert not marker.exists()
