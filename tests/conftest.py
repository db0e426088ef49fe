"""Skips for tests that need hardware or installs this machine may lack (pyproject markers):
`gpu` needs a CUDA device; `sglang` needs one too, and SGLang's supported version importable
by $AREAL_SGLANG_PYTHON (default: this interpreter)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

import pytest


@functools.cache
def _no_gpu() -> str | None:
    try:
        import torch

        if torch.cuda.is_available():
            return None
    except ImportError:
        pass
    # SGLang may live in another environment with a CUDA torch while this one has a CPU one.
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and "GPU" in out.stdout:
                return None
        except (OSError, subprocess.TimeoutExpired):
            pass
    return "needs a CUDA GPU"


@functools.cache
def _no_sglang() -> str | None:
    from areal.rollout.backends import load_backend

    python = os.environ.get("AREAL_SGLANG_PYTHON") or sys.executable
    problem = load_backend("sglang").version_problem(python)
    return f"needs SGLang (set AREAL_SGLANG_PYTHON): {problem}" if problem else None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords or "sglang" in item.keywords:
            reason = _no_gpu()
            if reason is None and "sglang" in item.keywords:
                reason = _no_sglang()
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
