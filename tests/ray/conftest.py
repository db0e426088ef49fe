"""tests/ray run against a real Ray cluster that the `cluster` fixture starts on this machine
(tests/ray/cluster.py: a head and two more nodes, 2 CPUs and one fake GPU each)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.ray.cluster import RayTestCluster
from tests.system.conftest import SHARED_MODELS_ENV


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("ray") is not None:
        return
    for item in items:
        if "ray" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs Ray: pip install -e '.[ray]'"))


@pytest.fixture(scope="module")
def cluster():
    c = RayTestCluster(cpus=2, gpus=1).start(workers=2)
    try:
        yield c
    finally:
        c.stop()
    assert c.processes() == []


@pytest.fixture(scope="module", autouse=True)
def shared_tiny_models(tmp_path_factory):
    """The tiny model made once for the module's runs (tests/system/test_run.train_cmd)."""
    if os.environ.get(SHARED_MODELS_ENV):
        yield
        return
    os.environ[SHARED_MODELS_ENV] = str(tmp_path_factory.mktemp("tiny-models"))
    yield
    del os.environ[SHARED_MODELS_ENV]
