"""tests/slurm run against a real SLURM cluster (slurm/test_cluster.sh, started by .ci/run)."""

from __future__ import annotations

import shutil
import subprocess

import pytest


def _cluster_problem() -> str | None:
    if shutil.which("sinfo") is None:
        return "no SLURM here (sinfo not found): start one with `sudo slurm/test_cluster.sh start`"
    try:
        proc = subprocess.run(["sinfo", "-h"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo timed out: is slurmctld running? (`slurm/test_cluster.sh start`)"
    if proc.returncode != 0:
        return f"no SLURM cluster reachable (sinfo: {proc.stderr.strip()[:200]})"
    return None


def pytest_collection_modifyitems(config, items):
    problem = None
    checked = False
    for item in items:
        if "slurm" not in item.keywords:
            continue
        if not checked:
            problem, checked = _cluster_problem(), True
        if problem:
            item.add_marker(pytest.mark.skip(reason=problem))
