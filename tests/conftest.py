"""Skips for tests that need hardware or installs this machine may lack (pyproject markers):
`gpu` needs a CUDA device; `sglang` needs one too, and SGLang's supported version importable
by $AREAL_SGLANG_PYTHON (default: this interpreter). And a cache of the session's own."""

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


@pytest.fixture(scope="session", autouse=True)
def shared_tiny_models(tmp_path_factory):
    """The session's cache of tiny models (areal/models/cache.py; runs inherit it): every run
    of a config in the session shares its model, and no test touches the user's cache."""
    from areal.models.cache import CACHE_ENV

    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("cache"))
    yield
    if before is None:
        del os.environ[CACHE_ENV]
    else:
        os.environ[CACHE_ENV] = before


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords or "sglang" in item.keywords:
            reason = _no_gpu()
            if reason is None and "sglang" in item.keywords:
                reason = _no_sglang()
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
