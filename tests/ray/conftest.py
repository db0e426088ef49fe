"""tests/ray run against a real Ray cluster that the `cluster` fixture starts on this machine
(tests/ray/cluster.py: a head and two more nodes, 2 CPUs and one fake GPU each)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.ray.cluster import RayTestCluster


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


@pytest.fixture(autouse=True)
def tiny_models_from_the_session_cache(tmp_path):
    """A Ray run keeps its tiny model under {fileroot}/models (every node must see it); here
    that directory is the session's cache (tests/conftest.py): the runs make it once."""
    from areal.models.cache import cache_dir

    cache_dir().mkdir(parents=True, exist_ok=True)
    (tmp_path / "models").symlink_to(cache_dir(), target_is_directory=True)
