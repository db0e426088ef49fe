"""Which head launcher.ray_address points at, probed before ray.init (which would retry an
unreachable one for minutes): areal/launcher/ray.py."""

from __future__ import annotations

import socket

import pytest

from areal.launcher.ray import head_address, reachable


@pytest.mark.parametrize(
    ("address", "head"),
    [
        ("10.0.0.5:6379", ("10.0.0.5", 6379)),
        ("ray://head.svc:10001", ("head.svc", 10001)),
        ("local", None),
        ("head-without-port", None),
    ],
)
def test_the_head_of_an_address(address, head):
    assert head_address(address) == head


def test_auto_reads_ray_address(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6390")
    assert head_address("auto") == ("127.0.0.1", 6390)


def test_a_listening_head_is_reachable_and_a_closed_port_is_not():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert reachable(f"127.0.0.1:{port}") is None
    why = reachable(f"127.0.0.1:{port}")  # closed now
    assert why is not None and why.startswith(f"nothing answers at 127.0.0.1:{port} within 5 s")
