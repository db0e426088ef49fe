"""The shell blocks of docs/get-started/cpu.md run as written, on the tiny default.

Two changes only, as the page says: every `python -m areal.train` gets the extra overrides of
$AREAL_DOCS_RUN_ARGS (default `total_train_steps=3`, so the page runs in about a minute),
and /tmp/areal is a temporary directory. A block after `<!-- docs-test: skip (why) -->` is
not run (the install, the whole test suite).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "get-started" / "cpu.md"
RUN_ARGS_ENV = "AREAL_DOCS_RUN_ARGS"

_BLOCK = re.compile(r"(<!-- docs-test: skip[^>]*-->\s*\n)?```bash\n(.*?)```", re.S)


def blocks(text: str) -> list[tuple[str, bool]]:
    """(the block's commands, skipped) for every bash block of a page, in order."""
    return [(m.group(2), bool(m.group(1))) for m in _BLOCK.finditer(text)]


def test_the_page_parses():
    found = blocks(PAGE.read_text())
    assert [b for b, skipped in found if skipped and "pip install" in b]
    assert any("python -m areal.train --config configs/tiny.yaml" in b for b, s in found if not s)


@pytest.mark.timeout(600)
def test_the_cpu_get_started_blocks_run_as_written(tmp_path):
    run_args = os.environ.get(RUN_ARGS_ENV, "total_train_steps=3")
    root = tmp_path / "areal"
    # A `python` that is the page's own everywhere but for areal.train's extra overrides.
    prelude = f"""
set -euo pipefail
python() {{
  if [ "${{1:-}} ${{2:-}}" = "-m areal.train" ]; then
    command python3 "$@" {run_args} fileroot={root}
  else
    command python3 "$@"
  fi
}}
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ran = 0
    for commands, skipped in blocks(PAGE.read_text()):
        if skipped:
            continue
        script = prelude + commands.replace("/tmp/areal", str(root))
        start = time.monotonic()
        proc = subprocess.run(
            ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, f"{commands}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        print(f"{time.monotonic() - start:6.1f}s  {commands.strip().splitlines()[0]}")
        ran += 1
    assert ran >= 3
    # What the page says the run leaves behind.
    assert (root / "tiny/run0/metrics.jsonl").exists()
    assert (root / "tiny/run0/report/reward.png").exists()
    assert (root / "tiny/report-compare/compare.png").exists()
