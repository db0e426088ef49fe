"""Nothing waits forever: the suite's per-test timeout, and the rollout worker's recovery."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import tomllib

from areal.rollout.worker import RolloutWorker

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_has_a_timeout_that_still_runs_its_fixtures(tmp_path):
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert 0 < float(ini["timeout"]) <= 600
    # A hanging test under the project's settings (only the limit shortened): it fails
    # with a timeout, and its fixture's teardown (where system tests stop processes) runs.
    (tmp_path / "test_hang.py").write_text(
        textwrap.dedent(
            f"""
            import time, pytest

            @pytest.fixture
            def cleanup():
                yield
                open({str(tmp_path / "cleaned")!r}, "w").close()

            def test_hangs(cleanup):
                time.sleep(10**6)
            """
        )
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "-o", "timeout=2",
         "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_hang.py")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "Timeout" in proc.stdout and time.monotonic() - t0 < 60
    assert (tmp_path / "cleaned").exists()


def test_recovery_gives_up_on_a_server_that_never_comes_back():
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def body():
        fatal: asyncio.Future = asyncio.get_running_loop().create_future()
        worker = RolloutWorker(url, recovery_timeout_s=1.0, on_fatal=fatal.set_result)
        try:
            worker._server_down("test")
            return await asyncio.wait_for(fatal, 30)
        finally:
            await worker.client.close()

    err = asyncio.run(body())
    assert isinstance(err, TimeoutError) and "was not back within 1 s" in str(err)
