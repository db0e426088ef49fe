"""Name registry on shared storage: how roles find each other and share the key.

    {exp_dir}/registry/
    ├── key                   experiment key, hex, mode 0600 (made by create_key)
    ├── controller/0          tcp://host:port
    └── rollout/0, rollout/1  ...

A role binds its server, then `register`s its address; peers `lookup` it. A lookup waits
(polling the file system, which is all NFS/Lustre offer) until the role registers, and is
unblocked by the atomic rename in `register`, so a reader never sees half an address. It
gives up after a timeout with a message that points at the role's log.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

_POLL_S = 0.05
_KEY_BYTES = 32


class Registry:
    """Addresses of running roles, one small file per (role, index)."""

    def __init__(self, exp_dir: str | os.PathLike) -> None:
        self.exp_dir = Path(exp_dir)
        self.root = self.exp_dir / "registry"

    def path(self, role: str, index: int) -> Path:
        return self.root / role / str(index)

    def register(self, role: str, index: int, address: str) -> None:
        """Publish role/index -> address, replacing any earlier entry atomically."""
        path = self.path(role, index)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{index}.tmp.{os.getpid()}")
        tmp.write_text(address)
        os.replace(tmp, path)

    def lookup(self, role: str, index: int, timeout: float = 60.0) -> str:
        """The address of role/index, waiting up to `timeout` seconds for it to register."""
        path = self.path(role, index)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return path.read_text().strip()
            except FileNotFoundError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{role} {index} did not register within {timeout:g} s (no file at {path}): "
                    f"the role may have failed to start; check its log under "
                    f"{self.exp_dir / 'logs'}/"
                )
            time.sleep(_POLL_S)

    def lookup_all(self, role: str, count: int, timeout: float = 60.0) -> list[str]:
        """Addresses of role/0 .. role/count-1, all within one shared `timeout`."""
        deadline = time.monotonic() + timeout
        return [
            self.lookup(role, i, timeout=max(0.0, deadline - time.monotonic()))
            for i in range(count)
        ]

    def unregister(self, role: str, index: int) -> None:
        self.path(role, index).unlink(missing_ok=True)


def _key_path(exp_dir: str | os.PathLike) -> Path:
    return Path(exp_dir) / "registry" / "key"


def create_key(exp_dir: str | os.PathLike) -> bytes:
    """Make the experiment key (mode 0600), or return the existing one if it is there."""
    path = _key_path(exp_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write a private temp file, then hard-link it into place: the link fails if another
    # process made the key first, and a reader never sees an empty or partial key file.
    tmp = path.with_name(f".key.tmp.{os.getpid()}")
    tmp.unlink(missing_ok=True)  # O_EXCL below guarantees the mode is ours, not a leftover's
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(_KEY_BYTES))
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return load_key(exp_dir)


def load_key(exp_dir: str | os.PathLike) -> bytes:
    """The experiment key that create_key wrote."""
    path = _key_path(exp_dir)
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no experiment key at {path}: start the run with python -m areal.train, "
            f"which creates it"
        ) from None
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise ValueError(
            f"the experiment key at {path} is not hex: delete it and restart the run"
        ) from None
